"""Database engine and session factory (sync SQLAlchemy 2.0 over psycopg 3).
Also runs work that must wait for a commit (e.g. Redis publishes) via after_commit()."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine, event
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
