"""Integration: an executor's timings report (POST /internal/v1/tasks/{id}/timings, the
contract's ExecutorTimings) becomes the attempt's `timings` event once, fenced like every
other report."""

from __future__ import annotations

from sqlalchemy import select

from service.models import Event
from tests.integration.test_throughput_profiles import claimed


def test_timings_become_one_event_of_the_live_attempt(client, factory, session) -> None:  # noqa: ANN001
    node = factory.node("gpu-a", gpus=1)
    task = factory.task(factory.tenant())["id"]
    pid = claimed(client, factory, task, node)
    url = f"/internal/v1/tasks/{task}/timings"
    body = {"placement_id": pid, "wall_s": 61.5, "first_step_s": 4.25,
            "phases": {"load": 2.0, "train": 50.0, "eval": 5.5}, "details": {"profile_reused": True}}
    r = client.post(url, headers=factory.worker, json=body)
    assert r.status_code == 200 and r.json() == {"stored": 1}, r.text
    assert client.post(url, headers=factory.worker, json=body).json() == {"stored": 0}  # a retry
    [event] = session.scalars(select(Event).where(Event.task_id == task, Event.type == "timings"))
    assert event.data == {"wall_s": 61.5, "first_step_s": 4.25, "load_s": 2.0, "train_s": 50.0,
                          "eval_s": 5.5, "profile_reused": True}
    assert "61.5 s" in event.message and "4.2 s" in event.message
    # The contract refuses a negative wall (422, naming it); another attempt is fenced (409).
    r = client.post(url, headers=factory.worker, json=body | {"wall_s": -1})
    assert r.status_code == 422 and "wall_s" in r.text
    r = client.post(url, headers=factory.worker, json=body | {"placement_id": "pl_nope"})
    assert r.status_code == 404
