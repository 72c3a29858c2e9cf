"""Leader election among the API processes (uvicorn workers, replicas) on one database: the process
whose dedicated connection holds a session-level PostgreSQL advisory lock is the leader and runs
the background loops; the others retry every ``retry_s`` and one takes over when the leader's
connection drops (the process died or lost the database: Postgres releases the lock then).

The leader also LISTENs on REPLAN_CHANNEL on that connection, so a follower asks it for a replan
with ``SELECT pg_notify('loraplex_replan', reasons)`` (service.api.background does). Needs a direct
connection or a session-mode pooler: a transaction-mode pooler would not keep a session lock."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import psycopg
from sqlalchemy.engine import make_url

from contract.background import BackgroundWorker

log = logging.getLogger("loraplex.leader")

LEADER_KEY = 0x4C4F524C  # pg advisory lock key of the leader ("LORL"); replan's xact lock differs
REPLAN_CHANNEL = "loraplex_replan"


def libpq_url(database_url: str) -> str:
    """The SQLAlchemy URL (postgresql+psycopg://...) as a libpq URI for psycopg.connect."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(
        hide_password=False)


class Leadership:
    """A thread that campaigns for the leader lock and, once it holds it, calls ``on_elected()``,
    passes each replan notification's payload to ``on_replan``, and calls ``on_deposed()`` when it
    stops or its connection fails (before the lock is released, so loops never overlap)."""

    def __init__(self, database_url: str, on_elected: Callable[[], None],
                 on_deposed: Callable[[], None], on_replan: Callable[[str], None],
                 retry_s: float = 5.0, key: int = LEADER_KEY,
                 name: str = "loraplex-leader") -> None:
        self._url = libpq_url(database_url)
        self._on_elected, self._on_deposed, self._on_replan = on_elected, on_deposed, on_replan
        self.retry_s, self.key = max(0.05, retry_s), key
        self._poll_s = min(1.0, self.retry_s)  # how soon a lost connection or stop() is noticed
        self._first_try = threading.Event()
        self._leader = threading.Event()
        self.worker = BackgroundWorker(name, self._try, every_s=self.retry_s, logger=log)

    @property
    def is_leader(self) -> bool:
        return self._leader.is_set()

    def start(self, wait_s: float = 10.0) -> Leadership:
        """Start campaigning; wait (up to wait_s) for the first try, so a lone process leads
        before it serves its first request."""
        self.worker.start()
        self._first_try.wait(wait_s)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Step down (on_deposed runs) and release the lock by closing the connection."""
        self.worker.stop(timeout)

    def wait_leader(self, timeout: float) -> bool:
        """For tests: wait until this process leads."""
        return self._leader.wait(timeout)

    def _try(self) -> None:
        """One campaign; a connection refused or lost raises, and the worker retries it on a
        new connection after retry_s."""
        try:
            self._campaign()
        finally:
            self._step_down()
            self._first_try.set()

    def _campaign(self) -> None:
        with psycopg.connect(self._url, autocommit=True, connect_timeout=5,
                             application_name="loraplex-leader", keepalives=1,
                             keepalives_idle=10, keepalives_interval=5,
                             keepalives_count=3) as conn:
            while not conn.execute("SELECT pg_try_advisory_lock(%s)",
                                   (self.key,)).fetchone()[0]:
                self._first_try.set()
                if self.worker.wait(self.retry_s):
                    return
            try:
                self._lead(conn)
            finally:
                self._step_down()  # before the connection closes and releases the lock

    def _lead(self, conn: psycopg.Connection) -> None:
        conn.execute(f"LISTEN {REPLAN_CHANNEL}")
        self._leader.set()
        log.info("leader elected pid=%d", os.getpid())
        try:
            self._on_elected()
        except Exception:
            log.exception("leader start-up failed pid=%d", os.getpid())
        self._first_try.set()
        while not self.worker.stopping:
            for note in conn.notifies(timeout=self._poll_s):
                self._deliver(note.payload)
            conn.execute("SELECT 1")  # raises once the connection (and with it the lock) is gone

    def _deliver(self, payload: str) -> None:
        try:
            self._on_replan(payload)
        except Exception:
            log.exception("replan request failed payload=%s", payload)

    def _step_down(self) -> None:
        if not self._leader.is_set():
            return
        self._leader.clear()
        log.info("leader stepping down pid=%d", os.getpid())
        try:
            self._on_deposed()
        except Exception:
            log.exception("leader step-down failed pid=%d", os.getpid())
