"""Integration: with several API processes on one database, one leader (a session-level advisory
lock on its own connection) runs the background loops. Only one of two candidates leads; when it
stops or its process dies the other takes over within the retry interval; a replan requested
through a follower process reaches the leader (NOTIFY), which places the task."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy import select

from service.core.config import Settings
from service.core.db import make_engine, make_sessionmaker
from service.core.leader import LEADER_KEY, Leadership, libpq_url
from service.core.localstack import free_port
from service.models import Placement

REPO = Path(__file__).resolve().parents[2]
ADMIN = {"Authorization": "Bearer test-admin-token"}
RETRY_S = 0.3


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def lock_holders(db_url: str) -> list[int]:
    """Backend pids holding the leader lock of this database."""
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        return [r[0] for r in conn.execute(
            "SELECT l.pid FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = 0 AND l.objid = %s "
            "AND d.datname = current_database()", (LEADER_KEY,))]


class Candidate:
    """A Leadership whose callbacks record what happened."""

    def __init__(self, db_url: str, name: str) -> None:
        self.elected, self.deposed, self.requests = threading.Event(), threading.Event(), []
        self.leadership = Leadership(db_url, self.elected.set, self.deposed.set,
                                     self.requests.append, retry_s=RETRY_S, name=name)

    def start(self) -> Candidate:
        self.leadership.start()
        return self


def test_one_leader_and_the_other_takes_over_when_it_steps_down(db_url: str) -> None:
    a = Candidate(db_url, "leader-a").start()
    b = Candidate(db_url, "leader-b").start()
    try:
        assert a.leadership.is_leader and a.elected.is_set()
        time.sleep(5 * RETRY_S)  # b keeps trying, in vain
        assert not b.leadership.is_leader and not b.elected.is_set()
        assert len(lock_holders(db_url)) == 1
        a.leadership.stop()
        assert a.deposed.is_set() and not a.leadership.is_leader
        t0 = time.monotonic()
        assert b.leadership.wait_leader(RETRY_S + 3), "b takes over"
        assert time.monotonic() - t0 < RETRY_S + 3
        assert b.elected.is_set() and len(lock_holders(db_url)) == 1
    finally:
        a.leadership.stop()
        b.leadership.stop()
    assert lock_holders(db_url) == []


def test_a_dead_leader_process_is_replaced_and_requests_reach_the_leader(db_url: str) -> None:
    # The leader is another process, killed outright: its connection drops with it, and the lock.
    leader = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from service.core.leader import Leadership
        ship = Leadership({db_url!r}, lambda: print("elected", flush=True), lambda: None,
                          lambda payload: print("replan", payload, flush=True), retry_s=0.2)
        ship.start()
        time.sleep(600)
        """)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert leader.stdout is not None and leader.stdout.readline().strip() == "elected"
        b = Candidate(db_url, "leader-b").start()
        assert not b.leadership.is_leader
        with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:  # as a follower does
            conn.execute("SELECT pg_notify('loraplex_replan', 'task_created')")
        assert leader.stdout.readline().strip() == "replan task_created"
        assert b.requests == [], "only the leader listens"
        leader.send_signal(signal.SIGKILL)
        leader.wait(10)
        t0 = time.monotonic()
        assert b.leadership.wait_leader(RETRY_S + 5), "b takes over from the dead leader"
        assert time.monotonic() - t0 < RETRY_S + 5
        with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
            conn.execute("SELECT pg_notify('loraplex_replan', 'node_registered')")
        wait_for(lambda: b.requests == ["node_registered"], 5, "the new leader hears requests")
        b.leadership.stop()
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait(10)


class Service:
    """The API as its own uvicorn process on this test's database."""

    def __init__(self, settings: Settings, root: Path, name: str) -> None:
        self.port, self.name, self.log = free_port(), name, root / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        env |= {"LORAPLEX_DATABASE_URL": settings.database_url,
                "LORAPLEX_REDIS_URL": settings.redis_url,
                "LORAPLEX_STORAGE_DIR": str(settings.storage_dir),
                "LORAPLEX_MODELS_FILE": str(settings.models_file),
                "LORAPLEX_WORKER_TOKEN": settings.worker_token,
                "LORAPLEX_ADMIN_TOKEN": "test-admin-token",
                "LORAPLEX_SCHEDULER_REPLAN": "background",
                # No periodic pass: a task is placed only if its replan request reaches a leader.
                "LORAPLEX_SCHEDULER_INTERVAL_S": "0", "LORAPLEX_MAINTENANCE_INTERVAL_S": "0",
                "LORAPLEX_LEADER_RETRY_S": str(RETRY_S)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "service.api.app:app", "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "info"],
            env=env, cwd=REPO, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        wait_for(self._healthy, 60, f"{name} to answer /healthz")
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def last_plan(self) -> dict:
        return self.http.get("/v1/cluster", headers=ADMIN).json()["last_plan"]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        self.http.close()


@pytest.fixture
def services(settings: Settings, tmp_path: Path) -> Iterator[list[Service]]:
    started: list[Service] = []
    yield started
    for service in started:
        service.stop()


@pytest.mark.with_scheduler
def test_api_processes_elect_one_leader_that_replans_for_followers(settings: Settings,
                                                                  services: list[Service],
                                                                  tmp_path: Path) -> None:
    pytest.importorskip("ortools")
    from tests.integration.factories import Factory

    session = make_sessionmaker(make_engine(settings.database_url))()
    a = Service(settings, tmp_path, "api-a")
    services.append(a)
    wait_for(lambda: len(lock_holders(settings.database_url)) == 1, 10, "a leader")
    b = Service(settings, tmp_path, "api-b")
    services.append(b)
    # Everything goes through b, the follower; only a replans.
    f = Factory(session=session, client=b.http, settings=settings)  # type: ignore[arg-type]
    node = f.node("n0", gpus=2)
    t = f.tenant()
    first = f.task(t)["id"]

    def published(task_id: str) -> Placement | None:
        session.expire_all()
        return session.scalar(select(Placement).where(Placement.task_id == task_id,
                                                      Placement.state == "published"))

    placed = wait_for(lambda: published(first), 20, "the leader to place b's task")
    assert placed.node_id == node
    wait_for(lambda: "task_created" in (a.last_plan() or {}).get("reasons", []), 10,
             "a's replan of b's request")
    assert (b.last_plan() or {}).get("status", "none") == "none", "b never replans itself"
    [held_by_a] = lock_holders(settings.database_url)
    # a dies: b takes over within the retry interval and then places tasks itself.
    a.stop(signal.SIGKILL)
    wait_for(lambda: lock_holders(settings.database_url) not in ([], [held_by_a]), RETRY_S + 10,
             "b to take the leader lock")
    second = f.task(t)["id"]
    assert wait_for(lambda: published(second), 20, "b, now leader, to place a task")
    assert b.last_plan()["status"] != "none"
    assert "leader elected" in b.log.read_text()
    session.close()
