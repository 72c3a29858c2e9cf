"""Database engine and session factory (sync SQLAlchemy 2.0 over psycopg 3), and ReadPool, the
asyncio connections of the most-read routes (service.api.read_path). Also runs work that must wait
for a commit (e.g. Redis publishes) via after_commit()."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import orjson
import psycopg
from psycopg.types.json import set_json_loads
from sqlalchemy import Engine, create_engine, event, exc, make_url
from sqlalchemy.orm import Session, sessionmaker

_AFTER_COMMIT = "loraplex_after_commit"


def make_engine(database_url: str) -> Engine:
    """An engine with pre-ping so a restarted Postgres does not break the pool."""
    return create_engine(database_url, pool_pre_ping=True, pool_size=5, max_overflow=10)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def after_commit(session: Session, fn: Callable[[], None]) -> None:
    """Run fn once the session's current transaction commits; dropped on rollback.
    Used so a worker never sees a Redis message for a row it cannot read yet."""
    session.info.setdefault(_AFTER_COMMIT, []).append(fn)


@event.listens_for(Session, "after_commit")
def _run_after_commit(session: Session) -> None:
    callbacks = session.info.pop(_AFTER_COMMIT, [])
    for fn in callbacks:
        fn()


@event.listens_for(Session, "after_rollback")
def _drop_after_commit(session: Session) -> None:
    session.info.pop(_AFTER_COMMIT, None)


READ_POOL_SIZE = 8  # connections per API process for ReadPool (each serves one statement at once)
READ_POOL_NAME = "loraplex-read"  # their application_name in pg_stat_activity


def libpq_url(database_url: str) -> str:
    """A SQLAlchemy URL (postgresql+psycopg://...) as libpq takes it."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(
        hide_password=False)


class ReadPool:
    """Asyncio psycopg connections for the most-read routes, so that they run on the event loop
    with one round trip per statement: autocommit (a statement is its own snapshot, no
    BEGIN/ROLLBACK), psycopg prepares a statement after a few uses, results come in binary
    (nothing to write and parse as text: curves are arrays of thousands of floats), no
    pre-ping: a reused connection that fails (PostgreSQL restarted since) is dropped and the
    read retried once on a new one. At most ``size`` connections, opened on demand; a caller waits for a free one.
    Bound to the event loop that uses it (a new loop, e.g. a test client's, gets new
    connections). Errors come out as SQLAlchemy's (OperationalError, DataError, ...), so the
    app's handlers answer them as for every other route (503, 422)."""

    def __init__(self, database_url: str, size: int = READ_POOL_SIZE) -> None:
        self.conninfo = libpq_url(database_url)
        self.size = size
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: list[psycopg.AsyncConnection] = []
        self._slots = asyncio.Semaphore(size)

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self.discard_all()
            self._loop, self._slots = loop, asyncio.Semaphore(self.size)

    async def fetch(self, query: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[tuple]:
        """The rows of one read-only statement."""
        self._bind()
        async with self._slots:
            for retry in (True, False):
                reused = bool(self._idle)
                try:
                    conn = self._idle.pop() if reused else await self._connect()
                except psycopg.Error as error:
                    raise _sqlalchemy_error(query, params, error) from error
                try:
                    cursor = await conn.execute(query, params, binary=True)
                    rows = await cursor.fetchall()
                except psycopg.OperationalError as error:
                    _close(conn)
                    if reused and retry:  # stale (PostgreSQL restarted?): so are the other
                        self.discard_all()  # idle ones; once more, on a fresh connection
                        continue
                    raise _sqlalchemy_error(query, params, error) from error
                except psycopg.Error as error:  # the statement failed; the connection is fine
                    self._release(conn)
                    raise _sqlalchemy_error(query, params, error) from error
                except BaseException:  # cancelled mid-statement: its state is unknown
                    _close(conn)
                    raise
                self._release(conn)
                return rows
        raise AssertionError("unreachable")

    async def _connect(self) -> psycopg.AsyncConnection:
        conn = await psycopg.AsyncConnection.connect(  # an unreachable host: 503 in 10 s
            self.conninfo, autocommit=True, application_name=READ_POOL_NAME, connect_timeout=10)
        set_json_loads(json_loads, conn)
        return conn

    def _release(self, conn: psycopg.AsyncConnection) -> None:
        if conn.closed or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            _close(conn)
        else:
            self._idle.append(conn)

    def discard_all(self) -> None:
        """Close every idle connection (at shutdown, or when the loop changed)."""
        while self._idle:
            _close(self._idle.pop())


def json_loads(data: bytes | str) -> Any:
    """json.loads, by orjson where it gives the same (10x faster: the jsonb columns of a page of
    tasks were an eighth of the list route's time). orjson reads an integer of over 64 bits as
    a float: text with a run of 19 digits or more (no float's repr has one) goes to json."""
    raw = data.encode() if isinstance(data, str) else data
    if _LONG_DIGITS.search(raw) is None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def _close(conn: psycopg.AsyncConnection) -> None:
    # Synchronous: libpq's PQfinish closes the socket; nothing to await, nothing left to send.
    try:
        conn.pgconn.finish()
    except Exception:  # noqa: BLE001 - already closed
        pass


def _sqlalchemy_error(query: str, params: Any, error: psycopg.Error) -> exc.DBAPIError:
    # SQLAlchemy's own mapping (by the DB-API class), with the statement for the logs.
    return exc.DBAPIError.instance(query, params, error, psycopg.Error)
