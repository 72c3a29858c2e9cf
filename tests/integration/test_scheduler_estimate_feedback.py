"""Integration: the estimate error fed back. The scheduler records its raw duration estimate on
the placement it publishes, the worker's finish report records the measured run, and the next
estimate of the same model is corrected by the measured ratio (bounded; other models untouched)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from service.models import Placement, Task, utcnow
from service.scheduler.estimator import correction_factor
from service.scheduler.loop import build_instance

pytestmark = pytest.mark.with_scheduler
GPU_TYPE = "H100-80GB"  # what factory.node registers


@pytest.fixture
def settings(settings):  # noqa: ANN001, ANN201 - conftest's, in sync mode
    return settings.model_copy(update={"scheduler_replan": "sync"})


def estimate(session, settings, task_id: str) -> tuple[int, int]:  # noqa: ANN001
    """(corrected estimate the planner gets, raw estimate) of a queued task, seconds."""
    session.expire_all()
    inst, _, raw = build_instance(session, settings, utcnow())
    [spec] = [s for s in inst.tasks if s.id == task_id]
    return spec.by_gpu_type[GPU_TYPE][1], raw[task_id, GPU_TYPE]


def big(session, *task_ids: str) -> None:  # noqa: ANN001
    """Give queued tasks many samples: estimates of many seconds, so rounding is negligible."""
    for tid in task_ids:
        session.get(Task, tid).num_train_samples = 10**9
    session.commit()


def test_published_estimate_and_measured_run_correct_the_next_estimate(  # noqa: ANN001
        client, factory, session, settings) -> None:
    node = factory.node("n0", gpus=1)
    t = factory.tenant()
    first = factory.task(t)["id"]
    second = factory.task(t)["id"]  # waits: the only GPU is taken
    third = factory.task(t)["id"]  # waits behind both
    big(session, second, third)
    session.expire_all()
    [pub] = session.scalars(select(Placement).where(Placement.state == "published")).all()
    assert pub.task_id == first
    corrected, raw = estimate(session, settings, second)
    assert corrected == raw > 100  # nothing measured yet: no correction
    _, raw3 = estimate(session, settings, third)
    assert pub.estimated_s is not None and pub.estimated_s > 0  # recorded at publish
    assert client.post(f"/internal/v1/placements/{pub.id}/claim", headers=factory.worker,
                       json={"node_id": node}).status_code == 200
    # The run took three times the estimate (claimed that long ago).
    session.expire_all()
    pub = session.get(Placement, pub.id)
    pub.claimed_at = utcnow() - timedelta(seconds=3 * pub.estimated_s)
    session.get(Task, first).state = "running"
    session.commit()
    r = client.post(f"/internal/v1/tasks/{first}/finished", headers=factory.worker,
                    json={"placement_id": pub.id})
    assert r.status_code == 200, r.text
    session.expire_all()
    pub = session.get(Placement, pub.id)
    assert pub.state == "finished" and 3 * pub.estimated_s <= pub.run_s < 3 * pub.estimated_s + 30
    factor = correction_factor([(pub.estimated_s, pub.run_s)])
    assert 1.2 < factor < 3  # one run moves it part of the way (shrunk toward 1)
    corrected, raw_after = estimate(session, settings, third)
    assert raw_after == raw3 and corrected == pytest.approx(raw3 * factor, abs=2)
    assert corrected > raw3 + 10
    # The second task, published once the GPU is free, records its raw estimate, not the
    # corrected one: the error is always measured against the estimator's own number.
    session.expire_all()
    [nxt] = session.scalars(select(Placement).where(Placement.task_id == second,
                                                    Placement.state == "published")).all()
    assert nxt.estimated_s == raw


def test_correction_is_per_model_and_bounded(factory, session, settings) -> None:  # noqa: ANN001
    node = factory.node("n0", gpus=1)
    t = factory.tenant()
    factory.task(t)  # holds the only GPU: the tasks below stay queued
    done = factory.task(t)["id"]
    session.expire_all()
    [pub] = session.scalars(select(Placement).where(Placement.task_id == done)).all()
    assert pub.state == "planned"
    session.get(Task, done).state = "succeeded"
    pub.state, pub.finished_at = "finished", utcnow()
    pub.estimated_s, pub.run_s = 100, 100_000.0  # 1000x: far outside the bounds
    # 20 more finished runs of the same model, all 1000x: the factor stays at its bound.
    for _ in range(20):
        session.add(Placement(task_id=done, node_id=node, gpu_indices=[0], planned_start=utcnow(),
                              planned_end=utcnow(), state="finished", finished_at=utcnow(),
                              estimated_s=100, run_s=100_000.0))
    session.commit()
    waiting = factory.task(t)["id"]
    other = factory.task(t, base_model="big-model")["id"]
    big(session, waiting, other)
    corrected, raw = estimate(session, settings, waiting)
    assert raw > 100 and corrected == pytest.approx(4 * raw, abs=4)  # CORRECTION_BOUNDS[1]
    corrected, raw = estimate(session, settings, other)
    assert corrected == raw > 100  # no finished run of that model
