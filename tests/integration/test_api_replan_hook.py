"""Integration: the API calls service.scheduler.replan on task creation, cancel, completion and
node changes, commits what it writes, and survives a replan that raises."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

import service.scheduler
from service.models import Node, Placement, Task, utcnow
from service.queue import publish_placement


@pytest.fixture
def settings(settings):  # noqa: ANN001, ANN201 - conftest's, in sync mode
    """These tests look at the plan right after each request: replan inside it (sync mode);
    test_scheduler_background.py covers the background replanner."""
    return settings.model_copy(update={"scheduler_replan": "sync"})


@pytest.mark.with_scheduler
def test_replan_called_and_its_placements_published(client, factory, settings, monkeypatch):  # noqa: ANN001
    calls: list[str] = []

    def fake_replan(session, settings_) -> None:  # noqa: ANN001
        # A minimal scheduler: each queued task without an active placement goes to the first
        # up node, GPU 0, now.
        calls.append("replan")
        node = session.scalar(select(Node).where(Node.state == "up").order_by(Node.name))
        if node is None:
            return
        for task in session.scalars(select(Task).where(Task.state == "queued")):
            busy = session.scalar(select(Placement.id).where(
                Placement.task_id == task.id,
                Placement.state.in_(("published", "claimed", "running"))))
            if busy is None:
                now = utcnow()
                p = Placement(task_id=task.id, node_id=node.id, gpu_indices=[0],
                              planned_start=now, planned_end=now + timedelta(hours=1))
                session.add(p)
                session.flush()
                publish_placement(session, p, settings_)

    monkeypatch.setattr(service.scheduler, "replan", fake_replan, raising=False)
    t = factory.tenant()
    task = factory.task(t)
    assert calls == ["replan"]
    node = factory.node("n0")
    assert calls == ["replan"] * 2
    cluster = client.get("/v1/cluster", headers={"Authorization": "Bearer test-admin-token"})
    [planned] = cluster.json()["plan"]
    assert planned["task_id"] == task["id"] and planned["state"] == "published"
    r = client.post(f"/internal/v1/placements/{planned['id']}/claim", headers=factory.worker,
                    json={"node_id": node})
    assert r.status_code == 200
    client.post(f"/v1/tasks/{task['id']}/cancel", headers=t.headers)
    assert len(calls) == 3
    # Re-registering an unchanged node does not replan; a changed one does.
    factory.node("n0")
    assert len(calls) == 3
    factory.node("n0", gpus=4)
    assert len(calls) == 4


@pytest.mark.with_scheduler
def test_failing_replan_does_not_fail_the_request(client, factory, monkeypatch):  # noqa: ANN001
    def broken(session, settings_) -> None:  # noqa: ANN001
        session.add(Placement(task_id="task_missing", node_id="node_missing", gpu_indices=[0],
                              planned_start=utcnow(), planned_end=utcnow()))
        session.flush()  # a foreign-key error inside the scheduler

    monkeypatch.setattr(service.scheduler, "replan", broken, raising=False)
    t = factory.tenant()
    task = factory.task(t)
    assert client.get(f"/v1/tasks/{task['id']}", headers=t.headers).json()["state"] == "queued"


def test_replan_off_without_marker(client, factory, monkeypatch):  # noqa: ANN001
    monkeypatch.setattr(service.scheduler, "replan", lambda *a: pytest.fail("called"),
                        raising=False)
    factory.task(factory.tenant())


@pytest.mark.with_scheduler
def test_real_scheduler_places_a_new_task(client, factory, settings):  # noqa: ANN001
    """The wiring with the real CP-SAT scheduler: node + task -> a published placement that the
    node can claim (skipped while service.scheduler.loop is not there)."""
    pytest.importorskip("ortools")
    pytest.importorskip("service.scheduler.loop")
    import redis
    from rq import Queue

    from contract.protocol import node_queue_name

    node = factory.node("sched-n0", gpus=2)
    t = factory.tenant()
    task = factory.task(t)
    admin = {"Authorization": "Bearer test-admin-token"}
    plan = client.get("/v1/cluster", headers=admin).json()
    mine = [p for p in plan["plan"] if p["task_id"] == task["id"]]
    assert len(mine) == 1 and mine[0]["state"] == "published", plan
    assert mine[0]["node_id"] == node and plan["last_plan"]["status"] != "none"
    queue = Queue(node_queue_name(node), connection=redis.Redis.from_url(settings.redis_url))
    assert [j.args for j in queue.get_jobs()] == [(mine[0]["id"],)]
    r = client.post(f"/internal/v1/placements/{mine[0]['id']}/claim", headers=factory.worker,
                    json={"node_id": node})
    assert r.status_code == 200 and r.json()["task_id"] == task["id"]
    client.post(f"/v1/tasks/{task['id']}/cancel", headers=t.headers)
    assert client.get("/v1/cluster", headers=admin).json()["plan"] == []
