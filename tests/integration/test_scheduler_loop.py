"""Integration: service.scheduler.replan against the real Postgres (and Redis) of the API tests:
placements written and published on arrival, pinned ones untouched, limits, oversized tasks,
down nodes and bounded waiting."""

from __future__ import annotations

from datetime import timedelta

import pytest
from rq import Queue
from sqlalchemy import select

from contract.protocol import node_queue_name
from service.models import Node, Placement, Task, Tenant, utcnow
from service.queue import get_redis
from service.scheduler import current_plan, last_plan_info, replan

pytestmark = pytest.mark.with_scheduler
ADMIN = {"Authorization": "Bearer test-admin-token"}


@pytest.fixture
def settings(settings):  # noqa: ANN001, ANN201 - conftest's, in sync mode
    """These tests look at the plan right after each request: replan inside it (sync mode);
    test_scheduler_background.py covers the background replanner."""
    return settings.model_copy(update={"scheduler_replan": "sync"})


def rows(session, state: str | None = None) -> list[Placement]:  # noqa: ANN001
    session.expire_all()
    q = select(Placement).order_by(Placement.created_at)
    if state:
        q = q.where(Placement.state == state)
    return list(session.scalars(q))


def test_arrivals_fill_free_gpus_then_plan_the_rest(client, factory, session, settings):  # noqa: ANN001
    node = factory.node("n0", gpus=2)
    t = factory.tenant()
    tasks = [factory.task(t)["id"] for _ in range(3)]
    published = rows(session, "published")
    planned = rows(session, "planned")
    assert len(published) == 2 and len(planned) == 1
    assert sorted(g for p in published for g in p.gpu_indices) == [0, 1]
    assert {p.task_id for p in published + planned} == set(tasks)
    assert planned[0].planned_start >= max(p.planned_end for p in published) - timedelta(seconds=1)
    queued = Queue(node_queue_name(node), connection=get_redis(settings)).get_job_ids()
    assert sorted(queued) == sorted(f"placement-{p.id}" for p in published)
    plan = client.get("/v1/cluster", headers=ADMIN).json()["plan"]
    assert sorted(p["id"] for p in plan) == sorted(p.id for p in published + planned)
    assert [p.id for p in current_plan(session)] == [p["id"] for p in plan]


def test_claimed_placement_stays_put_and_stable_plan_is_kept(client, factory, session):  # noqa: ANN001
    node = factory.node("n0", gpus=1)
    t = factory.tenant()
    first = factory.task(t)["id"]
    second = factory.task(t)["id"]
    [pub] = rows(session, "published")
    assert pub.task_id == first
    r = client.post(f"/internal/v1/placements/{pub.id}/claim", headers=factory.worker,
                    json={"node_id": node})
    assert r.status_code == 200, r.text
    [planned] = rows(session, "planned")
    assert planned.task_id == second
    factory.task(t)  # another arrival: replan
    session.expire_all()
    claimed = session.get(Placement, pub.id)
    assert claimed.state == "claimed" and claimed.gpu_indices == [0] and claimed.node_id == node
    still = session.get(Placement, planned.id)
    assert still.state == "planned", "an unchanged plan keeps its row"
    assert len(rows(session, "published")) == 0  # the only GPU is busy


def test_tenant_gpu_limit_and_oversized_task(factory, session, settings):  # noqa: ANN001
    factory.node("n0", gpus=2)
    t = factory.tenant()
    tenant = session.get(Tenant, t.id)
    tenant.max_gpus = 1
    session.commit()
    a, b = factory.task(t)["id"], factory.task(t)["id"]
    big = factory.task(factory.tenant(), base_model="big-model")["id"]  # needs 4 GPUs
    published = rows(session, "published")
    assert [p.task_id for p in published] == [a], "limit of 1 GPU at once"
    [planned] = rows(session, "planned")
    assert planned.task_id == b
    assert planned.planned_start >= published[0].planned_end - timedelta(seconds=1)
    assert big in last_plan_info().unschedulable
    assert "4 GPUs" in last_plan_info().unschedulable[big]
    assert session.get(Task, big).state == "queued"


def test_down_node_holds_nothing(factory, session, settings):  # noqa: ANN001
    n0 = factory.node("n0", gpus=1)
    n1 = factory.node("n1", gpus=1)
    t = factory.tenant()
    ids = [factory.task(t)["id"] for _ in range(3)]
    assert len(rows(session, "published")) == 2
    node = session.get(Node, n1)
    node.state = "down"
    session.commit()
    replan(session, settings)
    session.commit()
    live = [p for p in rows(session) if p.state in ("planned",)]
    assert live and all(p.node_id == n0 for p in live)
    assert {p.task_id for p in live} | {p.task_id for p in rows(session, "published")} == set(ids)


def test_bounded_waiting_counts_from_arrival(factory, session, settings):  # noqa: ANN001
    node = factory.node("n0", gpus=1)
    t = factory.tenant()
    first = factory.task(t)["id"]
    waiting = factory.task(t)["id"]
    [planned] = rows(session, "planned")
    assert planned.task_id == waiting
    # Pretend the waiting task arrived nearly its bound (scheduler_max_wait_s) ago: it must start
    # within ~90 s, so a newcomer of another tenant with a higher priority cannot jump ahead.
    task = session.get(Task, waiting)
    task.created_at = utcnow() - timedelta(seconds=settings.scheduler_max_wait_s - 90)
    session.commit()
    other = factory.tenant()
    session.get(Tenant, other.id).priority = 5
    session.commit()
    urgent = factory.task(other, priority=10)["id"]
    session.expire_all()
    plan = {p.task_id: p for p in rows(session) if p.state in ("planned", "published")}
    assert plan[first].state == "published" and plan[first].node_id == node
    assert plan[waiting].planned_start < plan[urgent].planned_start
    # The bound survives superseding: it counts from the arrival, not from any planned row.
    for p in rows(session, "planned"):
        p.state = "superseded"
    session.commit()
    replan(session, settings)
    session.commit()
    order = sorted(rows(session, "planned"), key=lambda p: p.planned_start)
    assert [p.task_id for p in order] == [waiting, urgent]
    # Without the old arrival, the operator's priority puts the newcomer first.
    session.get(Task, waiting).created_at = utcnow()
    session.commit()
    replan(session, settings)
    session.commit()
    order = sorted(rows(session, "planned"), key=lambda p: p.planned_start)
    assert [p.task_id for p in order] == [urgent, waiting]
