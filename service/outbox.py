"""The one leased outbox, worked the same way by webhook deliveries, tracking syncs, merged models
and sample requests (their rows: service.models_outbox): claim due rows under a lease (locked
FOR UPDATE SKIP LOCKED, a fresh lease_token and the lease's end written on them, so no two
processes attempt a row at once and one that dies leaves it due again when the lease ends),
attempt each (its lease renewed while a long attempt runs), record the outcome only while the
claim is still the row's (its id and token), due again after an exponential backoff or given up
(after a time, or after N attempts). Every function here flushes; the caller commits, except
where a function says it does."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, wait
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Select, or_, select, update
from sqlalchemy.orm import InstrumentedAttribute, Session, sessionmaker

from contract.background import BackgroundWorker
from service.core.db import session_scope
from service.models import utcnow

C = TypeVar("C")  # a claim: what an attempt needs, read while the lease was taken
R = TypeVar("R")  # an attempt's outcome


def claim(session: Session, due: Select, lease_end: InstrumentedAttribute, lease_s: float,
          **values: Any) -> tuple[list[Any], str]:
    """Lock the rows' ids ``due`` selects (its table's, the caller's order and limit) that no one
    else holds, and lease them: a fresh token, ``lease_end`` (next_attempt_at or lease_until)
    ``lease_s`` from now, and ``values``. The ids and the token ([] when none was due)."""
    table = lease_end.class_
    ids = list(session.scalars(due.with_for_update(of=table, skip_locked=True)).all())
    if not ids:
        return [], ""
    token = uuid.uuid4().hex
    session.execute(update(table).where(table.id.in_(ids)).values(
        lease_token=token, **{lease_end.key: utcnow() + timedelta(seconds=lease_s)}, **values))
    return ids, token


def lock_due(session: Session, due: Select) -> list[Any]:
    """The rows ``due`` selects that no one else holds, locked (FOR UPDATE SKIP LOCKED): for
    an outbox that leases one row at a time with ``take``."""
    return list(session.scalars(due.with_for_update(skip_locked=True)).all())


def lapsed(table: type, queued: str, running: str, now: datetime) -> Any:
    """The where clause of a row due again: queued, or running with its lease ended (the process
    that claimed it died)."""
    return or_(table.state == queued, (table.state == running) & (table.lease_until < now))


def take(row: Any, lease_s: float, now: datetime) -> str:
    """Lease a locked row (one more attempt begins): its new token."""
    row.attempts, row.lease_token = row.attempts + 1, uuid.uuid4().hex
    row.lease_until = now + timedelta(seconds=lease_s)
    return row.lease_token


def exhausted(row: Any, max_attempts: int) -> bool:
    """Give up: the row was attempted max_attempts times already."""
    return row.attempts >= max_attempts


def mine(session: Session, table: type, row_id: str, token: str, *where: Any) -> Any:
    """The row, locked, while the claim is still its own (and ``where`` holds); else None."""
    return session.scalar(select(table).where(table.id == row_id, table.lease_token == token,
                                              *where).with_for_update())


def renew(session: Session, lease_end: InstrumentedAttribute, row_id: str, token: str,
          lease_s: float, *where: Any) -> bool:
    """Extend the claim's lease; False when the row is no longer this claim's. Commits."""
    table = lease_end.class_
    done = session.execute(update(table).where(
        table.id == row_id, table.lease_token == token, *where).values(
        {lease_end.key: utcnow() + timedelta(seconds=lease_s)})).rowcount == 1
    session.commit()
    return done


def retry_at(now: datetime, tries: int, backoff_s: Sequence[float],
             give_up_at: datetime | None = None, final: bool = False) -> datetime | None:
    """When to attempt again after the tries-th failure: backoff_s[tries-1] (its last entry
    beyond; 60 s when empty) from now, jittered by 10%; None: give up (final, or past
    give_up_at)."""
    steps = list(backoff_s) or [60.0]
    due = now + timedelta(seconds=steps[min(tries, len(steps)) - 1] * random.uniform(0.9, 1.1))
    return None if final or (give_up_at is not None and due > give_up_at) else due


def work_due(factory: sessionmaker[Session], claim_due: Callable[[Session], list[C]],
             handle: Callable[[C], object], pool: Executor | None = None) -> int:
    """One pass: claim (in a session of its own; claim_due commits), then handle each claim, one
    after the other or, with a pool, at once (the first failure raised after all ended); how
    many were claimed."""
    session = factory()
    try:
        claims = claim_due(session)
    finally:
        session.close()
    if pool is None:
        for c in claims:
            handle(c)
    else:
        futures = [pool.submit(handle, c) for c in claims]
        wait(futures)
        for future in futures:
            future.result()
    return len(claims)


def attempt_and_record(factory: sessionmaker[Session], claim_: C, attempt: Callable[[C], R],
                       record: Callable[[Session, C, R], object],
                       renew_: Callable[[Session, C], bool] | None = None,
                       renew_every_s: float = 0.0) -> tuple[R, object]:
    """Attempt the claim, its lease renewed every renew_every_s meanwhile (renew_: False when
    the row is no longer the claim's: renewal stops); record the outcome in a transaction of
    its own. The outcome and what record said (the row's new state, or None: not ours)."""
    beat = None
    if renew_ is not None:
        def step() -> None:
            with session_scope(factory) as session:
                if not renew_(session, claim_):
                    beat.stop()
        beat = BackgroundWorker("loraplex-outbox-lease", step, every_s=renew_every_s,
                                wait_first=True).start()
    try:
        outcome = attempt(claim_)
    finally:
        if beat is not None:
            beat.stop()
    with session_scope(factory) as session:
        return outcome, record(session, claim_, outcome)
