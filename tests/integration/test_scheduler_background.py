"""Integration: replanning off the request path. POST /v1/tasks answers before the solver runs and
the app's replanner thread then places the task; a burst of arrivals is coalesced; the periodic
pass publishes a placement whose start arrived with no new event; GET /v1/cluster shows it all."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from rq import Queue
from sqlalchemy import select

from contract.protocol import node_queue_name
from service.models import Placement, Task, Tenant, utcnow
from service.queue import get_redis
from service.scheduler import loop

pytestmark = pytest.mark.with_scheduler
ADMIN = {"Authorization": "Bearer test-admin-token"}


@pytest.fixture
def settings(settings):  # noqa: ANN001, ANN201 - conftest's, in background mode
    return settings.model_copy(update={"scheduler_replan": "background",
                                       "scheduler_interval_s": 0, "scheduler_debounce_s": 0.05})


def placements(session, state: str) -> list[Placement]:  # noqa: ANN001
    session.expire_all()
    return list(session.scalars(select(Placement).where(Placement.state == state)
                                .order_by(Placement.planned_start)))


class GatedSolve:
    """loop.solve that records its thread and waits for ``release`` on its first call."""

    def __init__(self) -> None:
        self.real = loop.solve
        self.threads: list[str] = []
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        if len(self.threads) == 1:
            self.release.wait(30)
        return self.real(*args, **kwargs)


def test_post_returns_before_the_solver_then_the_replanner_places_it(app, client, factory,
                                                                     session, settings,
                                                                     monkeypatch):  # noqa: ANN001
    replanner = app.state.replanner
    node = factory.node("n0", gpus=1)
    assert replanner.wait_idle(30)  # the startup and node-registration replans
    gate = GatedSolve()
    monkeypatch.setattr(loop, "solve", gate)
    t = factory.tenant()
    t0 = time.perf_counter()
    task = factory.task(t)["id"]
    answered = time.perf_counter() - t0
    # Had the request run the solver, it would have waited 30 s on the gate.
    assert answered < 10 and not gate.release.is_set()
    assert gate.entered.wait(10), "the replanner picks the arrival up"
    assert placements(session, "published") == [], "nothing placed while the solver runs"
    gate.release.set()
    assert replanner.wait_idle(30)
    assert gate.threads == ["loraplex-replanner"]
    [pub] = placements(session, "published")
    assert pub.task_id == task and pub.node_id == node and pub.gpu_indices == [0]
    queued = Queue(node_queue_name(node), connection=get_redis(settings)).get_job_ids()
    assert queued == [f"placement-{pub.id}"]
    assert loop.last_plan_info().reasons == ["task_created"]


def test_a_burst_of_arrivals_is_one_or_two_replans(app, client, factory, session,
                                                   monkeypatch):  # noqa: ANN001
    replanner = app.state.replanner
    factory.node("n0", gpus=4)
    t = factory.tenant()
    f = factory.file(t)["id"]
    assert replanner.wait_idle(30)
    gate = GatedSolve()
    monkeypatch.setattr(loop, "solve", gate)
    ids = [factory.task(t, file_id=f)["id"] for _ in range(8)]
    gate.release.set()
    assert replanner.wait_idle(30)
    assert 1 <= len(gate.threads) <= 2, f"8 arrivals took {len(gate.threads)} replans"
    published, planned = placements(session, "published"), placements(session, "planned")
    assert len(published) == 4 and len(planned) == 4
    assert {p.task_id for p in published + planned} == set(ids)


def test_periodic_pass_publishes_a_start_that_arrived(settings, session):  # noqa: ANN001
    from service.api.app import create_app
    from tests.integration.factories import Factory

    fast = settings.model_copy(update={"scheduler_interval_s": 0.2})
    with TestClient(create_app(fast)) as c:
        replanner = c.app.state.replanner
        factory = Factory(session=session, client=c, settings=fast)
        factory.node("n0", gpus=1)
        t = factory.tenant()
        first, second = factory.task(t)["id"], factory.task(t)["id"]
        assert replanner.wait_idle(30)
        [pub] = placements(session, "published")
        [planned] = placements(session, "planned")
        assert (pub.task_id, planned.task_id) == (first, second)
        before = replanner.replans
        time.sleep(1.0)
        assert replanner.replans == before, "nothing due: the periodic pass does not replan"
        # The first task ends and its report's replan is lost (say, its replica died), and the
        # second one's planned start arrives: no event, only the periodic pass can publish it.
        pub.state, pub.finished_at = "finished", utcnow()
        session.get(Task, first).state = "succeeded"
        planned.planned_start = utcnow() - timedelta(seconds=1)
        session.commit()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            live = placements(session, "published")
            if live:
                break
            time.sleep(0.1)
        assert [p.task_id for p in live] == [second]
        assert loop.last_plan_info().reasons == ["periodic"]


def test_cluster_view_shows_plan_usage_and_last_replan(app, client, factory, session):  # noqa: ANN001
    replanner = app.state.replanner
    node = factory.node("n0", gpus=2)
    t = factory.tenant()
    session.get(Tenant, t.id).max_gpus = 1
    session.commit()
    a = factory.task(t, priority=3)["id"]
    b = factory.task(t)["id"]
    big = factory.task(factory.tenant(), base_model="big-model")["id"]  # needs 4 GPUs
    assert replanner.wait_idle(30)
    view = client.get("/v1/cluster", headers=ADMIN).json()
    plan = {p["task_id"]: p for p in view["plan"]}
    assert plan[a]["state"] == "published" and plan[b]["state"] == "planned"
    assert (plan[a]["tenant_id"], plan[a]["priority"]) == (t.id, 3)
    assert plan[b]["planned_start"] >= plan[a]["planned_end"][:19]
    gpus = {(g["node_id"], g["index"]): g for g in view["gpus"]}
    assert set(gpus) == {(node, 0), (node, 1)}
    holder = gpus[(node, plan[a]["gpu_indices"][0])]
    assert holder["running_task_id"] == a and holder["node_name"] == "n0"
    assert [p["task_id"] for p in holder["placements"]][0] == a
    assert sum(len(g["placements"]) for g in gpus.values()) == 2
    usage = {u["tenant_id"]: u for u in view["tenants"]}
    assert usage[t.id]["gpus_in_use"] == 1 and usage[t.id]["max_gpus"] == 1
    assert usage[t.id]["queued_tasks"] == 2 and usage[t.id]["running_tasks"] == 0
    last = view["last_plan"]
    assert last["status"] in ("optimal", "feasible") and last["at"] is not None
    assert last["solve_time_s"] >= 0 and 0 <= last["gap"] <= 1 and last["makespan_s"] > 0
    assert "task_created" in last["reasons"]
    [why] = [u for u in last["unschedulable"] if u["task_id"] == big]
    assert "4 GPUs" in why["reason"]
