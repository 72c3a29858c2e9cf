"""The states of a tracking integration's sync and its transition table, declared once:
service.tracking.integrations and .sync move them, the models and the API schema read them (this
module imports no service)."""

from __future__ import annotations

from typing import Literal

from contract.states import StrEnum, values


class SyncState(StrEnum):
    PENDING = "pending"  # not written yet: due once the task ended, retried after last_error
    SYNCED = "synced"
    FAILED = "failed"  # given up; last_error says why


SYNC_STATES = tuple(SyncState)
# The task's views show a pending sync of a task that has not ended as waiting (never stored).
SYNC_WAITING = "waiting"
SyncStatus = Literal[(SYNC_WAITING, *values(SYNC_STATES))]

# Which state may move to which: a failed attempt within the give-up clock keeps it pending.
SYNC_TRANSITIONS: dict[SyncState, frozenset[SyncState]] = {
    SyncState.PENDING: frozenset({SyncState.SYNCED, SyncState.FAILED}),
    SyncState.SYNCED: frozenset(),
    SyncState.FAILED: frozenset(),
}
