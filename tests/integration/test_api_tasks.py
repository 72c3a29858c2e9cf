"""Integration: /v1/tasks create (grid, cap, checks), Idempotency-Key, cursor pagination,
cancel, jobs, events, models, tenant isolation and the error shape of bad input."""

from __future__ import annotations

import itertools

from sqlalchemy import select

from service.models import Event, Job, Task
from tests.integration.factories import safetensors_bytes


def test_models_list(client, factory):  # noqa: ANN001
    t = factory.tenant()
    r = client.get("/v1/models", headers=t.headers)
    assert r.status_code == 200
    data = r.json()["data"]
    assert [m["id"] for m in data] == ["big-model", "tiny-llama"]
    assert data[1]["max_seq_len"] == 512 and "path" not in data[1]
    assert client.get("/v1/models").status_code == 401


def test_a_task_shows_the_one_evaluation_cadence_it_uses(client, factory, session):  # noqa: ANN001
    """Issue 43: a new task showed eval_every_steps 50 beside eval_every_samples 1024 (the
    cadence used, as the README says); the one not in use shows null, tasks stored before too."""
    t = factory.tenant()
    default = factory.task(t)
    assert (default["eval"]["eval_every_samples"], default["eval"]["eval_every_steps"]) == (
        1024, None)
    steps = factory.task(t, eval={"eval_every_steps": 20})
    assert (steps["eval"]["eval_every_samples"], steps["eval"]["eval_every_steps"]) == (None, 20)
    nulled = factory.task(t, eval={"eval_every_samples": None})
    assert (nulled["eval"]["eval_every_samples"], nulled["eval"]["eval_every_steps"]) == (None, 50)
    stored = session.get(Task, default["id"])
    stored.settings = {**stored.settings, "eval": {**stored.settings["eval"],
                                                   "eval_every_steps": 50}}
    session.commit()
    got = client.get(f"/v1/tasks/{default['id']}", headers=t.headers).json()["eval"]
    assert (got["eval_every_samples"], got["eval_every_steps"]) == (1024, None)


def test_models_show_parameters_counted_from_the_weights_headers(client, factory, settings,
                                                                 tmp_path):  # noqa: ANN001
    """Issue 43: a model registered without `parameters` (the quick start's demo model) shows
    the count of its safetensors headers, not null; no weight is loaded."""
    demo = tmp_path / "demo-model"
    demo.mkdir()
    (demo / "model.safetensors").write_bytes(safetensors_bytes(
        {"embed.weight": ([3, 2], bytes(24)), "lm_head.weight": ([2, 3], bytes(24))}))
    models = settings.models_file.read_text() + (
        f"  - name: demo\n    path: {demo}\n    gpus: 1\n    max_seq_len: 256\n")
    settings.models_file.write_text(models)
    t = factory.tenant()
    data = {m["id"]: m for m in client.get("/v1/models", headers=t.headers).json()["data"]}
    assert data["demo"]["parameters"] == 12
    assert data["tiny-llama"]["parameters"] == 1_000_000  # the models file's value stays
    assert client.get("/v1/models/demo", headers=t.headers).json()["parameters"] == 12


def test_create_expands_grid(client, factory):  # noqa: ANN001
    t = factory.tenant()
    space = {"learning_rate": [1e-4, 2e-4], "lora_rank": [4, 8, 16], "lora_alpha": [8, 16],
             "batch_size": [2]}
    task = factory.task(t, search_space=space, epochs=2, seed=7)
    assert task["state"] == "queued" and task["num_jobs"] == 12
    assert task["job_counts"] == {"pending": 12}
    assert task["early_exit"]["window"] == 2 and task["early_exit"]["tau_gap"] == 0.1
    assert task["early_exit"]["keep_fraction"] == 0.25
    jobs = client.get(f"/v1/tasks/{task['id']}/jobs", headers=t.headers).json()["data"]
    got = [(j["hyperparameters"]["learning_rate"], j["hyperparameters"]["lora_rank"],
            j["hyperparameters"]["lora_alpha"], j["hyperparameters"]["batch_size"]) for j in jobs]
    want = list(itertools.product(space["learning_rate"], space["lora_rank"],
                                  space["lora_alpha"], space["batch_size"]))
    assert got == want
    assert all(j["state"] == "pending" and j["best_val_loss"] is None for j in jobs)
    assert [j["index"] for j in jobs] == list(range(12))
    one = client.get(f"/v1/jobs/{jobs[3]['id']}", headers=t.headers)
    assert one.status_code == 200 and one.json()["hyperparameters"]["lora_alpha"] == 16


def test_create_rejects_bad_requests(client, factory, settings):  # noqa: ANN001
    t = factory.tenant()
    f = factory.file(t)["id"]
    base = {"base_model": "tiny-llama", "training_file": f, "max_seq_len": 128}

    def post(**kw):  # noqa: ANN003, ANN202
        return client.post("/v1/tasks", headers=t.headers, json=base | kw)

    too_many = {"learning_rate": [1e-5, 2e-5, 3e-5, 4e-5, 5e-5], "lora_rank": [4, 8, 16, 32]}
    r = post(search_space=too_many)
    assert r.status_code == 422 and settings.max_configurations < 20
    assert r.json()["error"] == {"code": "too_many_configurations", "param": "search_space",
                                 "type": "invalid_request_error",
                                 "message": r.json()["error"]["message"]}
    assert "20 configurations" in r.json()["error"]["message"]
    cases = [
        ({"base_model": "nope"}, "base_model"),
        ({"max_seq_len": 4096}, "max_seq_len"),
        ({"search_space": {"learning_rate": [-1.0]}}, "search_space.learning_rate"),
        ({"search_space": {"lora_rank": []}}, "search_space.lora_rank"),
        ({"search_space": {"lora_rank": [4, 4]}}, "search_space.lora_rank"),
        ({"search_space": {"dropout": [0.1]}}, "search_space.dropout"),
        ({"epochs": 0}, "epochs"),
        ({"method": "ppo"}, "method"),
        ({"method": "dpo"}, "training_file"),
        ({"early_exit": {"window": 0}}, "early_exit.window"),
        ({"unknown_field": 1}, "unknown_field"),
    ]
    for kw, param in cases:
        r = post(**kw)
        assert r.status_code == 422, (kw, r.text)
        assert r.json()["error"]["param"] == param, (kw, r.json())
    r = post(training_file="file_doesnotexist")
    assert r.status_code == 404 and r.json()["error"]["param"] == "training_file"
    r = client.post("/v1/tasks", headers=t.headers | {"Content-Type": "application/json"},
                    content=b"{not json")
    assert r.status_code == 422 and set(r.json()["error"]) == {"type", "code", "message", "param"}
    r = client.post("/v1/tasks", headers=t.headers, json=[1, 2])
    assert r.status_code == 422
    tiny = factory.file(t, [{"prompt": "a", "completion": "b"}])["id"]
    r = post(training_file=tiny)
    assert r.status_code == 422 and r.json()["error"]["param"] == "training_file"
    assert client.get("/v1/tasks", headers=t.headers).json()["data"] == []


def test_idempotency_key(client, factory):  # noqa: ANN001
    t, other = factory.tenant(), factory.tenant()
    f = factory.file(t)["id"]
    body = {"base_model": "tiny-llama", "training_file": f, "max_seq_len": 64}
    h = t.headers | {"Idempotency-Key": "abc-1"}
    first = client.post("/v1/tasks", headers=h, json=body)
    second = client.post("/v1/tasks", headers=h, json=body)
    assert first.status_code == 201 and second.status_code == 200
    assert second.headers["Idempotent-Replayed"] == "true"
    assert first.json()["id"] == second.json()["id"]
    r = client.post("/v1/tasks", headers=h, json=body | {"seed": 3})
    assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_key_reused"
    assert len(client.get("/v1/tasks", headers=t.headers).json()["data"]) == 1
    # Keys are per tenant: the same key elsewhere is a different request.
    of = factory.file(other)["id"]
    r = client.post("/v1/tasks", headers=other.headers | {"Idempotency-Key": "abc-1"},
                    json=body | {"training_file": of})
    assert r.status_code == 201 and r.json()["id"] != first.json()["id"]


def test_list_pagination(client, factory):  # noqa: ANN001
    t = factory.tenant()
    f = factory.file(t)["id"]
    ids = [factory.task(t, f)["id"] for _ in range(5)]
    page1 = client.get("/v1/tasks", headers=t.headers, params={"limit": 2}).json()
    assert [x["id"] for x in page1["data"]] == ids[::-1][:2] and page1["has_more"]
    page2 = client.get("/v1/tasks", headers=t.headers,
                       params={"limit": 2, "after": page1["last_id"]}).json()
    page3 = client.get("/v1/tasks", headers=t.headers,
                       params={"limit": 2, "after": page2["last_id"]}).json()
    assert [x["id"] for x in page2["data"]] == ids[::-1][2:4]
    assert [x["id"] for x in page3["data"]] == ids[:1] and not page3["has_more"]
    assert client.get("/v1/tasks", headers=t.headers, params={"limit": 0}).status_code == 422


def test_cancel(client, factory, session):  # noqa: ANN001
    t = factory.tenant()
    task = factory.task(t)
    r = client.post(f"/v1/tasks/{task['id']}/cancel", headers=t.headers)
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    assert r.json()["job_counts"] == {"cancelled": 4} and r.json()["finished_at"]
    again = client.post(f"/v1/tasks/{task['id']}/cancel", headers=t.headers)
    assert again.status_code == 200 and again.json()["state"] == "cancelled"
    types = [e.type for e in session.scalars(
        select(Event).where(Event.task_id == task["id"]).order_by(Event.id))]
    assert types == ["task_created", "task_queued", "task_cancelled"]
    assert session.scalar(select(Job).where(Job.task_id == task["id"])).state == "cancelled"


def test_events_cursor(client, factory):  # noqa: ANN001
    t = factory.tenant()
    task = factory.task(t)
    client.post(f"/v1/tasks/{task['id']}/cancel", headers=t.headers)
    url = f"/v1/tasks/{task['id']}/events"
    everything = client.get(url, headers=t.headers).json()
    ids = [e["id"] for e in everything["data"]]
    assert len(ids) == 3 and ids == sorted(ids) and not everything["has_more"]
    first = client.get(url, headers=t.headers, params={"limit": 1}).json()
    assert first["has_more"] and first["last_id"] == ids[0]
    rest = client.get(url, headers=t.headers, params={"after": first["last_id"]}).json()
    assert [e["id"] for e in rest["data"]] == ids[1:]
    empty = client.get(url, headers=t.headers, params={"after": ids[-1]}).json()
    assert empty["data"] == [] and empty["last_id"] == ids[-1]
    assert client.get(url, headers=t.headers, params={"after": "x"}).status_code == 422


def test_tenant_isolation(client, factory):  # noqa: ANN001
    a, b = factory.tenant(), factory.tenant()
    task = factory.task(a)
    job = client.get(f"/v1/tasks/{task['id']}/jobs", headers=a.headers).json()["data"][0]
    tid = task["id"]
    for method, path in [
        ("get", f"/v1/tasks/{tid}"), ("post", f"/v1/tasks/{tid}/cancel"),
        ("get", f"/v1/tasks/{tid}/jobs"), ("get", f"/v1/tasks/{tid}/events"),
        ("get", f"/v1/tasks/{tid}/metrics"), ("get", f"/v1/tasks/{tid}/adapter"),
        ("get", f"/v1/jobs/{job['id']}"), ("get", f"/v1/jobs/{job['id']}/adapter"),
    ]:
        r = getattr(client, method)(path, headers=b.headers)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["code"] == "not_found"
    assert client.get("/v1/tasks", headers=b.headers).json()["data"] == []
    # b cannot train on a's file either.
    r = client.post("/v1/tasks", headers=b.headers, json={
        "base_model": "tiny-llama", "training_file": task["training_file"]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "training_file"
    assert client.get(f"/v1/tasks/{tid}", headers=a.headers).json()["state"] == "queued"


def test_adapter_before_done(client, factory):  # noqa: ANN001
    t = factory.tenant()
    task = factory.task(t)
    r = client.get(f"/v1/tasks/{task['id']}/adapter", headers=t.headers)
    assert r.status_code == 409 and r.json()["error"]["code"] == "task_not_succeeded"
    job = client.get(f"/v1/tasks/{task['id']}/jobs", headers=t.headers).json()["data"][0]
    r = client.get(f"/v1/jobs/{job['id']}/adapter", headers=t.headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
    r = client.get(f"/v1/jobs/{job['id']}/adapter", headers=t.headers, params={"format": "rar"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "format"
    assert client.get("/v1/nowhere", headers=t.headers).status_code == 404
    assert client.put(f"/v1/tasks/{task['id']}", headers=t.headers).status_code == 405


def test_idempotency_key_race(client, factory):  # noqa: ANN001
    from concurrent.futures import ThreadPoolExecutor

    t = factory.tenant()
    f = factory.file(t)["id"]
    body = {"base_model": "tiny-llama", "training_file": f, "max_seq_len": 64}
    h = t.headers | {"Idempotency-Key": "race"}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: client.post("/v1/tasks", headers=h, json=body),
                                range(4)))
    assert sorted(r.status_code for r in results) == [200, 200, 200, 201]
    assert len({r.json()["id"] for r in results}) == 1
    assert len(client.get("/v1/tasks", headers=t.headers).json()["data"]) == 1


def test_state_filter_metrics_filters_and_plan_times(client, factory):  # noqa: ANN001
    t = factory.tenant()
    f = factory.file(t)["id"]
    a, b, c = (factory.task(t, f)["id"] for _ in range(3))
    client.post(f"/v1/tasks/{b}/cancel", headers=t.headers)
    queued = client.get("/v1/tasks", headers=t.headers, params={"state": "queued"}).json()
    assert [x["id"] for x in queued["data"]] == [c, a]
    page = client.get("/v1/tasks", headers=t.headers,
                      params={"state": "queued", "limit": 1, "after": b}).json()
    assert [x["id"] for x in page["data"]] == [a]  # a cursor outside the filter still works
    assert client.get("/v1/tasks", headers=t.headers,
                      params={"state": "sleeping"}).status_code == 422

    node = factory.node()
    pid = factory.placement(a, node)
    got = client.get(f"/v1/tasks/{a}", headers=t.headers).json()
    assert got["attempt"] == 1 and got["planned_start"] is not None
    assert client.get(f"/v1/tasks/{c}", headers=t.headers).json()["planned_start"] is None

    w = factory.worker
    client.post(f"/internal/v1/placements/{pid}/claim", headers=w, json={"node_id": node})
    j0, j1 = (j["id"] for j in client.get(f"/v1/tasks/{a}/jobs",
                                          headers=t.headers).json()["data"][:2])
    pts = [{"job_id": j, "step": s, "split": "train", "loss": 1.0 / s}
           for j in (j0, j1) for s in (1, 2, 3)]
    assert client.post(f"/internal/v1/tasks/{a}/metrics", headers=w,
                       json={"placement_id": pid, "points": pts}).json() == {"stored": 6}
    url = f"/v1/tasks/{a}/metrics"
    one = client.get(url, headers=t.headers, params={"job_id": j1, "after_step": 1}).json()
    assert [c_["job_id"] for c_ in one["jobs"]] == [j1]
    assert [p["step"] for p in one["jobs"][0]["train"]] == [2, 3]
    # a job id of the documented shape that is none of the task's: 404; a malformed one: 422
    assert client.get(url, headers=t.headers, params={"job_id": "job_" + "0" * 24}).status_code == 404
    assert client.get(url, headers=t.headers, params={"job_id": "job_x"}).status_code == 422


def test_methods_validation_files_and_held_out_split(client, factory, session):  # noqa: ANN001
    from service.models import Task

    t = factory.tenant()
    pref = factory.file(t, [{"prompt": f"p{i}", "chosen": "good", "rejected": "bad"}
                            for i in range(10)])["id"]
    chat = factory.file(t)["id"]  # 12 records
    dpo = factory.task(t, pref, method="dpo")
    assert dpo["method"] == "dpo" and dpo["validation_file"] is None
    # 10% of 10 records held out for validation -> 9 to train on.
    assert session.get(Task, dpo["id"]).num_train_samples == 9
    r = client.post("/v1/tasks", headers=t.headers, json={
        "base_model": "tiny-llama", "training_file": chat, "validation_file": pref})
    assert r.status_code == 422 and r.json()["error"]["param"] == "validation_file"
    sft = factory.task(t, chat, validation_file=chat, max_seq_len=None)
    assert sft["validation_file"] == chat and sft["max_seq_len"] == 512  # the model's limit
    assert session.get(Task, sft["id"]).num_train_samples == 12


def test_dpo_task_gets_beta_as_a_grid_knob(client, factory, settings):  # noqa: ANN001
    t = factory.tenant()
    pref = factory.file(t, [{"prompt": f"p{i}", "chosen": "good", "rejected": "bad"}
                            for i in range(10)])["id"]
    space = {"learning_rate": [1e-4], "lora_rank": [4, 8], "beta": [0.1, 0.5]}
    dpo = factory.task(t, pref, method="dpo", search_space=space)
    assert dpo["num_jobs"] == 4 and dpo["search_space"]["beta"] == [0.1, 0.5]
    jobs = client.get(f"/v1/tasks/{dpo['id']}/jobs", headers=t.headers).json()["data"]
    got = [(j["hyperparameters"]["lora_rank"], j["hyperparameters"]["beta"]) for j in jobs]
    assert got == list(itertools.product([4, 8], [0.1, 0.5]))
    default = factory.task(t, pref, method="dpo")  # beta defaults to 0.1
    jobs = client.get(f"/v1/tasks/{default['id']}/jobs", headers=t.headers).json()["data"]
    assert {j["hyperparameters"]["beta"] for j in jobs} == {0.1} and len(jobs) == 4
    # an sft grid is not multiplied by beta, and its jobs carry no beta
    sft = factory.task(t, search_space=space)
    assert sft["num_jobs"] == 2
    jobs = client.get(f"/v1/tasks/{sft['id']}/jobs", headers=t.headers).json()["data"]
    assert all("beta" not in j["hyperparameters"] for j in jobs)
    for bad in ([0.0], [-1.0], [10.5], [0.1, 0.1], []):
        r = client.post("/v1/tasks", headers=t.headers, json={
            "base_model": "tiny-llama", "training_file": pref, "method": "dpo",
            "search_space": {"beta": bad}})
        assert r.status_code == 422 and r.json()["error"]["param"] == "search_space.beta", bad
    # beta counts toward the configuration cap of a dpo task only
    n = settings.max_configurations
    wide = {"learning_rate": [1e-4], "lora_rank": [4], "beta": [0.01 * (i + 1) for i in range(n + 1)]}
    r = client.post("/v1/tasks", headers=t.headers, json={
        "base_model": "tiny-llama", "training_file": pref, "method": "dpo", "search_space": wide})
    assert r.status_code == 422 and r.json()["error"]["code"] == "too_many_configurations"
    assert factory.task(t, search_space=wide)["num_jobs"] == 1


def test_orpo_task_gets_orpo_lambda_as_a_grid_knob(client, factory, settings):  # noqa: ANN001
    """ORPO (contract.methods) through POST /v1/tasks: its lambda a bounded grid knob of its
    own tasks alone, on DPO's preference files, and its dry run."""
    t = factory.tenant()
    pref = factory.file(t, [{"prompt": f"p{i}", "chosen": "good", "rejected": "bad"}
                            for i in range(10)])["id"]
    space = {"learning_rate": [1e-4], "lora_rank": [4, 8], "orpo_lambda": [0.1, 0.5]}
    orpo = factory.task(t, pref, method="orpo", search_space=space)
    assert orpo["method"] == "orpo" and orpo["num_jobs"] == 4
    assert orpo["search_space"]["orpo_lambda"] == [0.1, 0.5]
    jobs = client.get(f"/v1/tasks/{orpo['id']}/jobs", headers=t.headers).json()["data"]
    got = [(j["hyperparameters"]["lora_rank"], j["hyperparameters"]["orpo_lambda"]) for j in jobs]
    assert got == list(itertools.product([4, 8], [0.1, 0.5]))
    assert all("beta" not in j["hyperparameters"] for j in jobs)
    default = factory.task(t, pref, method="orpo")  # orpo_lambda defaults to 0.1
    jobs = client.get(f"/v1/tasks/{default['id']}/jobs", headers=t.headers).json()["data"]
    assert {j["hyperparameters"]["orpo_lambda"] for j in jobs} == {0.1}
    # a dpo (and an sft) grid is not multiplied by orpo_lambda, and its jobs carry none
    dpo = factory.task(t, pref, method="dpo", search_space=space)
    assert dpo["num_jobs"] == 2
    jobs = client.get(f"/v1/tasks/{dpo['id']}/jobs", headers=t.headers).json()["data"]
    assert all("orpo_lambda" not in j["hyperparameters"] for j in jobs)
    for bad in ([0.0], [-1.0], [10.5], [0.1, 0.1], [], ["x"], 0.1):
        r = client.post("/v1/tasks", headers=t.headers, json={
            "base_model": "tiny-llama", "training_file": pref, "method": "orpo",
            "search_space": {"orpo_lambda": bad}})
        assert r.status_code == 422 and r.json()["error"]["param"] == "search_space.orpo_lambda", bad
    r = client.post("/v1/tasks", headers=t.headers, json={
        "base_model": "tiny-llama", "training_file": factory.file(t)["id"], "method": "orpo"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "training_file"
    assert "preference" in r.json()["error"]["message"]
    r = client.post("/v1/tasks?dry_run=true", headers=t.headers, json={
        "base_model": "tiny-llama", "training_file": pref, "method": "orpo", "search_space": space})
    assert r.status_code == 200, r.text
    est = r.json()
    assert est["method"] == "orpo" and est["num_jobs"] == 4
    assert {j["hyperparameters"]["orpo_lambda"] for j in est["jobs"]} == {0.1, 0.5}
