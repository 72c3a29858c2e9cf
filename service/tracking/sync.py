"""The tracking syncer: a thread of the leader (service.api.background) that writes the runs of ended
tasks' integrations, from the metrics in PostgreSQL, modelled on the webhook outbox. A task's
integration rows are written with the task; once the task is terminal (succeeded, failed,
cancelled) a pending row is due. A pass claims due rows with FOR UPDATE SKIP LOCKED and moves
their next_attempt_at past a lease (a process that dies mid-sync leaves the row due again when
the lease ends), writes the runs (service.tracking.mlflow_writer / wandb_writer: idempotent, so a
retry after such a death writes each run once) and records the outcome: synced, or retried after
tracking_backoff_s until tracking_give_up_s after the task's end, then failed. A failure touches
only its own row, never the task."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from contract.background import BackgroundWorker
from contract.protocol import tenant_safe
from service import outbox
from service.core.config import Settings
from service.core.db import session_scope
from service.models import TASK_TERMINAL, Task, TaskIntegration, utcnow
from service.tracking.integrations import move_sync, requested
from service.tracking.mlflow_writer import write_mlflow
from service.tracking.records import TaskRecord, load_task
from service.tracking.states import SyncState
from service.tracking.wandb_writer import WandbUnavailable, write_wandb
from service.webhooks.security import AddressRefused

log = logging.getLogger("loraplex.tracking")
BATCH = 4  # rows a pass claims (synced one after the other)


@dataclass(frozen=True)
class Claim:
    integration_id: str
    task_id: str
    type: str
    config: dict
    token: str


@dataclass(frozen=True)
class Outcome:
    result: dict | None  # what was written, when it was
    error: str | None = None
    final: bool = False  # the error will not go away by retrying


def claim_due(session: Session, settings: Settings, limit: int = BATCH) -> list[Claim]:
    """Claim up to `limit` due integrations of ended tasks, oldest due first; commits."""
    ids, token = outbox.claim(session, select(TaskIntegration.id)
        .join(Task, Task.id == TaskIntegration.task_id)
        .where(TaskIntegration.state == SyncState.PENDING,
               TaskIntegration.next_attempt_at <= utcnow(), Task.state.in_(TASK_TERMINAL))
        .order_by(TaskIntegration.next_attempt_at).limit(limit),
        TaskIntegration.next_attempt_at, settings.tracking_lease_s)
    if not ids:
        session.rollback()
        return []
    rows = {r.id: r for r in session.execute(select(
        TaskIntegration.id, TaskIntegration.task_id, TaskIntegration.type,
        TaskIntegration.config).where(TaskIntegration.id.in_(ids)))}
    session.commit()
    return [Claim(i, rows[i].task_id, rows[i].type, dict(rows[i].config), token) for i in ids]


def write_runs(claim: Claim, task: TaskRecord, settings: Settings) -> Outcome:
    """Write the claimed integration's runs once; never raises."""
    try:
        if claim.type == "mlflow":
            return Outcome(write_mlflow(task, claim.config, settings))
        return Outcome(write_wandb(task, claim.config, settings, claim.integration_id))
    except WandbUnavailable as exc:
        return Outcome(None, str(exc), final=True)
    except AddressRefused as exc:  # the host resolves elsewhere now: may change back
        return Outcome(None, f"tracking_uri: {exc}")
    except Exception as exc:  # noqa: BLE001 - this attempt's failure: logged and retried
        log.warning("tracking sync failed integration=%s task=%s type=%s error=%s",
                    claim.integration_id, claim.task_id, claim.type, exc)
        return Outcome(None, describe(exc))


def describe(exc: Exception) -> str:
    """An unexpected failure as last_error: its kind and reason; a filesystem error without the
    file names it carries (the log above has them)."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def record(session: Session, claim: Claim, outcome: Outcome, settings: Settings) -> str | None:
    """Move the integration on (synced, due again later, or failed); its new state, or None when
    it is no longer this claim's (its lease ended and another pass took it). Commits."""
    row = outbox.mine(session, TaskIntegration, claim.integration_id, claim.token)
    if row is None:
        session.rollback()
        return None
    now = utcnow()
    row.attempts += 1
    row.lease_token = None
    if outcome.result is not None:
        move_sync(row, SyncState.SYNCED)
        row.result, row.synced_at = outcome.result, now
        row.last_error, row.next_attempt_at = None, None
    else:
        row.last_error = tenant_safe(outcome.error or "sync failed")
        ended = session.scalar(select(Task.finished_at).where(Task.id == row.task_id)) or now
        row.next_attempt_at = outbox.retry_at(
            now, row.attempts, settings.tracking_backoff_s,
            ended + timedelta(seconds=settings.tracking_give_up_s), final=outcome.final)
        if row.next_attempt_at is None:
            move_sync(row, SyncState.FAILED)
    session.commit()
    return row.state


def sync_one(factory: sessionmaker[Session], claim: Claim, settings: Settings) -> str | None:
    """Read the task, write the claim's runs, record the outcome: the integration's new state."""
    def attempt(c: Claim) -> Outcome:
        with session_scope(factory) as session:
            task = load_task(session, c.task_id)
        return write_runs(c, task, settings)

    outcome, state = outbox.attempt_and_record(
        factory, claim, attempt, lambda s, c, o: record(s, c, o, settings))
    log.info("tracking sync integration=%s task=%s type=%s state=%s%s", claim.integration_id,
             claim.task_id, claim.type, state,
             f" error={outcome.error!r}" if outcome.error else "")
    return state


def sync_due(factory: sessionmaker[Session], settings: Settings) -> int:
    """One pass: claim due integrations and sync each; how many were claimed."""
    def sync(claim: Claim) -> None:
        try:
            sync_one(factory, claim, settings)
        except Exception:  # the database went away, or the task with it: its lease ends
            log.exception("tracking sync crashed integration=%s task=%s", claim.integration_id,
                          claim.task_id)

    return outbox.work_due(factory, lambda s: claim_due(s, settings), sync)


def syncer(factory: sessionmaker[Session], settings: Settings) -> BackgroundWorker:
    """The leader's sync worker: a pass whenever a task ended in this process and every
    tracking_poll_s, at once again after a full one; start it when elected, stop it when deposed
    (a sync under way finishes in its daemon thread, or its lease ends)."""
    return BackgroundWorker("loraplex-tracking", lambda: sync_due(factory, settings) == BATCH,
                            every_s=settings.tracking_poll_s, wake=requested, logger=log,
                            stop_s=5.0)
