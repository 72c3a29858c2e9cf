"""The lifecycle states of tasks, jobs, placements and nodes, the job exit reasons, how a task
leaves its executor, their terminal/active sets and each lifecycle's transition table, declared
once for every side.

A member is its string (`JobState.RUNNING == "running"`): the database, the API and the
messages keep the same words. service.lifecycle applies the tables; a move a table does not
list is a bug, refused there."""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """enum.StrEnum for Python 3.10 (the project's floor): str() and format() give the value."""

    __str__ = str.__str__
    __format__ = str.__format__


class TaskState(StrEnum):
    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class JobState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    EXITED = "exited"  # stopped early by the early-exit rules; exit_reason says which
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ExitReason(StrEnum):
    DIVERGING = "diverging"
    OVERFITTING = "overfitting"
    UNDERPERFORMING = "underperforming"


class PlacementState(StrEnum):
    PLANNED = "planned"
    PUBLISHED = "published"
    CLAIMED = "claimed"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SUPERSEDED = "superseded"
    STOPPED = "stopped"  # the stop the service asked for (pause, preemption): no failed attempt


class TaskOutcome(StrEnum):
    """How a task left its executor (trainer.executor says; worker.host writes the placement's
    terminal record from it). A detach asks for cancelled or paused."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"  # its unfinished jobs end cancelled; no terminal record
    PAUSED = "paused"  # it checkpointed and stopped: the service resumes it later


class NodeState(StrEnum):
    UP = "up"
    DOWN = "down"


T, J, P = TaskState, JobState, PlacementState

TASK_STATES = tuple(TaskState)
TASK_TERMINAL = (T.SUCCEEDED, T.FAILED, T.CANCELLED)
TASK_WAITING = (T.VALIDATING_FILES, T.QUEUED)  # admitted, not yet started (tenant quotas)
TASK_SCHEDULED = (T.QUEUED, T.RUNNING, T.PAUSING)  # the planner holds a finish time for it
JOB_STATES = tuple(JobState)
JOB_TERMINAL = (J.EXITED, J.COMPLETED, J.FAILED, J.CANCELLED)
JOB_LIVE = (J.PENDING, J.RUNNING)
JOB_FINISHED = (J.EXITED, J.COMPLETED)  # training ended it: it has its adapter
EXIT_REASONS = tuple(ExitReason)
PLACEMENT_STATES = tuple(PlacementState)
PLACEMENT_ACTIVE = (P.PUBLISHED, P.CLAIMED, P.RUNNING)  # at most one per task
PLACEMENT_WAITING = (P.PLANNED, P.PUBLISHED)  # no daemon runs it yet
PLACEMENT_STARTED = (P.CLAIMED, P.RUNNING)  # a daemon runs it
PLACEMENT_CURRENT = (P.PLANNED, *PLACEMENT_ACTIVE)  # the plan as stored
PLACEMENT_TERMINAL = (P.FINISHED, P.FAILED, P.CANCELLED, P.SUPERSEDED, P.STOPPED)
NODE_STATES = tuple(NodeState)

# Which state may move to which. A state moving to itself is listed where the code repeats it
# (a retried report); terminal states move nowhere.
TASK_TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    T.VALIDATING_FILES: frozenset({T.QUEUED, T.PAUSED, T.FAILED, T.CANCELLED}),
    T.QUEUED: frozenset({T.RUNNING, T.PAUSED, T.FAILED, T.CANCELLED}),
    T.RUNNING: frozenset({T.QUEUED, T.PAUSING, T.PAUSED, T.SUCCEEDED, T.FAILED, T.CANCELLED}),
    # a pausing task whose attempt ends first (finished, failed) ends as that attempt did
    T.PAUSING: frozenset({T.PAUSED, T.SUCCEEDED, T.FAILED, T.CANCELLED}),
    T.PAUSED: frozenset({T.QUEUED, T.CANCELLED}),
    T.SUCCEEDED: frozenset(),
    T.FAILED: frozenset(),
    T.CANCELLED: frozenset(),
}

# Jobs move as their executor reports them, and the executor's reports of one job may reach
# the service after a requeue put it back to pending (the next attempt resumes it): a live job
# may report any state; running -> pending is also the service parking it (pause, requeue).
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    J.PENDING: frozenset(JOB_STATES),
    J.RUNNING: frozenset(JOB_STATES),
    **{s: frozenset() for s in JOB_TERMINAL},
}

PLACEMENT_TRANSITIONS: dict[PlacementState, frozenset[PlacementState]] = {
    P.PLANNED: frozenset({P.PUBLISHED, P.SUPERSEDED, P.CANCELLED}),
    # an attempt's reports are fenced on PLACEMENT_ACTIVE: a published one may end too
    P.PUBLISHED: frozenset({P.CLAIMED, P.SUPERSEDED, P.CANCELLED, P.FINISHED, P.FAILED}),
    P.CLAIMED: frozenset({P.RUNNING, P.FINISHED, P.FAILED, P.STOPPED, P.CANCELLED}),
    P.RUNNING: frozenset({P.FINISHED, P.FAILED, P.STOPPED, P.CANCELLED}),
    **{s: frozenset() for s in PLACEMENT_TERMINAL},
}

NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    NodeState.UP: frozenset({NodeState.UP, NodeState.DOWN}),
    NodeState.DOWN: frozenset({NodeState.UP, NodeState.DOWN}),
}


def values(states: tuple[StrEnum, ...]) -> tuple[str, ...]:
    """The plain strings of `states` (for a pydantic Literal, whose schema lists values)."""
    return tuple(s.value for s in states)
del T, J, P
