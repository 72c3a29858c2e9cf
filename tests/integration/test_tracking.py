"""Integration: tracking integrations. A task's `integrations` (W&B, MLflow) through the native
create and the OpenAI-compatible one (bad input: a 422 naming the field, nothing stored), shown
with their sync status; after the task ended the service writes every job as a run, from the
metrics in PostgreSQL: to a real MLflow tracking server the test starts (read back through its
REST API), and to W&B offline run files (read back record by record)."""

from __future__ import annotations

import importlib.util
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select, update

from service.core.config import Settings
from service.core.localstack import free_port
from service.models import Event, IdempotencyKey, Job, Task, TaskIntegration, utcnow
from service.tracking import wandb_writer
from service.tracking.sync import sync_due
from tests.helpers.tracking import Mlflow, params, read_run, tags
from tests.helpers.tracking import mlflow_server as start_mlflow
from tests.integration.factories import safetensors_bytes

LOOP_TESTS = ("test_the_leaders_syncer_retries_a_failing_server_and_never_touches_the_task",)


@pytest.fixture
def settings(settings, tmp_path, request):  # noqa: ANN001, ANN201 - the conftest's, plus:
    # W&B runs under the test's folder; the leader's syncer off unless the test is about it
    # (the others run a pass themselves); quick retries.
    return settings.model_copy(update={
        "wandb_dir": tmp_path / "wandb",
        "tracking_poll_s": 0.2 if request.node.name in LOOP_TESTS else 0.0,
        "tracking_backoff_s": [0.5], "tracking_timeout_s": 5.0})


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[str]:  # noqa: ANN001
    """A real MLflow tracking server (SQLite store), its URL."""
    with start_mlflow(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


def counts(session) -> dict:  # noqa: ANN001
    session.expire_all()
    return {m.__name__: session.scalar(select(func.count()).select_from(m))
            for m in (Task, Job, Event, IdempotencyKey, TaskIntegration)}


WANDB = {"type": "wandb", "wandb": {"project": "lora-search", "name": "bot", "entity": "team",
                                    "tags": ["nightly"]}}


def test_bad_integrations_are_422_naming_the_field_and_store_nothing(client, factory, session
                                                                     ) -> None:  # noqa: ANN001
    t = factory.tenant()
    train = factory.file(t)["id"]
    native = {"base_model": "tiny-llama", "training_file": train, "max_seq_len": 128,
              "search_space": {"learning_rate": [1e-4], "lora_rank": [4]}}
    openai = {"model": "tiny-llama", "training_file": train}
    cases = [
        ([{"type": "neptune", "neptune": {}}], "integrations.type", "integrations[0].type"),
        ([WANDB, {"type": "comet"}], "integrations.type", "integrations[1].type"),
        ([{"type": "wandb"}], "integrations.wandb", "integrations[0].wandb"),
        ([{"type": "wandb", "wandb": {"name": "x"}}], "integrations.wandb.project",
         "integrations[0].wandb.project"),
        ([{"type": "wandb", "wandb": {"project": ""}}], "integrations.wandb.project", None),
        ([{"type": "wandb", "wandb": {"project": "p", "tags": ["x" * 65]}}],
         "integrations.wandb.tags", "integrations[0].wandb.tags[0]"),
        ([{"type": "wandb", "wandb": {"project": "p", "color": "red"}}],
         "integrations.wandb.color", None),
        ([{"type": "wandb", "wandb": {"project": "p"}, "mlflow": {"tracking_uri": "http://x"}}],
         "integrations.mlflow", "integrations[0].mlflow"),
        ([{"type": "mlflow", "mlflow": {}}], "integrations.mlflow.tracking_uri", None),
        ([{"type": "mlflow", "mlflow": {"tracking_uri": "ftp://mlflow.example.com"}}],
         "integrations.mlflow.tracking_uri", "http and https"),
        ([{"type": "mlflow", "mlflow": {"tracking_uri": "not a url"}}],
         "integrations.mlflow.tracking_uri", None),
        ([{"type": "mlflow", "mlflow": {"tracking_uri": "http://u:p@mlflow.example.com"}}],
         "integrations.mlflow.tracking_uri", "credentials"),
        ([{"type": "mlflow", "mlflow": {"tracking_uri": "http://mlflow.example.com/?a=1"}}],
         "integrations.mlflow.tracking_uri", "query"),
        # the webhooks' SSRF rule: loopback and private addresses only if the operator allows
        ([WANDB, {"type": "mlflow", "mlflow": {"tracking_uri": "http://127.0.0.1:5000"}}],
         "integrations.mlflow.tracking_uri", "LORAPLEX_TRACKING_ALLOW_PRIVATE"),
        ([{"type": "mlflow", "mlflow": {"tracking_uri": "http://10.1.2.3"}}],
         "integrations.mlflow.tracking_uri", "integrations[0].mlflow.tracking_uri"),
        ([WANDB] * 9, "integrations", None),
        ("wandb", "integrations", None),
    ]
    before = counts(session)
    for integrations, param, says in cases:
        for path, body in (("/v1/tasks", native), ("/v1/fine_tuning/jobs", openai)):
            for query in ({}, {"dry_run": "true"}):
                r = client.post(path, headers=t.headers, params=query,
                                json=body | {"integrations": integrations})
                assert r.status_code == 422, (path, integrations, r.text)
                error = r.json()["error"]
                assert error["param"] == param, (path, integrations, error)
                assert says is None or says in error["message"], (path, error)
    assert counts(session) == before

    # null and [] are no integrations
    for value in (None, []):
        task = factory.task(t, integrations=value)
        assert task["integrations"] == []
        job = client.post("/v1/fine_tuning/jobs", headers=t.headers,
                          json=openai | {"integrations": value}).json()
        assert job["integrations"] is None
    # ... so an Idempotency-Key replays a body sent without them; with them it is another body
    key = {"Idempotency-Key": "tracking-1"}
    first = client.post("/v1/tasks", headers=t.headers | key, json=native)
    assert first.status_code == 201
    again = client.post("/v1/tasks", headers=t.headers | key, json=native | {"integrations": []})
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    r = client.post("/v1/tasks", headers=t.headers | key, json=native | {"integrations": [WANDB]})
    assert r.status_code == 409


def test_integrations_are_stored_and_shown_waiting(client, factory, session) -> None:  # noqa: ANN001
    t = factory.tenant()
    mlflow = {"type": "mlflow", "mlflow": {"tracking_uri": "https://8.8.8.8:5000/mlflow",
                                           "experiment_name": "search"}}
    task = factory.task(t, integrations=[WANDB, mlflow])
    expected = [
        {"type": "wandb", "wandb": WANDB["wandb"], "mlflow": None, "status": "waiting",
         "attempts": 0, "last_error": None, "synced_at": None},
        {"type": "mlflow", "wandb": None, "mlflow": {**mlflow["mlflow"], "run_name": None},
         "status": "waiting", "attempts": 0, "last_error": None, "synced_at": None}]
    assert task["integrations"] == expected
    assert client.get(f"/v1/tasks/{task['id']}", headers=t.headers).json()["integrations"] \
        == expected
    listed = client.get("/v1/tasks", headers=t.headers).json()["data"][0]
    assert listed["integrations"] == expected
    job = client.get(f"/v1/fine_tuning/jobs/{task['id']}", headers=t.headers).json()
    assert job["integrations"] == expected

    # the OpenAI surface takes OpenAI's shape as the SDK sends it
    train = factory.file(t)["id"]
    r = client.post("/v1/fine_tuning/jobs", headers=t.headers, json={
        "model": "tiny-llama", "training_file": train,
        "integrations": [{"type": "wandb", "wandb": {"project": "p"}}]})
    assert r.status_code == 200, r.text
    assert r.json()["integrations"] == [
        {"type": "wandb", "wandb": {"project": "p", "name": None, "entity": None, "tags": None},
         "mlflow": None, "status": "waiting", "attempts": 0, "last_error": None,
         "synced_at": None}]
    # ... and the official SDK's create and its typed view of the job
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(api_key=t.key, base_url=f"{client.base_url}/v1", http_client=client)
    made = sdk.fine_tuning.jobs.create(
        model="tiny-llama", training_file=train,
        integrations=[{"type": "wandb", "wandb": {"project": "sdk", "tags": ["a"]}}])
    got = sdk.fine_tuning.jobs.retrieve(made.id).integrations
    assert got is not None and got[0].type == "wandb" and got[0].wandb.project == "sdk"
    assert got[0].wandb.tags == ["a"]
    rows = session.scalars(select(TaskIntegration).where(
        TaskIntegration.task_id == task["id"]).order_by(TaskIntegration.position)).all()
    assert [(r.type, r.state) for r in rows] == [("wandb", "pending"), ("mlflow", "pending")]


# ----- a finished task, and its runs -----------------------------------------------------------
STEPS = (1, 2, 3, 4, 5, 6)


def train_loss(k: int, step: int) -> float:
    return round(3.0 - 0.25 * step + 0.1 * k, 6)


def valid_loss(k: int, step: int) -> float:
    return round(3.2 - 0.2 * step + 0.15 * k, 6)


def finished_task(client, factory, tenant, integrations: list[dict]) -> tuple[str, list[str]]:  # noqa: ANN001
    """A succeeded task of three jobs trained through the worker routes: job 0 completed (the
    best: lowest validation loss), job 1 exited early (overfitting), job 2 failed; train points
    every step, validation every second. (task id, job ids by index)."""
    task = factory.task(tenant, search_space={"learning_rate": [1e-4, 3e-4, 1e-3],
                                              "lora_rank": [4]}, suffix="bot",
                        integrations=integrations)
    node = factory.node()
    pid = factory.placement(task["id"], node)
    w = factory.worker
    assert client.post(f"/internal/v1/placements/{pid}/claim", headers=w,
                       json={"node_id": node}).status_code == 200
    jobs = [j["id"] for j in client.get(f"/v1/tasks/{task['id']}/jobs",
                                        headers=tenant.headers).json()["data"]]
    for job in jobs:
        assert client.post(f"/internal/v1/jobs/{job}/state", headers=w,
                           json={"placement_id": pid, "state": "running"}).status_code == 200
    points = []
    for k, job in enumerate(jobs):
        for step in STEPS[:4] if k else STEPS:  # jobs 1 and 2 stop at step 4
            points.append({"job_id": job, "step": step, "split": "train",
                           "loss": train_loss(k, step), "tokens": 100, "gpu_seconds": 0.1})
            if step % 2 == 0:
                points.append({"job_id": job, "step": step, "split": "val",
                               "loss": valid_loss(k, step)})
    assert client.post(f"/internal/v1/tasks/{task['id']}/metrics", headers=w,
                       json={"placement_id": pid, "points": points}).status_code == 200
    adapter = [("files", ("adapter_config.json", io.BytesIO(b'{"r": 4}'), "application/json")),
               ("files", ("adapter_model.safetensors", io.BytesIO(safetensors_bytes()), "x/y"))]
    outcomes = [{"state": "completed", "last_step": 6},
                {"state": "exited", "exit_reason": "overfitting", "last_step": 4},
                {"state": "failed", "error": "CUDA error", "last_step": 4}]
    for k, (job, outcome) in enumerate(zip(jobs, outcomes, strict=True)):
        best_step = 6 if k == 0 else 4
        if outcome["state"] != "failed":
            assert client.post(f"/internal/v1/tasks/{task['id']}/artifacts", headers=w, data={
                "meta": json.dumps({"kind": "adapter", "job_id": job, "placement_id": pid})},
                files=adapter).status_code == 201
        r = client.post(f"/internal/v1/jobs/{job}/state", headers=w, json={
            "placement_id": pid, "best_val_loss": valid_loss(k, best_step),
            "best_step": best_step, **outcome})
        assert r.status_code == 200, r.text
    assert client.post(f"/internal/v1/tasks/{task['id']}/finished", headers=w,
                       json={"placement_id": pid}).status_code == 200
    view = client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()
    assert view["state"] == "succeeded" and view["best_job_id"] == jobs[0]
    return task["id"], jobs


def test_mlflow_runs_on_a_real_tracking_server(client, factory, session, settings,
                                               mlflow_server) -> None:  # noqa: ANN001
    settings.tracking_allow_private = True  # the operator allows its own network's server
    t = factory.tenant()
    integration = {"type": "mlflow", "mlflow": {"tracking_uri": mlflow_server + "/",
                                                "experiment_name": "it-search"}}
    task_id, jobs = finished_task(client, factory, t, [integration])
    assert client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()[
        "integrations"][0]["status"] == "pending"  # due: the task ended
    started = time.monotonic()
    assert sync_due(client.app.state.sessionmaker, settings) == 1
    assert time.monotonic() - started < 30
    view = client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()["integrations"][0]
    assert view["status"] == "synced", view
    assert view["attempts"] == 1 and view["last_error"] is None and view["synced_at"] > 0
    assert client.get(f"/v1/fine_tuning/jobs/{task_id}", headers=t.headers).json()[
        "integrations"][0]["status"] == "synced"
    assert sync_due(client.app.state.sessionmaker, settings) == 0  # synced once

    ml = Mlflow(mlflow_server)
    experiment = ml.get("experiments/get-by-name", experiment_name="it-search")["experiment"]
    runs = ml.runs(experiment["experiment_id"], task_id)
    by_key = {tags(r)["loraplex.key"]: r for r in runs}
    assert set(by_key) == {"task", *jobs} and len(runs) == 4  # a parent run and one per job
    parent = by_key["task"]
    assert parent["info"]["run_name"] == "bot" and parent["info"]["status"] == "FINISHED"
    assert tags(parent)["loraplex.best_job_id"] == jobs[0]
    assert tags(parent)["loraplex.best_run_id"] == by_key[jobs[0]]["info"]["run_id"]
    assert params(parent)["base_model"] == "tiny-llama"

    statuses = ["FINISHED", "FINISHED", "FAILED"]
    for k, job in enumerate(jobs):
        run = by_key[job]
        info, tag = run["info"], tags(run)
        assert info["run_name"] == f"job-{k}" and info["status"] == statuses[k]
        assert tag["mlflow.parentRunId"] == parent["info"]["run_id"]
        assert tag["loraplex.job_id"] == job and tag["loraplex.task_id"] == task_id
        assert tag["loraplex.best"] == ("true" if k == 0 else "false")
        assert tag["loraplex.state"] == ["completed", "exited", "failed"][k]
        assert tag.get("loraplex.exit_reason") == [None, "overfitting", None][k]
        p = params(run)
        assert float(p["learning_rate"]) == [1e-4, 3e-4, 1e-3][k] and p["lora_rank"] == "4"
        assert p["job_index"] == str(k) and p["method"] == "sft" and p["task_id"] == task_id
        steps = STEPS if k == 0 else STEPS[:4]
        assert ml.history(info["run_id"], "train_loss") == [(s, train_loss(k, s)) for s in steps]
        assert ml.history(info["run_id"], "valid_loss") == [
            (s, valid_loss(k, s)) for s in steps if s % 2 == 0]
        assert ml.history(info["run_id"], "best_valid_loss") == [
            (steps[-1], valid_loss(k, steps[-1]))]

    # A retry after a sync that died half-way: the half-written run (still RUNNING) is written
    # again, the finished ones and the parent are kept; one live run per job.
    half = by_key[jobs[1]]["info"]["run_id"]
    assert httpx.post(ml.api + "runs/update", json={"run_id": half, "status": "RUNNING"},
                      timeout=10).status_code == 200
    session.execute(update(TaskIntegration).where(TaskIntegration.task_id == task_id)
                    .values(state="pending", next_attempt_at=utcnow()))
    session.commit()
    assert sync_due(client.app.state.sessionmaker, settings) == 1
    again = {tags(r)["loraplex.key"]: r for r in ml.runs(experiment["experiment_id"], task_id)}
    assert len(again) == 4 and set(again) == set(by_key)
    assert again[jobs[1]]["info"]["run_id"] != half
    assert again[jobs[1]]["info"]["status"] == "FINISHED"
    assert ml.history(again[jobs[1]]["info"]["run_id"], "train_loss") == [
        (s, train_loss(1, s)) for s in STEPS[:4]]
    for key in ("task", jobs[0], jobs[2]):
        assert again[key]["info"]["run_id"] == by_key[key]["info"]["run_id"]
    row = session.scalar(select(TaskIntegration).where(TaskIntegration.task_id == task_id))
    session.refresh(row)
    assert row.state == "synced" and row.attempts == 2
    assert row.result["runs"][jobs[1]] == again[jobs[1]]["info"]["run_id"]


# ----- W&B offline: the run files, record by record (tests.helpers.tracking.read_run) ----------
def test_wandb_offline_run_files(client, factory, session, settings) -> None:  # noqa: ANN001
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed (scripts/install.sh installs it with the dev extra)")
    t = factory.tenant()
    task_id, jobs = finished_task(client, factory, t, [WANDB])
    started = time.monotonic()
    assert sync_due(client.app.state.sessionmaker, settings) == 1
    assert time.monotonic() - started < 60
    view = client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()["integrations"][0]
    assert view["status"] == "synced" and view["attempts"] == 1, view
    row = session.scalar(select(TaskIntegration).where(TaskIntegration.task_id == task_id))
    folder = settings.wandb_dir / t.id / task_id / row.id / "wandb"
    assert row.result["path"] == f"{t.id}/{task_id}/{row.id}"
    for k, job in enumerate(jobs):
        found = list(folder.glob(f"offline-run-*-{job}/run-{job}.wandb"))
        assert len(found) == 1, sorted(p.name for p in folder.iterdir())
        run = read_run(found[0])
        assert run["id"] == job and run["project"] == "lora-search" and run["entity"] == "team"
        assert run["name"] == f"bot/job-{k}" and run["group"] == task_id
        assert run["tags"] == ["nightly"]
        assert run["config"]["learning_rate"] == [1e-4, 3e-4, 1e-3][k]
        assert run["config"]["lora_rank"] == 4 and run["config"]["job_index"] == k
        assert run["config"]["base_model"] == "tiny-llama" and run["config"]["task_id"] == task_id
        steps = STEPS if k == 0 else STEPS[:4]
        assert [(h["_step"], h["train_loss"]) for h in run["history"]] == [
            (s, train_loss(k, s)) for s in steps]
        assert [(h["_step"], h["valid_loss"]) for h in run["history"] if "valid_loss" in h] == [
            (s, valid_loss(k, s)) for s in steps if s % 2 == 0]
        summary = run["summary"]
        assert summary["best"] is (k == 0)
        assert summary["exit_reason"] == [None, "overfitting", None][k]
        assert summary["state"] == ["completed", "exited", "failed"][k]
        assert summary["best_valid_loss"] == valid_loss(k, steps[-1])

    # a second sync (a retry) replaces the folder: still one run file per job
    session.execute(update(TaskIntegration).where(TaskIntegration.id == row.id)
                    .values(state="pending", next_attempt_at=utcnow()))
    session.commit()
    assert sync_due(client.app.state.sessionmaker, settings) == 1
    assert all(len(list(folder.glob(f"offline-run-*-{job}/run-{job}.wandb"))) == 1
               for job in jobs)
    assert not [p for p in folder.parent.parent.iterdir() if p.name.startswith(".")]


def test_wandb_not_installed_fails_for_good(client, factory, session, settings,
                                            monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(wandb_writer, "wandb_installed", lambda: False)
    t = factory.tenant()
    task_id, _ = finished_task(client, factory, t, [WANDB])
    assert sync_due(client.app.state.sessionmaker, settings) == 1
    task = client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()
    view = task["integrations"][0]
    assert view["status"] == "failed" and view["attempts"] == 1
    assert "wandb package is not installed" in view["last_error"]
    assert task["state"] == "succeeded"


def test_wandb_syncs_with_the_quick_starts_relative_dir(client, factory, session, settings,
                                                       tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Issue 43: the default LORAPLEX_WANDB_DIR is relative (var/wandb) and the writer runs in a
    scratch folder; the runs still land under the directory the service started in."""
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed (scripts/install.sh installs it with the dev extra)")
    monkeypatch.chdir(tmp_path)
    loaded = Settings(**{**settings.model_dump(), "wandb_dir": "var/wandb"})
    assert loaded.wandb_dir == tmp_path / "var" / "wandb"
    t = factory.tenant()
    task_id, jobs = finished_task(client, factory, t, [WANDB])
    assert sync_due(client.app.state.sessionmaker, loaded) == 1
    view = client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()["integrations"][0]
    assert (view["status"], view["attempts"], view["last_error"]) == ("synced", 1, None), view
    found = list((tmp_path / "var" / "wandb").glob(f"*/{task_id}/*/wandb/offline-run-*"))
    assert len(found) == len(jobs)
    # a copy of the settings that skipped validation (model_copy) is resolved by the writer too
    session.execute(update(TaskIntegration).where(TaskIntegration.task_id == task_id)
                    .values(state="pending", next_attempt_at=utcnow()))
    session.commit()
    copied = settings.model_copy(update={"wandb_dir": Path("var/wandb")})
    assert sync_due(client.app.state.sessionmaker, copied) == 1
    view = client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()["integrations"][0]
    assert view["status"] == "synced" and view["last_error"] is None, view


def test_a_wandb_folder_failure_says_what_to_do_and_names_no_path(
        client, factory, session, settings, tmp_path) -> None:  # noqa: ANN001
    """A W&B folder the API cannot write leaves the integration pending with a last_error that
    tells the user whom to ask about what, without the server's paths."""
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed (scripts/install.sh installs it with the dev extra)")
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the W&B folder should be")
    t = factory.tenant()
    task_id, _ = finished_task(client, factory, t, [WANDB])
    assert sync_due(client.app.state.sessionmaker,
                    settings.model_copy(update={"wandb_dir": blocked})) == 1
    view = client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()["integrations"][0]
    assert view["status"] == "pending" and view["attempts"] == 1, view
    error = view["last_error"]
    assert "LORAPLEX_WANDB_DIR" in error and "operator" in error, error
    assert "<path>" not in error and str(tmp_path) not in error and "not-a-folder" not in error
    assert "Not a directory" in error or "File exists" in error, error


def test_the_leaders_syncer_retries_a_failing_server_and_never_touches_the_task(
        client, factory, session, settings) -> None:  # noqa: ANN001
    """The leader's syncer (tracking_poll_s > 0) finds an ended task's integration by itself;
    a server that is down is retried with backoff and given up after tracking_give_up_s."""
    settings.tracking_allow_private = True
    closed = f"http://127.0.0.1:{free_port()}"
    t = factory.tenant()
    task_id, _ = finished_task(client, factory, t, [
        {"type": "mlflow", "mlflow": {"tracking_uri": closed}}])
    deadline = time.monotonic() + 20
    while True:
        view = client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()
        if view["integrations"][0]["attempts"] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    integration = view["integrations"][0]
    assert integration["status"] == "pending" and integration["attempts"] >= 2, integration
    assert "ConnectError" in integration["last_error"]
    assert view["state"] == "succeeded" and view["error"] is None
    # past the give-up time: failed, for good
    settings.tracking_give_up_s = 0
    deadline = time.monotonic() + 20
    while integration["status"] != "failed" and time.monotonic() < deadline:
        time.sleep(0.2)
        integration = client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()[
            "integrations"][0]
    assert integration["status"] == "failed"
    assert client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()["state"] == "succeeded"
