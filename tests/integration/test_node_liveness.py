"""Integration: node liveness that an outage of the service's own database cannot fake, and
heartbeat replies / Redis cancels that name placements (attempts), never a bare task.

The outage is simulated on the ServiceHealth record (a controlled clock, recorded failures), not
by stopping PostgreSQL: tests/e2e/test_chaos_outage.py stops a real one."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
import redis
from sqlalchemy import create_engine, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from contract.protocol import cancel_key
from service.cluster import (
    ServiceHealth,
    mark_stale_nodes,
    placements_to_stop,
    service_health,
    watch_service_health,
)
from service.core.localstack import free_port
from service.models import Node, Placement, Task, utcnow
from service.queue import publish_cancel
from service.tasks import cancel_task


class Clock:
    """ServiceHealth's clock, set by the test (real UTC times, so they compare with the rows)."""

    def __init__(self, at: datetime) -> None:
        self.at = at

    def __call__(self) -> datetime:
        return self.at


def ago(seconds: float) -> datetime:
    return utcnow() - timedelta(seconds=seconds)


def healthy_for_an_hour() -> ServiceHealth:
    """A record of a service that reached its database without a break for the last hour."""
    clock = Clock(ago(3600))
    health = ServiceHealth(max_gap_s=10, clock=clock)
    for back in range(3590, -1, -5):  # a pass every 5 s
        clock.at = ago(back)
        health.ok()
    return health


def claimed(client, factory, node: str | None = None) -> tuple[str, str, str]:  # noqa: ANN001
    """(task id, node id, placement id) of a task whose placement the node claimed."""
    t = factory.tenant()
    tid = factory.task(t)["id"]
    node = node or factory.node()
    pid = factory.placement(tid, node)
    r = client.post(f"/internal/v1/placements/{pid}/claim", headers=factory.worker,
                    json={"node_id": node})
    assert r.status_code == 200, r.text
    return tid, node, pid


def silent_since(session: Session, node: str, seconds: float) -> None:
    session.get(Node, node).last_heartbeat_at = ago(seconds)
    session.commit()


def beat(client, factory, node: str, *pids: str) -> dict:  # noqa: ANN001
    r = client.post(f"/internal/v1/nodes/{node}/heartbeat", headers=factory.worker,
                    json={"running_placement_ids": list(pids)})
    assert r.status_code == 200, r.text
    return r.json()


def state(session: Session, pid: str) -> str:
    session.expire_all()
    return session.scalar(select(Placement.state).where(Placement.id == pid))


def test_outage_longer_than_the_timeout_keeps_healthy_nodes(client, factory, session,  # noqa: ANN001
                                                            settings) -> None:
    tid, node, pid = claimed(client, factory)
    timeout = settings.node_timeout_s
    clock = Clock(ago(3600))
    health = ServiceHealth(max_gap_s=10, clock=clock)
    clock.at = ago(2 * timeout + 5)
    health.ok()  # the last good pass before the outage
    silent_since(session, node, 2 * timeout + 4)  # its last heartbeat before the outage
    for back in range(int(2 * timeout), 0, -5):  # the database is down: every pass fails
        clock.at = ago(back)
        health.failed(RuntimeError("connection refused"))
    clock.at = utcnow()
    assert mark_stale_nodes(session, settings, health) == []  # the first pass after recovery
    assert health.healthy_since == clock.at and session.get(Node, node).state == "up"
    assert state(session, pid) == "claimed"
    # The node reappears listing its placement: still the task's current attempt, it runs on.
    assert beat(client, factory, node, pid)["cancelled_placement_ids"] == []
    assert session.get(Task, tid).state == "running"


def test_silence_counts_from_the_recovery(client, factory, session, settings) -> None:  # noqa: ANN001
    timeout = settings.node_timeout_s
    _, quiet, pid = claimed(client, factory)
    _, chatty, other = claimed(client, factory)
    clock = Clock(ago(3600))
    health = ServiceHealth(max_gap_s=10, clock=clock)
    clock.at = ago(3 * timeout)
    health.failed(RuntimeError("down"))
    clock.at = ago(timeout + 2)
    health.ok()  # recovered timeout + 2 s ago; passes since, every 1 s
    for back in range(int(timeout) + 1, -1, -1):
        clock.at = ago(back)
        health.ok()
    silent_since(session, quiet, 4 * timeout)  # silent through the outage and since
    silent_since(session, chatty, timeout / 2)  # heartbeats again since the recovery
    assert mark_stale_nodes(session, settings, health) == [quiet]
    assert state(session, pid) == "failed" and state(session, other) == "claimed"
    assert session.get(Node, chatty).state == "up"


def test_a_stopped_loop_counts_as_an_outage(client, factory, session, settings) -> None:  # noqa: ANN001
    """A deposed leader, a paused process: no pass for longer than max_gap_s, no failure seen."""
    _, node, pid = claimed(client, factory)
    health = healthy_for_an_hour()
    health._clock.at = ago(settings.node_timeout_s * 3)  # type: ignore[attr-defined]
    health.ok()  # then nothing for 3 timeouts
    silent_since(session, node, settings.node_timeout_s * 3)
    health._clock.at = utcnow()  # type: ignore[attr-defined]
    assert mark_stale_nodes(session, settings, health) == []
    assert state(session, pid) == "claimed"


def test_a_node_silent_while_the_service_was_healthy_goes_down(client, factory, session,  # noqa: ANN001
                                                               settings) -> None:
    tid, node, pid = claimed(client, factory)
    silent_since(session, node, settings.node_timeout_s + 5)
    health = healthy_for_an_hour()
    health._clock.at = utcnow()  # type: ignore[attr-defined]
    assert mark_stale_nodes(session, settings, health) == [node]
    assert state(session, pid) == "failed" and session.get(Node, node).state == "down"
    # It comes back: up again, and told to stop the attempt the service failed over.
    reply = beat(client, factory, node, pid)
    assert reply["state"] == "up" and reply["cancelled_placement_ids"] == [pid]
    assert session.get(Node, node).state == "up"


def test_a_fresh_process_gives_every_node_a_full_timeout(client, factory, session,  # noqa: ANN001
                                                         settings) -> None:
    """An API process that was down (or a leader elected later) cannot know how long nodes were
    silent while the service was healthy: its record starts when it starts (create_app's
    lifespan does this with the maintenance loop on), and mark_stale_nodes uses it."""
    _, node, pid = claimed(client, factory)
    silent_since(session, node, settings.node_timeout_s * 5)
    assert service_health(settings) is None  # maintenance off here: no record, no guard
    health = watch_service_health(settings)
    assert service_health(settings) is health
    assert mark_stale_nodes(session, settings) == []
    assert state(session, pid) == "claimed"


def test_the_app_keeps_a_record_when_it_runs_the_maintenance_loop(settings) -> None:  # noqa: ANN001
    from fastapi.testclient import TestClient

    from service.api.app import create_app

    on = settings.model_copy(update={"maintenance_interval_s": 60.0})
    with TestClient(create_app(on)):
        health = service_health(on)
        assert health is not None and utcnow() - health.healthy_since < timedelta(seconds=60)


def test_an_unreachable_database_is_recorded_and_raised(settings) -> None:  # noqa: ANN001
    health = healthy_for_an_hour()
    engine = create_engine(f"postgresql+psycopg://loraplex@127.0.0.1:{free_port()}/none",
                           connect_args={"connect_timeout": 2})
    try:
        with Session(engine) as broken, pytest.raises(DBAPIError):
            mark_stale_nodes(broken, settings, health)
    finally:
        engine.dispose()
    assert health.down_since is not None


def test_heartbeat_names_attempts_never_the_task(client, factory, session, settings) -> None:  # noqa: ANN001
    tid, node, first = claimed(client, factory)
    silent_since(session, node, settings.node_timeout_s + 5)
    health = healthy_for_an_hour()
    health._clock.at = utcnow()  # type: ignore[attr-defined]
    assert mark_stale_nodes(session, settings, health) == [node]  # attempt 1 failed over
    # Attempt 2 lands on the same node while attempt 1's backlog is still being forwarded.
    second = factory.placement(tid, node, attempt=2)
    r = client.post(f"/internal/v1/placements/{second}/claim", headers=factory.worker,
                    json={"node_id": node})
    assert r.status_code == 200, r.text
    reply = beat(client, factory, node, first, second, "pl_unknown")
    assert reply["cancelled_placement_ids"] == sorted([first, "pl_unknown"])
    # Another node reporting this placement: not its own, so it stops it.
    _, elsewhere, _ = claimed(client, factory)
    assert beat(client, factory, elsewhere, second)["cancelled_placement_ids"] == [second]
    assert placements_to_stop(session, node, []) == []
    # Cancelled: now the current attempt stops too.
    cancel_task(session, session.get(Task, tid), settings)
    assert beat(client, factory, node, second)["cancelled_placement_ids"] == [second]


def test_redis_cancels_name_placements(settings) -> None:  # noqa: ANN001
    conn = redis.Redis.from_url(settings.redis_url)
    publish_cancel(["pl_a", "pl_b"], settings)
    publish_cancel("pl_c", settings)
    publish_cancel([], settings)
    assert all(conn.get(cancel_key(p)) == b"1" for p in ("pl_a", "pl_b", "pl_c"))
    assert 0 < conn.ttl(cancel_key("pl_a")) <= 7 * 24 * 3600
