"""Integration: operator-set scheduling against the real Postgres and Redis: a tenant's priority
set with the admin CLI changes the start order, a task's own priority is held to its tenant's
ceiling (422, nothing created), and a guaranteed share is reclaimed by asking a borrowing task to
pause at a checkpoint and requeue."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select

from service.core.config import get_settings
from service.models import Placement, Task, Tenant, utcnow
from service.scheduler import replan

pytestmark = pytest.mark.with_scheduler


@pytest.fixture
def settings(settings):  # noqa: ANN001, ANN201 - conftest's, in sync mode
    return settings.model_copy(update={"scheduler_replan": "sync"})


@pytest.fixture
def admin(settings, monkeypatch):  # noqa: ANN001, ANN201
    from service.admin import main

    monkeypatch.setenv("LORAPLEX_DATABASE_URL", settings.database_url)
    get_settings.cache_clear()
    yield main
    get_settings.cache_clear()


def planned_order(session) -> list[str]:  # noqa: ANN001
    session.expire_all()
    rows = session.scalars(select(Placement).where(Placement.state == "planned"))
    return [p.task_id for p in sorted(rows, key=lambda p: p.planned_start)]


def tenant_name(session, tenant_id: str) -> str:  # noqa: ANN001
    return session.get(Tenant, tenant_id).name


def test_operator_priority_changes_the_start_order(factory, session, settings, admin):  # noqa: ANN001
    factory.node("n0", gpus=1)
    a, b = factory.tenant(), factory.tenant()
    factory.task(a)  # takes the GPU
    ta = factory.task(a, priority=10)["id"]  # A's own top priority
    tb = factory.task(b)["id"]

    def order() -> list[str]:
        plan = replan(session, settings)
        session.commit()
        return sorted((ta, tb), key=lambda t: plan.assignments[t].start_s)

    assert order() == [ta, tb]
    assert admin(["set-limit", tenant_name(session, b.id), "--priority", "3"]) == 0
    assert order() == [tb, ta]
    assert admin(["set-limit", tenant_name(session, b.id), "--priority", "0"]) == 0
    assert admin(["set-limit", tenant_name(session, a.id), "--priority", "3"]) == 0
    assert order() == [ta, tb]
    with pytest.raises(SystemExit):
        admin(["set-limit", tenant_name(session, a.id), "--priority", "11"])


def test_task_priority_is_held_to_the_tenants_ceiling(client, factory, session, admin):  # noqa: ANN001
    t = factory.tenant()
    assert admin(["set-limit", tenant_name(session, t.id), "--max-task-priority", "3"]) == 0
    file_id = factory.file(t)["id"]
    before = session.scalar(select(func.count()).select_from(Task))
    r = client.post("/v1/tasks", headers=t.headers, json={
        "base_model": "tiny-llama", "training_file": file_id, "priority": 4,
        "search_space": {"learning_rate": [1e-4]}, "max_seq_len": 128})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("priority", "priority_above_ceiling")
    assert "ceiling of 3" in err["message"]
    session.expire_all()
    assert session.scalar(select(func.count()).select_from(Task)) == before
    assert factory.task(t, file_id, priority=3)["priority"] == 3
    assert admin(["set-limit", tenant_name(session, t.id), "--max-task-priority", "none"]) == 0
    assert factory.task(t, file_id, priority=10)["priority"] == 10  # the default ceiling


def test_guaranteed_share_is_reclaimed_by_pausing_a_borrower(factory, session, settings, admin):  # noqa: ANN001
    node = factory.node("n0", gpus=2)
    owner, borrower = factory.tenant(), factory.tenant()
    ids = [factory.task(borrower)["id"] for _ in range(2)]  # the borrower alone: both GPUs
    session.expire_all()
    live = session.scalars(select(Placement).where(Placement.task_id.in_(ids))).all()
    assert {p.state for p in live} == {"published"} and {p.node_id for p in live} == {node}
    for i, p in enumerate(live):  # both run now, the second started later
        p.state, p.claimed_at = "running", utcnow() - timedelta(minutes=10 - i)
        session.get(Task, p.task_id).state = "running"
    session.commit()
    assert admin(["set-limit", tenant_name(session, owner.id), "--guaranteed-gpus", "1"]) == 0
    mine = factory.task(owner)["id"]
    session.expire_all()
    stopping = session.scalars(select(Placement).where(
        Placement.stop_requested.is_not(None))).all()
    assert [(p.task_id, p.stop_requested) for p in stopping] == [(live[1].task_id, "requeue")]
    plan = planned_order(session)
    assert plan[0] == mine  # next in line for the freed GPU
    # The next replan does not preempt again while the first one is stopping.
    replan(session, settings)
    session.commit()
    session.expire_all()
    assert session.scalar(select(func.count()).select_from(Placement).where(
        Placement.stop_requested.is_not(None))) == 1


def test_cluster_shows_what_operators_set_and_what_is_borrowed(client, factory, session, admin):  # noqa: ANN001
    factory.node("n0", gpus=2)
    owner, borrower = factory.tenant(), factory.tenant()
    ids = [factory.task(borrower)["id"] for _ in range(2)]  # the borrower alone: both GPUs
    assert admin(["set-limit", tenant_name(session, owner.id), "--guaranteed-gpus", "1",
                  "--priority", "4", "--max-task-priority", "2"]) == 0
    view = client.get("/v1/cluster", headers={"Authorization": "Bearer test-admin-token"}).json()
    usage = {u["tenant_id"]: u for u in view["tenants"]}
    mine = usage[owner.id]  # listed for its settings although it has no task
    assert (mine["priority"], mine["max_task_priority"], mine["guaranteed_gpus"]) == (4, 2, 1)
    assert mine["gpus_in_use"] == 0 and mine["borrowed_gpus"] == 0
    theirs = usage[borrower.id]
    assert theirs["gpus_in_use"] == len(ids) == 2 and theirs["guaranteed_gpus"] is None
    assert theirs["borrowed_gpus"] == 2  # no share of its own: all it uses is lent
    assert theirs["max_task_priority"] == get_settings().scheduler_default_task_priority_ceiling
