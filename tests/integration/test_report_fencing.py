"""Integration: every worker report (events, loss points, job states, artifacts, throughput, task
finished / failed) is fenced by its placement (= attempt): after a cancel, or from an attempt
that is no longer the task's current one, it is a 409 and nothing is stored; the current attempt's
reports are stored, retries of them stay idempotent, and a report without a placement is a 422."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from service.cluster import requeue_task
from service.models import (
    Artifact,
    Event,
    Job,
    MetricPoint,
    Placement,
    Task,
    ThroughputProfile,
    utcnow,
)

SPACE = {"learning_rate": [1e-4, 3e-4], "lora_rank": [4]}


@dataclass
class Run:
    """One task with a claimed attempt, and the worker's view of it."""

    client: Any  # the app's TestClient
    worker: dict
    task_id: str
    job_ids: list[str]

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.client.post(path, headers=self.worker, **kwargs)


def _events(run: Run, pid: str) -> httpx.Response:
    return run.post(f"/internal/v1/tasks/{run.task_id}/events", json={
        "placement_id": pid, "events": [{"type": "log", "message": f"from {pid}",
                                         "job_id": run.job_ids[0], "client_key": f"{pid}:0"}]})


def _metrics(run: Run, pid: str) -> httpx.Response:
    return run.post(f"/internal/v1/tasks/{run.task_id}/metrics", json={
        "placement_id": pid,
        "points": [{"job_id": run.job_ids[0], "step": 99_999, "split": "train", "loss": 0.25}]})


def _job_state(run: Run, pid: str) -> httpx.Response:
    return run.post(f"/internal/v1/jobs/{run.job_ids[0]}/state", json={
        "placement_id": pid, "state": "completed", "best_val_loss": 1.25, "best_step": 7,
        "last_step": 7})


def _artifact(run: Run, pid: str) -> httpx.Response:
    return run.post(f"/internal/v1/tasks/{run.task_id}/artifacts",
                    data={"meta": json.dumps({"kind": "checkpoint", "step": 7,
                                              "placement_id": pid})},
                    files=[("files", ("state.pt", io.BytesIO(b"S7"), "x/y"))])


def _throughput(run: Run, pid: str) -> httpx.Response:
    return run.post(f"/internal/v1/tasks/{run.task_id}/throughput", json={
        "placement_id": pid, "gpus": 1, "seq_len": 128, "batch_sizes": [2, 2],
        "tokens_per_s": 1234.5})


def _finished(run: Run, pid: str) -> httpx.Response:
    return run.post(f"/internal/v1/tasks/{run.task_id}/finished", json={"placement_id": pid})


def _failed(run: Run, pid: str) -> httpx.Response:
    return run.post(f"/internal/v1/tasks/{run.task_id}/failed", json={
        "placement_id": pid, "error": "ValueError: bad batch", "retryable": False})


REPORTS: dict[str, Callable[[Run, str], httpx.Response]] = {
    "events": _events, "metrics": _metrics, "job_state": _job_state, "artifact": _artifact,
    "throughput": _throughput, "finished": _finished, "failed": _failed}


def stored(session, task_id: str) -> dict:  # noqa: ANN001
    """Everything a report could have written for the task, to compare before and after."""
    session.expire_all()

    def count(model: type) -> int:
        return session.scalar(select(func.count()).select_from(model).where(
            model.task_id == task_id))

    task = session.get(Task, task_id)
    return {
        "events": count(Event), "metric_points": count(MetricPoint),
        "last_event_id": session.scalar(select(func.max(Event.id)).where(
            Event.task_id == task_id)),
        "artifacts": sorted((a.key, json.dumps(a.files)) for a in session.scalars(
            select(Artifact).where(Artifact.task_id == task_id))),
        "jobs": [(j.id, j.state, j.exit_reason, j.best_val_loss, j.best_step, j.last_step,
                  j.error, j.started_at, j.finished_at) for j in session.scalars(
            select(Job).where(Job.task_id == task_id).order_by(Job.index))],
        "placements": sorted((p.id, p.state, p.error, p.finished_at) for p in session.scalars(
            select(Placement).where(Placement.task_id == task_id))),
        "task": (task.state, task.best_job_id, task.error, task.finished_at),
        "profiles": sorted((p.batch_key, p.tokens_per_s) for p in session.scalars(
            select(ThroughputProfile))),
        "profiles_touched": sorted(session.scalars(select(ThroughputProfile.updated_at))),
    }


def claim(client, factory, task_id: str, node: str, attempt: int = 1) -> str:  # noqa: ANN001
    pid = factory.placement(task_id, node, attempt=attempt)
    r = client.post(f"/internal/v1/placements/{pid}/claim", headers=factory.worker,
                    json={"node_id": node})
    assert r.status_code == 200, r.text
    return pid


def start(client, factory) -> tuple[Run, str, object]:  # noqa: ANN001
    """A task whose first attempt is claimed and runs both jobs; (run, placement, tenant)."""
    t = factory.tenant()
    task_id = factory.task(t, search_space=SPACE)["id"]
    pid = claim(client, factory, task_id, factory.node())
    jobs = [j["id"] for j in client.get(f"/v1/tasks/{task_id}/jobs",
                                        headers=t.headers).json()["data"]]
    run = Run(client, factory.worker, task_id, jobs)
    for job in jobs:
        r = run.post(f"/internal/v1/jobs/{job}/state",
                     json={"placement_id": pid, "state": "running"})
        assert r.status_code == 200, r.text
    r = run.post(f"/internal/v1/tasks/{task_id}/metrics", json={"placement_id": pid, "points": [
        {"job_id": jobs[0], "step": 1, "split": "train", "loss": 2.0}]})
    assert r.json() == {"stored": 1}
    return run, pid, t


@pytest.mark.parametrize("kind", list(REPORTS))
def test_after_cancel_nothing_is_stored(client, factory, session, kind: str) -> None:  # noqa: ANN001
    run, pid, t = start(client, factory)
    assert client.post(f"/v1/tasks/{run.task_id}/cancel", headers=t.headers).status_code == 200
    before = stored(session, run.task_id)

    r = REPORTS[kind](run, pid)
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "task_cancelled"
    assert stored(session, run.task_id) == before
    curve = client.get(f"/v1/tasks/{run.task_id}/metrics", headers=t.headers).json()
    steps = [p["step"] for c in curve["jobs"] for p in c["train"] + c["val"]]
    assert steps == [1]  # never the refused step 99999
    assert client.get(f"/v1/tasks/{run.task_id}", headers=t.headers).json()["state"] == \
        "cancelled"


def _fail_by_worker(run: Run, pid: str, factory, session) -> None:  # noqa: ANN001
    r = run.post(f"/internal/v1/tasks/{run.task_id}/failed",
                 json={"placement_id": pid, "error": "CUDA error", "retryable": True})
    assert r.status_code == 200 and r.json()["state"] == "queued"


def _node_lost(run: Run, pid: str, factory, session) -> None:  # noqa: ANN001
    """The service fails the attempt itself: its node left (as for a node that went silent)."""
    node = session.get(Placement, pid).node_id
    r = run.post(f"/internal/v1/nodes/{node}/deregister", json={"reason": "lost"})
    assert r.status_code == 200 and r.json()["requeued_task_ids"] == [run.task_id]


def _superseded(run: Run, pid: str, factory, session) -> None:  # noqa: ANN001
    """The service moved the task away from a running attempt (a preemption)."""
    task = session.scalar(select(Task).where(Task.id == run.task_id).with_for_update())
    placement = session.get(Placement, pid)
    placement.state, placement.finished_at = "superseded", utcnow()
    requeue_task(session, task, "preempted")
    session.commit()


ENDINGS = {"failed_by_worker": _fail_by_worker, "node_lost": _node_lost,
           "superseded": _superseded}


@pytest.mark.parametrize("ending", list(ENDINGS))
@pytest.mark.parametrize("kind", list(REPORTS))
def test_only_the_current_attempt_is_stored(client, factory, session, kind: str,  # noqa: ANN001
                                            ending: str) -> None:
    run, old, t = start(client, factory)
    ENDINGS[ending](run, old, factory, session)
    attempt = 1 + (ending != "superseded")  # a superseded attempt is not a failed one
    new = claim(client, factory, run.task_id, factory.node(), attempt=attempt)
    before = stored(session, run.task_id)

    r = REPORTS[kind](run, old)
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "stale_attempt"
    assert stored(session, run.task_id) == before

    r = REPORTS[kind](run, new)
    assert r.status_code in (200, 201), r.text
    after = stored(session, run.task_id)
    assert after != before
    if kind in ("events", "metrics"):
        assert r.json() == {"stored": 1}
    # ... and the old attempt still cannot add anything after the new one's reports.
    if kind not in ("finished", "failed"):
        for report in REPORTS.values():
            assert report(run, old).status_code == 409
        assert stored(session, run.task_id) == after


@pytest.mark.parametrize("kind", list(REPORTS))
def test_retries_stay_idempotent(client, factory, session, kind: str) -> None:  # noqa: ANN001
    run, pid, _ = start(client, factory)
    first = REPORTS[kind](run, pid)
    assert first.status_code in (200, 201), first.text
    before = stored(session, run.task_id)
    again = REPORTS[kind](run, pid)
    assert again.status_code == first.status_code, again.text
    after = stored(session, run.task_id)
    if kind == "throughput":  # a retry re-writes the same numbers (the latest window)
        before.pop("profiles_touched"), after.pop("profiles_touched")
    assert after == before
    if kind in ("events", "metrics"):
        assert again.json() == {"stored": 0}
    elif kind in ("finished", "failed", "job_state"):
        assert again.json() == first.json()
    elif kind == "artifact":
        assert again.json()["artifact_id"] == first.json()["artifact_id"]


def test_a_failure_the_service_recorded_first_is_stale(client, factory, session) -> None:  # noqa: ANN001
    """The node was lost and the service failed the attempt: the daemon's own TaskFailed that
    arrives later is not a retry of anything, so it is stale (and changes nothing)."""
    run, pid, _ = start(client, factory)
    _node_lost(run, pid, factory, session)
    before = stored(session, run.task_id)
    r = _failed(run, pid)
    assert r.status_code == 409 and r.json()["error"]["code"] == "stale_attempt"
    assert stored(session, run.task_id) == before


def _without_placement(kind: str, run: Run) -> httpx.Response:
    if kind == "artifact":
        return run.post(f"/internal/v1/tasks/{run.task_id}/artifacts",
                        data={"meta": json.dumps({"kind": "checkpoint", "step": 7})},
                        files=[("files", ("state.pt", io.BytesIO(b"S7"), "x/y"))])
    sent: list[tuple[str, dict]] = []

    class Capture:
        def post(self, path: str, json: dict, **_: object) -> None:
            sent.append((path, json))

    REPORTS[kind](Run(Capture(), {}, run.task_id, run.job_ids), "pl_x")
    [(path, body)] = sent
    return run.post(path, json={k: v for k, v in body.items() if k != "placement_id"})


@pytest.mark.parametrize("kind", list(REPORTS))
def test_a_report_must_name_its_placement(client, factory, session, kind: str) -> None:  # noqa: ANN001
    run, pid, _ = start(client, factory)
    before = stored(session, run.task_id)
    r = _without_placement(kind, run)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] in ("placement_id", "meta.placement_id")
    r = REPORTS[kind](run, "pl_nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "placement_id"
    # A placement of another task is not this task's attempt either.
    other, other_pid, _ = start(client, factory)
    r = REPORTS[kind](run, other_pid)
    assert r.status_code == 404, r.text
    assert stored(session, run.task_id) == before


def test_job_states_are_truthful_across_attempts(client, factory, session) -> None:  # noqa: ANN001
    run, old, t = start(client, factory)
    j0, j1 = run.job_ids
    assert run.post(f"/internal/v1/jobs/{j1}/state", json={
        "placement_id": old, "state": "exited", "exit_reason": "diverging"}).status_code == 200
    _fail_by_worker(run, old, factory, session)
    jobs = {j["id"]: j["state"] for j in client.get(f"/v1/tasks/{run.task_id}/jobs",
                                                    headers=t.headers).json()["data"]}
    assert jobs == {j0: "pending", j1: "exited"}  # what ran goes back to pending
    new = claim(client, factory, run.task_id, factory.node(), attempt=2)

    # The old attempt cannot move a job any more; the new one resumes it.
    for state in ("running", "completed", "failed"):
        r = run.post(f"/internal/v1/jobs/{j0}/state", json={"placement_id": old, "state": state})
        assert r.status_code == 409 and r.json()["error"]["code"] == "stale_attempt"
    r = run.post(f"/internal/v1/jobs/{j0}/state", json={"placement_id": new, "state": "running"})
    assert r.status_code == 200 and r.json()["state"] == "running"
    session.expire_all()
    assert session.get(Placement, new).state == "running"  # the attempt runs now
    # A job that ended in the first attempt stays ended: repeating it is a no-op, leaving it a 409.
    assert run.post(f"/internal/v1/jobs/{j1}/state", json={
        "placement_id": new, "state": "exited", "exit_reason": "diverging"}).status_code == 200
    assert run.post(f"/internal/v1/jobs/{j1}/state", json={
        "placement_id": new, "state": "running"}).status_code == 409

    events = client.get(f"/v1/tasks/{run.task_id}/events", headers=t.headers,
                        params={"limit": 100}).json()["data"]
    mine = [(e["type"], e["job_id"], (e["data"] or {}).get("attempt")) for e in events
            if e["type"] in ("job_running", "task_requeued", "task_running")]
    assert mine == [("task_running", None, 1), ("job_running", j0, 1), ("job_running", j1, 1),
                    ("task_requeued", None, None), ("task_running", None, 2),
                    ("job_running", j0, 2)]


def test_events_keep_causal_order_across_attempts(client, factory, session) -> None:  # noqa: ANN001
    run, old, t = start(client, factory)
    assert _events(run, old).json() == {"stored": 1}
    _fail_by_worker(run, old, factory, session)
    new = claim(client, factory, run.task_id, factory.node(), attempt=2)
    assert _events(run, new).json() == {"stored": 1}
    # A late report of the old attempt (its daemon was partitioned away) lands nowhere.
    late = run.post(f"/internal/v1/tasks/{run.task_id}/events", json={
        "placement_id": old, "events": [{"type": "log", "message": "late", "client_key": "z",
                                         "created_at": "2000-01-01T00:00:00Z"}]})
    assert late.status_code == 409
    events = client.get(f"/v1/tasks/{run.task_id}/events", headers=t.headers,
                        params={"limit": 100}).json()["data"]
    ids = [e["id"] for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    story = [e["message"] if e["type"] == "log" else e["type"] for e in events
             if e["type"] in ("log", "task_running", "task_requeued")]
    assert story == ["task_running", f"from {old}", "task_requeued", "task_running",
                     f"from {new}"]
    # ?after= pages in the same order
    page = client.get(f"/v1/tasks/{run.task_id}/events", headers=t.headers,
                      params={"after": ids[2], "limit": 100}).json()["data"]
    assert [e["id"] for e in page] == ids[3:]


def test_the_best_job_spans_attempts(client, factory, session) -> None:  # noqa: ANN001
    """A job that ended in attempt 1 stays a candidate: attempt 2 resumed after it and names the
    best of what it saw itself, but the task's best job is the best of every attempt's jobs."""
    from tests.integration.test_api_worker import _upload_adapter

    run, old, t = start(client, factory)
    first, second = run.job_ids
    assert _upload_adapter(client, factory, run.task_id, old, first).status_code == 201
    r = run.post(f"/internal/v1/jobs/{first}/state", json={
        "placement_id": old, "state": "completed", "best_val_loss": 0.5, "best_step": 4,
        "last_step": 4})
    assert r.status_code == 200, r.text
    _fail_by_worker(run, old, factory, session)
    new = claim(client, factory, run.task_id, factory.node(), attempt=2)
    assert _upload_adapter(client, factory, run.task_id, new, second).status_code == 201
    r = run.post(f"/internal/v1/jobs/{second}/state", json={
        "placement_id": new, "state": "completed", "best_val_loss": 0.9, "best_step": 8,
        "last_step": 8})
    assert r.status_code == 200, r.text
    r = run.post(f"/internal/v1/tasks/{run.task_id}/finished",
                 json={"placement_id": new, "best_job_id": second})
    assert r.status_code == 200, r.text
    task = client.get(f"/v1/tasks/{run.task_id}", headers=t.headers).json()
    assert (task["state"], task["best_job_id"]) == ("succeeded", first)
