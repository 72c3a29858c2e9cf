"""Integration: the OpenAI-compatible fine-tuning API (/v1/fine_tuning/jobs) over tasks — shapes,
search spaces and "auto", metadata filter and cursor, bad input (4xx naming the OpenAI param,
nothing created), dry runs (nothing created), pause/resume transitions with a claimed attempt
(reports still land, its stop report pauses it, no failed attempt counted), events and
checkpoints of a finished job, GET /v1/models/{id}."""

from __future__ import annotations

import io
import json

from sqlalchemy import func, select

from service.cluster import next_attempt
from service.models import Event, File, IdempotencyKey, Job, MetricPoint, Placement, Task
from tests.integration.factories import safetensors_bytes

PREFS = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(12)]


def counts(session) -> dict:  # noqa: ANN001
    session.expire_all()
    return {m.__name__: session.scalar(select(func.count()).select_from(m))
            for m in (Task, Job, Event, Placement, IdempotencyKey, File)}


def ft(client, tenant, body: dict, **params):  # noqa: ANN001, ANN201
    return client.post("/v1/fine_tuning/jobs", headers=tenant.headers, json=body, params=params)


def test_create_retrieve_list_shapes(client, factory) -> None:  # noqa: ANN001
    t = factory.tenant()
    train = factory.file(t)["id"]
    body = {"model": "tiny-llama", "training_file": train, "suffix": "my-bot", "seed": 7,
            "metadata": {"team": "search", "run": "a"},
            "method": {"type": "supervised", "supervised": {"hyperparameters": {
                "learning_rate_multiplier": [1, 3], "batch_size": 4, "n_epochs": 2,
                "lora_rank": [4, 8]}}}}
    r = ft(client, t, body)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "fine_tuning.job" and job["status"] == "queued"
    assert job["model"] == "tiny-llama" and job["training_file"] == train
    assert isinstance(job["created_at"], int) and job["finished_at"] is None
    assert job["seed"] == 7 and job["metadata"] == {"team": "search", "run": "a"}
    assert job["fine_tuned_model"] is None and job["error"] is None
    assert job["organization_id"] == t.id and job["result_files"] == []
    assert job["num_jobs"] == 4 and job["suffix"] == "my-bot"
    assert job["hyperparameters"] == {"batch_size": 4, "learning_rate_multiplier": [1, 3],
                                      "n_epochs": 2, "lora_rank": [4, 8], "lora_alpha": 16.0}
    assert job["method"]["type"] == "supervised"
    assert job["method"]["supervised"]["hyperparameters"]["n_epochs"] == 2
    # a fine-tuning job IS a task: same id, the native view agrees
    task = client.get(f"/v1/tasks/{job['id']}", headers=t.headers).json()
    assert task["state"] == "queued" and task["epochs"] == 2 and task["seed"] == 7
    assert task["search_space"]["learning_rate"] == [1e-4, 3e-4]
    assert task["metadata"] == {"team": "search", "run": "a"} and task["suffix"] == "my-bot"
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=t.headers).json() == job

    # "auto" (and knobs left out) is the documented default space: 3 rates x 2 ranks, the rates
    # around the model's centre (tiny-llama: a llama of 1M parameters, 1e-3), in units of 1e-4
    auto = ft(client, t, {"model": "tiny-llama", "training_file": train,
                          "metadata": {"team": "ads"}}).json()
    assert auto["num_jobs"] == 6, auto
    assert auto["hyperparameters"]["learning_rate_multiplier"] == [3.3, 10, 30]
    auto_task = client.get(f"/v1/tasks/{auto['id']}", headers=t.headers).json()
    assert auto_task["search_space"]["learning_rate"] == [3.3e-4, 1e-3, 3e-3]
    # big-model: a llama of 70B parameters, centre 1e-4
    big = ft(client, t, {"model": "big-model", "training_file": train}, dry_run="true").json()
    assert [j["hyperparameters"]["learning_rate"] for j in big["jobs"][::2]] == [3.3e-5, 1e-4,
                                                                                  3e-4], big
    # legacy top-level hyperparameters = supervised
    legacy = ft(client, t, {"model": "tiny-llama", "training_file": train,
                            "hyperparameters": {"learning_rate_multiplier": 2,
                                                "lora_rank": 4}}).json()
    assert legacy["num_jobs"] == 1 and legacy["method"]["type"] == "supervised"
    # dpo with a beta search space
    prefs = factory.file(t, PREFS, "prefs.jsonl")["id"]
    dpo = ft(client, t, {"model": "tiny-llama", "training_file": prefs, "method": {
        "type": "dpo", "dpo": {"hyperparameters": {"beta": [0.1, 0.5], "lora_rank": 4,
                                                   "learning_rate_multiplier": 1}}}})
    assert dpo.status_code == 200, dpo.text
    assert dpo.json()["num_jobs"] == 2
    assert dpo.json()["method"]["dpo"]["hyperparameters"]["beta"] == [0.1, 0.5]

    listed = client.get("/v1/fine_tuning/jobs", headers=t.headers).json()
    assert listed["object"] == "list" and listed["has_more"] is False
    assert [j["id"] for j in listed["data"]] == [dpo.json()["id"], legacy["id"], auto["id"],
                                                 job["id"]]
    page = client.get("/v1/fine_tuning/jobs", headers=t.headers, params={"limit": 2}).json()
    assert page["has_more"] is True and len(page["data"]) == 2
    rest = client.get("/v1/fine_tuning/jobs", headers=t.headers,
                      params={"limit": 2, "after": page["data"][-1]["id"]}).json()
    assert [j["id"] for j in rest["data"]] == [auto["id"], job["id"]]
    only = client.get("/v1/fine_tuning/jobs", headers=t.headers,
                      params={"metadata[team]": "search"}).json()["data"]
    assert [j["id"] for j in only] == [job["id"]]
    assert client.get("/v1/fine_tuning/jobs", headers=t.headers,
                      params={"metadata[team]": "nobody"}).json()["data"] == []
    other = factory.tenant()
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=other.headers
                      ).status_code == 404
    assert client.get("/v1/fine_tuning/jobs", headers=other.headers).json()["data"] == []


def test_bad_input_names_the_param_and_creates_nothing(client, factory, session) -> None:  # noqa: ANN001
    t = factory.tenant()
    train = factory.file(t)["id"]
    prefs = factory.file(t, PREFS, "prefs.jsonl")["id"]
    base = {"model": "tiny-llama", "training_file": train}
    sup = "method.supervised.hyperparameters"
    cases = [
        ({"model": "nope"}, 422, "model"),
        ({"training_file": "file-missing"}, 404, "training_file"),
        ({"training_file": prefs}, 422, "training_file"),
        ({"method": {"type": "supervised", "supervised": {"hyperparameters": {
            "batch_size": "big"}}}}, 422, f"{sup}.batch_size"),
        ({"method": {"type": "supervised", "supervised": {"hyperparameters": {
            "learning_rate_multiplier": [1, -2]}}}}, 422, f"{sup}.learning_rate_multiplier"),
        ({"method": {"type": "supervised", "supervised": {"hyperparameters": {
            "lora_rank": [4, 4]}}}}, 422, f"{sup}.lora_rank"),
        ({"method": {"type": "supervised", "supervised": {"hyperparameters": {
            "beta": 0.2}}}}, 422, f"{sup}.beta"),
        ({"method": {"type": "supervised", "supervised": {"hyperparameters": {
            "n_epochs": [1, 2]}}}}, 422, f"{sup}.n_epochs"),
        ({"method": {"type": "reinforcement"}}, 422, "method.type"),
        ({"method": {"type": "dpo", "supervised": {}}}, 422, "method.supervised"),
        ({"hyperparameters": {"batch_size": 2}, "method": {"type": "supervised"}}, 422,
         "hyperparameters"),
        ({"method": {"type": "supervised", "supervised": {"hyperparameters": {
            "learning_rate_multiplier": [0.1, 0.2, 0.3, 0.4, 0.5],
            "lora_rank": [1, 2, 4, 8]}}}}, 422, sup),
        ({"suffix": "bad suffix!"}, 422, "suffix"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, 422, "metadata"),
        ({"integrations": [{"type": "wandb"}]}, 422, "integrations.wandb"),
        ({"unknown_field": 1}, 422, "unknown_field"),
    ]
    before = counts(session)
    for patch, status, param in cases:
        r = ft(client, t, base | patch)
        assert r.status_code == status, (patch, r.text)
        error = r.json()["error"]
        assert error["param"] == param, (patch, error)
        assert error["type"] == "invalid_request_error" and error["code"] and error["message"]
        r = ft(client, t, base | patch, dry_run="true")
        assert r.status_code == status and r.json()["error"]["param"] == param, (patch, r.text)
    assert counts(session) == before
    r = client.get("/v1/fine_tuning/jobs", headers=t.headers, params={"after": "task_nope"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "after"
    r = client.post("/v1/fine_tuning/jobs", json=base)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_dry_run_validates_estimates_and_creates_nothing(client, factory, session) -> None:  # noqa: ANN001
    t = factory.tenant()
    train = factory.file(t)["id"]
    factory.node(gpus=2)
    before = counts(session)
    r = client.post("/v1/tasks", headers=t.headers, params={"dry_run": "true"}, json={
        "base_model": "tiny-llama", "training_file": train, "epochs": 2,
        "search_space": {"learning_rate": [1e-4, 3e-4], "lora_rank": [4, 8], "batch_size": [2]}})
    assert r.status_code == 200, r.text
    est = r.json()
    assert est["dry_run"] is True and est["num_jobs"] == 4 and len(est["jobs"]) == 4
    assert est["jobs"][0] == {"index": 0, "hyperparameters": {
        "learning_rate": 1e-4, "lora_rank": 4, "lora_alpha": 16.0, "batch_size": 2}}
    # 12 records, 10% held out -> 11 per epoch, 2 epochs, batch 2 -> 11 steps per job
    assert est["train_samples"] == 11 and est["epochs"] == 2
    assert est["trained_tokens"] > 0
    assert est["expected_tokens"] <= est["trained_tokens"]
    assert est["gpus"] == 1 and est["estimated_gpu_hours"] > 0
    assert est["estimated_start"] is not None
    assert est["estimated_finish"] >= est["estimated_start"]
    assert counts(session) == before
    r = ft(client, t, {"model": "tiny-llama", "training_file": train}, dry_run="true")
    assert r.status_code == 200 and r.json()["num_jobs"] == 6, r.text
    assert r.json()["jobs"][5]["hyperparameters"]["learning_rate"] == 3e-3
    assert counts(session) == before
    # the native "auto": the same grid around the model's centre (tiny-llama: 1e-3)
    native = {"base_model": "tiny-llama", "training_file": train,
              "search_space": {"learning_rate": "auto", "lora_rank": [4]}}
    r = client.post("/v1/tasks", headers=t.headers, params={"dry_run": "true"}, json=native)
    assert r.status_code == 200, r.text
    assert [j["hyperparameters"]["learning_rate"] for j in r.json()["jobs"]] == [3.3e-4, 1e-3, 3e-3]
    assert counts(session) == before
    r = client.post("/v1/tasks", headers=t.headers | {"Idempotency-Key": "auto-1"}, json=native)
    assert r.status_code == 201 and r.json()["search_space"]["learning_rate"] == [3.3e-4, 1e-3,
                                                                                   3e-3], r.text
    again = client.post("/v1/tasks", headers=t.headers | {"Idempotency-Key": "auto-1"}, json=native)
    assert again.json()["id"] == r.json()["id"]
    before = counts(session)
    r = client.post("/v1/tasks", headers=t.headers, params={"dry_run": "true"}, json={
        "base_model": "tiny-llama", "training_file": train,
        "search_space": {"learning_rate": [2.0]}})
    assert r.status_code == 422 and r.json()["error"]["param"] == "search_space.learning_rate"
    assert counts(session) == before


def _claimed(client, factory, t) -> tuple[str, str, str, list[str]]:  # noqa: ANN001
    """A task of two jobs whose first attempt is claimed: (task, node, placement, job ids)."""
    task = factory.task(t, search_space={"learning_rate": [1e-4, 3e-4], "lora_rank": [4]})
    node = factory.node()
    pid = factory.placement(task["id"], node)
    r = client.post(f"/internal/v1/placements/{pid}/claim", headers=factory.worker,
                    json={"node_id": node})
    assert r.status_code == 200, r.text
    jobs = [j["id"] for j in client.get(f"/v1/tasks/{task['id']}/jobs",
                                        headers=t.headers).json()["data"]]
    for job in jobs:
        r = client.post(f"/internal/v1/jobs/{job}/state", headers=factory.worker,
                        json={"placement_id": pid, "state": "running"})
        assert r.status_code == 200, r.text
    return task["id"], node, pid, jobs


def test_pause_and_resume_transitions(client, factory, session) -> None:  # noqa: ANN001
    t = factory.tenant()
    # a queued task with no live attempt pauses at once; its published placement is withdrawn
    queued = factory.task(t)["id"]
    waiting = factory.placement(queued, factory.node())
    r = client.post(f"/v1/fine_tuning/jobs/{queued}/pause", headers=t.headers)
    assert r.status_code == 200 and r.json()["status"] == "paused", r.text
    session.expire_all()
    assert session.get(Placement, waiting).state == "superseded"
    r = client.post(f"/v1/tasks/{queued}/resume", headers=t.headers)
    assert r.status_code == 200 and r.json()["state"] == "queued"
    r = client.post(f"/v1/tasks/{queued}/resume", headers=t.headers)
    assert r.status_code == 409 and r.json()["error"]["code"] == "task_queued"
    assert "queued" in r.json()["error"]["message"]

    # a running attempt: pausing until its stop report; its reports still land meanwhile
    task_id, node, pid, jobs = _claimed(client, factory, t)
    r = client.post(f"/v1/tasks/{task_id}/pause", headers=t.headers)
    assert r.status_code == 200 and r.json()["state"] == "pausing", r.text
    assert client.post(f"/v1/tasks/{task_id}/pause", headers=t.headers).json()["state"] == \
        "pausing"  # again: as it is
    r = client.post(f"/v1/tasks/{task_id}/resume", headers=t.headers)
    assert r.status_code == 409 and r.json()["error"]["code"] == "task_pausing"
    hb = client.post(f"/internal/v1/nodes/{node}/heartbeat", headers=factory.worker,
                     json={"running_placement_ids": [pid]}).json()
    assert hb["pause_placement_ids"] == [pid] and hb["cancelled_placement_ids"] == []
    r = client.post(f"/internal/v1/tasks/{task_id}/metrics", headers=factory.worker, json={
        "placement_id": pid, "points": [{"job_id": jobs[0], "step": 3, "split": "train",
                                         "loss": 1.5}]})
    assert r.status_code == 200 and r.json()["stored"] == 1
    r = client.post(f"/internal/v1/tasks/{task_id}/artifacts", headers=factory.worker,
                    data={"meta": json.dumps({"kind": "checkpoint", "step": 3,
                                              "placement_id": pid})},
                    files=[("files", ("state.pt", io.BytesIO(b"S3"), "x/y"))])
    assert r.status_code == 201, r.text
    failed = {"placement_id": pid, "error": "executor stopped: SIGTERM", "retryable": True}
    r = client.post(f"/internal/v1/tasks/{task_id}/failed", headers=factory.worker, json=failed)
    assert r.status_code == 200, r.text
    assert client.post(f"/internal/v1/tasks/{task_id}/failed", headers=factory.worker,
                       json=failed).status_code == 200  # a retry of it
    session.expire_all()
    assert session.get(Task, task_id).state == "paused"
    assert session.get(Placement, pid).state == "stopped"
    assert next_attempt(session, task_id) == 1  # a pause is no failed attempt
    assert {j.state for j in session.scalars(select(Job).where(Job.task_id == task_id))} == \
        {"pending"}
    job = client.get(f"/v1/fine_tuning/jobs/{task_id}", headers=t.headers).json()
    assert job["status"] == "paused" and job["estimated_finish"] is None
    hb = client.post(f"/internal/v1/nodes/{node}/heartbeat", headers=factory.worker,
                     json={"running_placement_ids": [pid]}).json()
    assert hb["pause_placement_ids"] == []
    # resume: queued again, and the next attempt resumes from the pause's checkpoint
    r = client.post(f"/v1/fine_tuning/jobs/{task_id}/resume", headers=t.headers)
    assert r.status_code == 200 and r.json()["status"] == "queued"
    new = factory.placement(task_id, node)
    spec = client.post(f"/internal/v1/placements/{new}/claim", headers=factory.worker,
                       json={"node_id": node}).json()
    assert spec["resume_checkpoint_artifact_id"] is not None and spec["attempt"] == 1
    # cancel works while pausing and paused
    r = client.post(f"/v1/tasks/{task_id}/pause", headers=t.headers)
    assert r.json()["state"] == "pausing"
    r = client.post(f"/v1/fine_tuning/jobs/{task_id}/cancel", headers=t.headers)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    r = client.post(f"/v1/fine_tuning/jobs/{task_id}/pause", headers=t.headers)
    assert r.status_code == 409 and r.json()["error"]["code"] == "task_cancelled"
    r = client.post(f"/v1/fine_tuning/jobs/{task_id}/resume", headers=t.headers)
    assert r.status_code == 409 and "cancelled" in r.json()["error"]["message"]
    paused = factory.task(t)["id"]
    client.post(f"/v1/tasks/{paused}/pause", headers=t.headers)
    assert client.post(f"/v1/tasks/{paused}/cancel", headers=t.headers).json()["state"] == \
        "cancelled"
    listed = client.get("/v1/tasks", headers=t.headers, params={"state": "paused"}).json()
    assert listed["data"] == []


def test_requeue_pause_is_a_preemption(client, factory, session) -> None:  # noqa: ANN001
    from service.tasks import get_task, request_pause

    t = factory.tenant()
    task_id, node, pid, _ = _claimed(client, factory, t)
    tenant = session.get(Task, task_id)
    task = get_task(session, type("T", (), {"id": tenant.tenant_id})(), task_id, lock=True)
    request_pause(session, task, requeue=True, reason="preempted by a higher priority")
    session.commit()
    assert task.state == "running"
    r = client.post(f"/internal/v1/tasks/{task_id}/failed", headers=factory.worker, json={
        "placement_id": pid, "error": "executor stopped: SIGTERM", "retryable": True})
    assert r.status_code == 200, r.text
    session.expire_all()
    assert session.get(Task, task_id).state == "queued"
    assert session.get(Placement, pid).state == "stopped" and next_attempt(session, task_id) == 1


def test_events_checkpoints_and_models_of_a_finished_job(client, factory, session) -> None:  # noqa: ANN001
    t = factory.tenant()
    task_id, _, pid, jobs = _claimed(client, factory, t)
    w = factory.worker
    points = [{"job_id": j, "step": s, "split": split, "loss": 2.0 - s / 10 - k / 100}
              for k, j in enumerate(jobs) for s in (1, 2) for split in ("train", "val")]
    for p in points:  # the trainer's SFT validation token accuracy (one point reported without)
        if p["split"] == "val" and (p["job_id"], p["step"]) != (jobs[0], 1):
            p["data"] = {"token_accuracy": 0.5 + p["step"] / 10 + jobs.index(p["job_id"]) / 100}
    assert client.post(f"/internal/v1/tasks/{task_id}/metrics", headers=w, json={
        "placement_id": pid, "points": points}).status_code == 200
    # the native curves: token accuracy beside each validation loss that has one
    curves = {c["job_id"]: c for c in client.get(f"/v1/tasks/{task_id}/metrics",
                                                 headers=t.headers).json()["jobs"]}
    assert curves[jobs[0]]["val"] == [{"step": 1, "loss": 1.9},
                                      {"step": 2, "loss": 1.8, "token_accuracy": 0.7}]
    assert curves[jobs[1]]["val"] == [{"step": 1, "loss": 1.89, "token_accuracy": 0.61},
                                      {"step": 2, "loss": 1.79, "token_accuracy": 0.71}]
    assert curves[jobs[1]]["train"] == [{"step": 1, "loss": 1.89}, {"step": 2, "loss": 1.79}]
    cut = client.get(f"/v1/tasks/{task_id}/metrics", headers=t.headers,
                     params={"max_points": 4, "after_step": 1, "job_id": jobs[1]}).json()
    assert cut["jobs"][0]["val"] == [{"step": 2, "loss": 1.79, "token_accuracy": 0.71}]
    adapter = [("files", ("adapter_config.json", io.BytesIO(b'{"r": 4}'), "application/json")),
               ("files", ("adapter_model.safetensors", io.BytesIO(safetensors_bytes()), "x/y"))]
    for k, job in enumerate(jobs):
        r = client.post(f"/internal/v1/tasks/{task_id}/artifacts", headers=w, data={
            "meta": json.dumps({"kind": "adapter", "job_id": job, "placement_id": pid})},
            files=adapter)
        assert r.status_code == 201, r.text
        r = client.post(f"/internal/v1/jobs/{job}/state", headers=w, json={
            "placement_id": pid, "state": "completed", "best_val_loss": 1.8 - k / 100,
            "best_step": 2, "last_step": 2})
        assert r.status_code == 200, r.text
    assert client.post(f"/internal/v1/tasks/{task_id}/finished", headers=w,
                       json={"placement_id": pid}).status_code == 200
    job = client.get(f"/v1/fine_tuning/jobs/{task_id}", headers=t.headers).json()
    assert job["status"] == "succeeded" and isinstance(job["finished_at"], int)
    assert job["fine_tuned_model"] == f"ft:tiny-llama::{task_id}"
    assert job["trained_tokens"] > 0 and job["best_job_id"] == jobs[1]
    assert job["hyperparameters"]["learning_rate_multiplier"] == 3  # the best job's

    events = client.get(f"/v1/fine_tuning/jobs/{task_id}/events", headers=t.headers,
                        params={"limit": 100}).json()
    assert events["object"] == "list" and events["has_more"] is False
    kinds = {e["type"] for e in events["data"]}
    assert kinds == {"message", "metrics"}
    assert all(e["object"] == "fine_tuning.job.event" and e["level"] in ("info", "warn", "error")
               for e in events["data"])
    metrics = [e for e in events["data"] if e["type"] == "metrics"]
    assert len(metrics) == 4  # per job and evaluation step
    assert {(m["data"]["job_id"], m["data"]["step"]) for m in metrics} == \
        {(j, s) for j in jobs for s in (1, 2)}
    m = next(m for m in metrics if m["data"]["job_id"] == jobs[0] and m["data"]["step"] == 2)
    assert m["data"]["train_loss"] == m["data"]["valid_loss"] == 1.8
    assert m["data"]["valid_mean_token_accuracy"] == 0.7 and "token accuracy 0.7000" in m["message"]
    m = next(m for m in metrics if m["data"]["job_id"] == jobs[0] and m["data"]["step"] == 1)
    assert "valid_mean_token_accuracy" not in m["data"]  # reported without one
    stamps = [e["created_at"] for e in events["data"]]
    assert stamps == sorted(stamps, reverse=True)  # newest first
    first = client.get(f"/v1/fine_tuning/jobs/{task_id}/events", headers=t.headers,
                       params={"limit": 3}).json()
    nxt = client.get(f"/v1/fine_tuning/jobs/{task_id}/events", headers=t.headers,
                     params={"limit": 3, "after": first["data"][-1]["id"]}).json()
    assert first["has_more"] and [e["id"] for e in first["data"] + nxt["data"]] == \
        [e["id"] for e in events["data"][:6]]

    cps = client.get(f"/v1/fine_tuning/jobs/{task_id}/checkpoints", headers=t.headers).json()
    assert len(cps["data"]) == 2
    assert {c["job_id"] for c in cps["data"]} == set(jobs)
    best = [c for c in cps["data"] if c["best"]]
    assert [c["job_id"] for c in best] == [jobs[1]]
    c = best[0]
    assert c["object"] == "fine_tuning.job.checkpoint" and c["fine_tuning_job_id"] == task_id
    assert c["step_number"] == 2 and c["metrics"]["valid_loss"] == 1.79
    assert c["metrics"]["train_loss"] == 1.79 and c["metrics"]["step"] == 2
    assert c["metrics"]["valid_mean_token_accuracy"] == 0.71
    assert c["fine_tuned_model_checkpoint"].startswith(job["fine_tuned_model"])

    model = client.get(f"/v1/models/{job['fine_tuned_model']}", headers=t.headers)
    assert model.status_code == 200 and model.json()["owned_by"] == t.id, model.text
    assert client.get(f"/v1/models/{job['fine_tuned_model']}",
                      headers=factory.tenant().headers).status_code == 404
    base = client.get("/v1/models/tiny-llama", headers=t.headers).json()
    assert base["id"] == "tiny-llama" and base["object"] == "model" and base["owned_by"]
    r = client.get("/v1/models/nope", headers=t.headers)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert session.scalar(select(func.count()).select_from(MetricPoint)) == 8


def test_a_method_openai_lacks_is_native_only(client, factory) -> None:  # noqa: ANN001
    """ORPO has no OpenAI method type (contract.methods): the fine-tuning create refuses it by
    name; a native ORPO task still reads back as a fine-tuning job, under its own name."""
    t = factory.tenant()
    prefs = factory.file(t, PREFS, "prefs.jsonl")["id"]
    r = ft(client, t, {"model": "tiny-llama", "training_file": prefs, "method": {"type": "orpo"}})
    assert r.status_code == 422 and r.json()["error"]["param"].startswith("method"), r.text
    task = factory.task(t, prefs, method="orpo", search_space={"orpo_lambda": [0.2, 0.4]})
    job = client.get(f"/v1/fine_tuning/jobs/{task['id']}", headers=t.headers).json()
    assert job["method"] == {"type": "orpo", "orpo": {"hyperparameters": {
        **job["hyperparameters"], "orpo_lambda": [0.2, 0.4]}}}
    assert "orpo_lambda" not in job["hyperparameters"]
