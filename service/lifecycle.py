"""Every state change the service makes to a task, job, placement or node: one named function
per move, checked against contract.states' transition tables, with the fields that go with it.

They set attributes and never flush or commit (the caller owns the transaction and its lock
order: task first, then its placements and jobs). A move the table does not list raises
IllegalTransition before anything is written."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from contract.states import (
    JOB_TRANSITIONS,
    NODE_TRANSITIONS,
    PLACEMENT_TRANSITIONS,
    TASK_TRANSITIONS,
    JobState,
    NodeState,
    PlacementState,
    StrEnum,
    TaskState,
)
from service.core.errors import ApiError
from service.models import Job, Node, Placement, Task, utcnow


class IllegalTransition(ApiError):
    """A move its lifecycle's transition table does not list (a 409 where a request caused it)."""

    def __init__(self, kind: str, obj_id: str | None, current: str | None, target: str) -> None:
        super().__init__(409, "illegal_transition",
                         f"{kind} {obj_id!r} cannot go from {current} to {target}")
        self.kind, self.obj_id, self.current, self.target = kind, obj_id, current, target


def move(kind: str, obj: Any, table: Mapping[Any, frozenset], target: StrEnum,
         initial: StrEnum) -> None:
    """Set obj.state to `target` if `table` lists the move from its state (IllegalTransition
    otherwise, nothing written); the smaller machines (merged models, webhook deliveries,
    tracking syncs) move through it with their own tables."""
    # A row not flushed yet has no state: its column default, the lifecycle's first state.
    current = obj.state if obj.state is not None else initial
    if target not in table.get(current, frozenset()):
        raise IllegalTransition(kind, obj.id, current, target)
    obj.state = target.value


def _task(task: Task, target: TaskState) -> None:
    move("task", task, TASK_TRANSITIONS, target, TaskState.VALIDATING_FILES)


def _job(job: Job, target: JobState) -> None:
    move("job", job, JOB_TRANSITIONS, target, JobState.PENDING)


def _placement(placement: Placement, target: PlacementState) -> None:
    move("placement", placement, PLACEMENT_TRANSITIONS, target, PlacementState.PLANNED)


# ----- tasks -------------------------------------------------------------------------------------

def queue_task(task: Task) -> None:
    """Its files are validated: it waits for GPUs."""
    _task(task, TaskState.QUEUED)


def start_task(task: Task, now: datetime) -> None:
    """Its first placement was claimed (started_at keeps the first attempt's time)."""
    _task(task, TaskState.RUNNING)
    task.started_at = task.started_at or now


def requeue_task(task: Task) -> None:
    """Its attempt ended without finishing it (lost node, retryable failure, preemption)."""
    _task(task, TaskState.QUEUED)


def begin_pause(task: Task) -> None:
    """Its live attempt was asked to stop at a step boundary with a checkpoint."""
    _task(task, TaskState.PAUSING)


def pause_task(task: Task) -> None:
    """It holds no attempt any more and waits for resume_task."""
    _task(task, TaskState.PAUSED)


def resume_task(task: Task) -> None:
    _task(task, TaskState.QUEUED)


def succeed_task(task: Task, best_job_id: str, now: datetime) -> None:
    _task(task, TaskState.SUCCEEDED)
    task.best_job_id, task.finished_at = best_job_id, now


def fail_task(task: Task, message: str, now: datetime) -> None:
    """`message` is what the tenant reads: the caller made it tenant-safe."""
    _task(task, TaskState.FAILED)
    task.finished_at = now
    task.error = {"code": "task_failed", "message": message}


def cancel_task(task: Task, now: datetime) -> None:
    _task(task, TaskState.CANCELLED)
    task.cancelled_at, task.finished_at = now, now


# ----- jobs --------------------------------------------------------------------------------------

def report_job(job: Job, state: str, now: datetime) -> None:
    """The state its executor reported (any live job may report any state: JOB_TRANSITIONS)."""
    target = JobState(state)
    _job(job, target)
    if target is JobState.RUNNING:
        job.started_at = job.started_at or now  # the first attempt that ran it
    if not JOB_TRANSITIONS[target]:
        job.finished_at = now


def park_job(job: Job) -> None:
    """running -> pending: its attempt stopped (pause, requeue); the next one resumes it."""
    _job(job, JobState.PENDING)


def fail_job(job: Job, now: datetime, error: str | None = None) -> None:
    """The task ended before this job did."""
    _job(job, JobState.FAILED)
    job.finished_at = now
    if error is not None:
        job.error = error


def cancel_job(job: Job, now: datetime) -> None:
    _job(job, JobState.CANCELLED)
    job.finished_at = now


# ----- placements --------------------------------------------------------------------------------

def publish_placement(placement: Placement, now: datetime | None = None) -> None:
    """Planned -> published: queued for its node (service.queue sends it after the commit)."""
    _placement(placement, PlacementState.PUBLISHED)
    placement.published_at = now or utcnow()


def claim_placement(placement: Placement, now: datetime) -> None:
    """Its daemon took it and got its spec."""
    _placement(placement, PlacementState.CLAIMED)
    placement.claimed_at = now


def start_placement(placement: Placement) -> None:
    """Its first job reported running."""
    _placement(placement, PlacementState.RUNNING)


def finish_placement(placement: Placement, now: datetime) -> None:
    """Its executor finished the task."""
    _placement(placement, PlacementState.FINISHED)
    placement.finished_at = now


def fail_placement(placement: Placement, error: str, now: datetime) -> None:
    """The attempt failed (its executor said so, or its node was lost); `error` is for
    operators only."""
    _placement(placement, PlacementState.FAILED)
    placement.finished_at, placement.error = now, error


def stop_placement(placement: Placement, error: str, now: datetime) -> None:
    """The stop the service asked for (pause, preemption) ended it: no failed attempt."""
    _placement(placement, PlacementState.STOPPED)
    placement.finished_at, placement.error = now, error


def supersede_placement(placement: Placement) -> None:
    """A newer plan, the task's end or its node's loss made it unneeded before it ran."""
    _placement(placement, PlacementState.SUPERSEDED)


def cancel_placement(placement: Placement, now: datetime) -> None:
    _placement(placement, PlacementState.CANCELLED)
    placement.finished_at = now


# ----- nodes -------------------------------------------------------------------------------------

def node_up(node: Node, now: datetime | None = None) -> None:
    """It registered or heartbeated; `now` (when given) is that heartbeat."""
    move("node", node, NODE_TRANSITIONS, NodeState.UP, NodeState.UP)
    if now is not None:
        node.last_heartbeat_at = now


def node_down(node: Node) -> None:
    """Its daemon left, or went silent past the heartbeat timeout."""
    move("node", node, NODE_TRANSITIONS, NodeState.DOWN, NodeState.UP)
