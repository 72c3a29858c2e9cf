"""The states of a merged model and its transition table, declared once: service.merged.lifecycle
moves them, the models, the API schema and the CLI read them (this module imports no service)."""

from __future__ import annotations

from typing import Literal

from contract.states import StrEnum, values


class MergeState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"  # claimed by the merger, under a lease it renews
    SUCCEEDED = "succeeded"
    FAILED = "failed"


M = MergeState

MERGE_STATES = tuple(MergeState)
MERGE_LIVE = (M.QUEUED, M.RUNNING)  # not ended: the merger will claim it, or runs it
# The plain strings, for the API's field (its schema lists the values).
MergeStateName = Literal[values(MERGE_STATES)]

# Which state may move to which. Asking again re-queues a failed merge, or any whose job's adapter
# changed; a running one whose lease ran out is claimed again, or fails once interrupted too often.
# running -> succeeded | failed is the claim's own UPDATE, fenced on its lease token (only a
# running row has one).
MERGE_TRANSITIONS: dict[MergeState, frozenset[MergeState]] = {
    M.QUEUED: frozenset({M.QUEUED, M.RUNNING, M.FAILED}),
    M.RUNNING: frozenset({M.QUEUED, M.RUNNING, M.SUCCEEDED, M.FAILED}),
    M.SUCCEEDED: frozenset({M.QUEUED}),
    M.FAILED: frozenset({M.QUEUED}),
}
del M
