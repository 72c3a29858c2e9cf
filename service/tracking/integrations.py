"""A task's integrations at create (checked: a 422 naming the field; stored: one row each, the
outbox of their sync) and in the task's views (with each one's sync status)."""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from service.core.config import Settings
from service.core.db import after_commit
from service.core.errors import invalid
from service.lifecycle import move
from service.models import TASK_TERMINAL, TaskIntegration
from service.tracking.schemas import IntegrationIn, MlflowSettings, WandbSettings
from service.tracking.states import SYNC_TRANSITIONS, SYNC_WAITING, SyncState
from service.webhooks.security import AddressRefused, Target, resolve

ALLOW_PRIVATE = "LORAPLEX_TRACKING_ALLOW_PRIVATE"
ENDED = ("task_succeeded", "task_failed", "task_cancelled")  # the events of a task's end
# Set when this process committed a task's end whose integrations are now due: its syncer (if it
# leads) looks at once, not at its next poll (service.tracking.sync); others poll.
requested = threading.Event()
SETTINGS = {"wandb": WandbSettings, "mlflow": MlflowSettings}

# The task's integrations for its views, in order, one array per row: [type, config, state,
# attempts, last_error, synced_at as Unix seconds]; {task} is the tasks table's name or alias in
# the enclosing statement (service.task_views.task_outs and service.api.read_path share it).
VIEW_SQL = ("(SELECT json_agg(json_build_array(i.type, i.config, i.state, i.attempts, "
            "i.last_error, extract(epoch FROM i.synced_at)::bigint) ORDER BY i.position) "
            "FROM task_integrations i WHERE i.task_id = {task}.id)")


def move_sync(row: TaskIntegration, target: SyncState) -> None:
    move("tracking integration", row, SYNC_TRANSITIONS, target, SyncState.PENDING)


def check_tracking_uri(uri: str, settings: Settings) -> Target:
    """Where to connect for the URI (its host resolved now, the address pinned); AddressRefused
    unless it is http(s) with a host, no credentials, query or fragment, and resolves to
    addresses the operator allows (the webhooks' rule, service.webhooks.security.resolve)."""
    parts = urlsplit(uri)
    if parts.query or parts.fragment:
        raise AddressRefused("the URL may not have a query or fragment")
    return resolve(uri, settings.tracking_allow_private, ALLOW_PRIVATE)


def check_integrations(integrations: list[IntegrationIn] | None, settings: Settings) -> None:
    """422 naming the field (``integrations.mlflow.tracking_uri``; the message says which
    position) unless each integration gives the settings of its type and no other, and each
    MLflow tracking URI is one the service may call."""
    for i, item in enumerate(integrations or ()):
        other = "mlflow" if item.type == "wandb" else "wandb"
        if getattr(item, item.type) is None:
            raise invalid(f"integrations[{i}].{item.type}: required when type is {item.type!r}",
                          param=f"integrations.{item.type}")
        if getattr(item, other) is not None:
            raise invalid(f"integrations[{i}].{other}: not allowed when type is {item.type!r}",
                          param=f"integrations.{other}")
        if item.mlflow is not None:
            try:
                check_tracking_uri(item.mlflow.tracking_uri, settings)
            except AddressRefused as exc:
                raise invalid(f"integrations[{i}].mlflow.tracking_uri: {exc}",
                              param="integrations.mlflow.tracking_uri",
                              code="invalid_url") from exc


def add_integrations(session: Session, task_id: str,
                     integrations: list[IntegrationIn] | None) -> None:
    """The task's integration rows (pending: synced once the task ended); the caller flushes."""
    for position, item in enumerate(integrations or ()):
        config = getattr(item, item.type).model_dump(mode="json", exclude_none=True)
        session.add(TaskIntegration(task_id=task_id, position=position, type=item.type,
                                    config=config, state=SyncState.PENDING.value))


def integration_views(rows: list | None, task_state: str) -> list[dict]:
    """IntegrationOut's fields, in its order, from VIEW_SQL's arrays: what was asked, and the
    sync's status (waiting while the task has not ended)."""
    out = []
    for kind, config, state, attempts, last_error, synced_at in rows or ():
        given = SETTINGS[kind].model_validate(config).model_dump()
        waiting = state == SyncState.PENDING and task_state not in TASK_TERMINAL
        status = SYNC_WAITING if waiting else state
        out.append({"type": kind, "wandb": given if kind == "wandb" else None,
                    "mlflow": given if kind == "mlflow" else None, "status": status,
                    "attempts": attempts, "last_error": last_error,
                    "synced_at": None if synced_at is None else int(synced_at)})
    return out


def on_task_event(session: Session, task_id: str, type: str) -> None:
    """A task event (service.events.add_event calls this in its transaction): the task's end
    wakes this process's syncer once it commits, if the task has integrations."""
    if type in ENDED and session.scalar(select(exists().where(
            TaskIntegration.task_id == task_id, TaskIntegration.state == SyncState.PENDING))):
        after_commit(session, requested.set)
