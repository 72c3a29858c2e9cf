"""Integration: the fair-share memory the scheduler gives the planner. Each tenant with unfinished
tasks brings the slowdowns (submitted to finished over the measured run) of its latest finished
tasks; a tenant with nothing finished brings none."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from service.models import Placement, Task, utcnow
from service.scheduler.loop import build_instance

pytestmark = pytest.mark.with_scheduler


@pytest.fixture
def settings(settings):  # noqa: ANN001, ANN201 - conftest's, in sync mode
    return settings.model_copy(update={"scheduler_replan": "sync"})


def test_history_is_each_tenants_finished_slowdowns(factory, session, settings) -> None:  # noqa: ANN001
    factory.node("n0", gpus=1)
    a, b = factory.tenant(), factory.tenant()
    factory.task(a)  # holds the only GPU
    done = factory.task(a)["id"]
    factory.task(a)  # a still has unfinished tasks
    factory.task(b)  # b has nothing finished
    session.expire_all()
    # Its latest planned row (a replan may have superseded earlier ones) is the finished run.
    pub = session.scalars(select(Placement).where(Placement.task_id == done)
                          .order_by(Placement.created_at.desc())).first()
    task = session.get(Task, done)
    task.state, task.finished_at = "succeeded", task.created_at + timedelta(seconds=3000)
    pub.state, pub.finished_at, pub.run_s = "finished", utcnow(), 1000.0
    session.commit()
    session.expire_all()
    inst, _, _ = build_instance(session, settings, utcnow())
    assert set(inst.tenant_history) == {a.id}
    total, count = inst.tenant_history[a.id]
    assert count == 1 and total == pytest.approx(3.0, rel=1e-3)  # 3000 s from submit / 1000 s
