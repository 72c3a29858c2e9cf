"""The states of a sample request and its transition table, declared once: the lifecycle
(service.sample_requests.lifecycle) moves them, the model, the API schema and the CLI read them
(this module imports no service)."""

from __future__ import annotations

from typing import Literal

from contract.states import StrEnum, values


class SampleRequestState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"  # claimed by a node daemon, under a lease it renews
    SUCCEEDED = "succeeded"
    FAILED = "failed"


S = SampleRequestState

SAMPLE_REQUEST_STATES = tuple(SampleRequestState)
SAMPLE_REQUEST_LIVE = (S.QUEUED, S.RUNNING)
SAMPLE_REQUEST_ENDED = (S.SUCCEEDED, S.FAILED)
SampleRequestStateName = Literal[values(SAMPLE_REQUEST_STATES)]

# A running request whose lease ran out (its node died) or whose node gave it back retryably is
# queued again (or claimed at once), or fails once interrupted too often; running -> succeeded |
# failed is its claim's own report, fenced on the lease token. An ended request stays ended: the
# tenant asks again with a new POST.
SAMPLE_REQUEST_TRANSITIONS: dict[SampleRequestState, frozenset[SampleRequestState]] = {
    S.QUEUED: frozenset({S.RUNNING, S.FAILED}),
    S.RUNNING: frozenset({S.QUEUED, S.RUNNING, S.SUCCEEDED, S.FAILED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
}
del S
