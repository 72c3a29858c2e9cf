"""A task's stop moves in one place: pause (a user's: running -> pausing -> paused, resume ->
queued) and requeue (the scheduler's preemption once the stop arrives, or a lost attempt retried),
each with its jobs parked, its waiting placements retired and its event; the daemons are told
over Redis (publish_pause). service.tasks re-exports request_pause, service.cluster requeue_task
(its fail_or_requeue and attempt_lost decide between a retry and a failure)."""

from __future__ import annotations

import logging

from redis.exceptions import RedisError
from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.protocol import pause_key, tenant_safe
from contract.states import (
    PLACEMENT_STARTED,
    PLACEMENT_WAITING,
    JobState,
    PlacementState,
    TaskState,
)
from service import lifecycle
from service.core.config import Settings
from service.core.db import after_commit
from service.core.errors import conflict
from service.events import add_event
from service.models import Job, Placement, Task, utcnow
from service.queue import get_redis, unqueue_placement

log = logging.getLogger("loraplex.tasks")
PAUSE_TTL_S = 7 * 24 * 3600


def retire_waiting_placements(session: Session, task: Task) -> None:
    """A task that ended needs none of its planned or published placements any more."""
    for placement in session.scalars(select(Placement).where(
            Placement.task_id == task.id, Placement.state.in_(PLACEMENT_WAITING))):
        if placement.state == PlacementState.PUBLISHED:
            unqueue_placement(placement.id, placement.node_id)
        lifecycle.supersede_placement(placement)


def park_running_jobs(session: Session, task: Task) -> None:
    """The task's attempt ended without ending it: its running jobs wait as pending."""
    for job in session.scalars(select(Job).where(Job.task_id == task.id,
                                                 Job.state == JobState.RUNNING)):
        lifecycle.park_job(job)


def requeue_task(session: Session, task: Task, reason: str, preempted: bool = False) -> None:
    """Put a task back in the queue, its running jobs pending: its placement died (a warning
    event), or it stopped as the scheduler asked (preempted: it resumes from its checkpoint)."""
    lifecycle.requeue_task(task)
    park_running_jobs(session, task)
    if preempted:
        add_event(session, task.id, "task_requeued", reason, data={"preempted": True})
    else:
        add_event(session, task.id, "task_requeued", tenant_safe(reason, limit=1000),
                  level="warning")


# A pause stops the task's live attempt at a step boundary with a checkpoint, through the daemon
# (heartbeat reply pause_placement_ids, Redis pause_key): the executor gets SIGTERM, checkpoints,
# reports everything up to its stop and then a retryable failure "executor stopped". The fence
# lets all of it in (the attempt stays live until then); its stop report ends it as `stopped`
# (not a failed attempt) via attempt_stopped. Task states:
#   requeue=False (a user's pause): running -> pausing -> paused; resume_task: paused -> queued.
#   requeue=True (the scheduler's preemption): the task stays running until the stop arrives,
#   then goes back to queued (and is replanned), resuming from that checkpoint.
#   A task with no live attempt (queued, or placed but not yet claimed) pauses at once.
PAUSABLE = (TaskState.VALIDATING_FILES, TaskState.QUEUED, TaskState.RUNNING)


def request_pause(session: Session, task: Task, *, requeue: bool, reason: str,
                  settings: Settings | None = None) -> None:
    """Ask `task` (locked by the caller: get_task(lock=True)) to stop at its next step boundary
    with a checkpoint, freeing its GPUs; requeue=True puts it back in the queue once stopped,
    requeue=False leaves it paused until resume_task. Flushes; the caller commits (the daemon is
    told over Redis after the commit, and by every heartbeat reply until it stopped). A task
    already pausing or paused is left as it is; a finished one is a 409 naming its state."""
    if task.state in (TaskState.PAUSING, TaskState.PAUSED):
        return
    if task.state not in PAUSABLE:
        raise conflict(f"task {task.id!r} is {task.state}: only a queued or running task can be "
                       "paused", code=f"task_{task.state}")
    live = session.scalars(select(Placement).where(
        Placement.task_id == task.id, Placement.state.in_(PLACEMENT_STARTED))
        .with_for_update()).all()
    if not live:
        if requeue:
            return  # nothing runs: it is waiting already
        retire_waiting_placements(session, task)
        finish_pause(session, task, reason)
        return
    kind = "requeue" if requeue else "pause"
    for placement in live:
        placement.stop_requested = kind
    retire_waiting_placements(session, task)
    if not requeue:
        lifecycle.begin_pause(task)
    add_event(session, task.id, "task_pausing" if not requeue else "task_preempting",
              f"stopping at the next step boundary with a checkpoint: {tenant_safe(reason)}",
              data={"requeue": requeue})
    ids = [p.id for p in live]
    after_commit(session, lambda: publish_pause(ids, settings))
    session.flush()
    log.info("task pause requested task=%s requeue=%s placements=%s", task.id, requeue,
             ",".join(ids))


def finish_pause(session: Session, task: Task, reason: str) -> None:
    """The task holds no attempt any more: paused (its running jobs wait as pending)."""
    lifecycle.pause_task(task)
    park_running_jobs(session, task)
    add_event(session, task.id, "task_paused", f"paused: {tenant_safe(reason)}; resume to "
              "continue from its last checkpoint")


def attempt_stopped(session: Session, task: Task, placement: Placement, error: str) -> bool:
    """The end of an attempt the service asked to stop (placement.stop_requested), reported as a
    retryable failure: the placement is `stopped` (no failed attempt counted) and the task
    paused (it was pausing) or queued again (a requeue). False when the placement had no stop
    requested: the caller handles an ordinary failure."""
    if placement.stop_requested is None or placement.state not in PLACEMENT_STARTED:
        return False
    lifecycle.stop_placement(placement, error, utcnow())
    if task.state == TaskState.PAUSING:
        finish_pause(session, task, "stopped at a step boundary")
    elif task.state == TaskState.RUNNING:
        requeue_task(session, task, "stopped at a step boundary to free its GPUs; it resumes "
                     "from its checkpoint", preempted=True)
    session.flush()
    log.info("attempt stopped task=%s placement=%s state=%s", task.id, placement.id, task.state)
    return True


def resume_task(session: Session, task: Task) -> None:
    """paused -> queued (locked by the caller); the next attempt resumes from the task's latest
    checkpoint (build_spec offers it). 409 naming the state from anything but paused."""
    if task.state != TaskState.PAUSED:
        raise conflict(f"task {task.id!r} is {task.state}: only a paused task can be resumed",
                       code=f"task_{task.state}")
    lifecycle.resume_task(task)
    add_event(session, task.id, "task_resumed", "resumed: waiting for GPUs; it continues from "
              "its last checkpoint")
    session.flush()
    log.info("task resumed task=%s", task.id)


def publish_pause(placement_ids: list[str], settings: Settings | None = None) -> None:
    """Tell the daemons now (Redis pause_key) that these placements must checkpoint and stop;
    heartbeat replies carry the same news if this is lost."""
    try:
        pipe = get_redis(settings).pipeline(transaction=False)
        for placement_id in placement_ids:
            pipe.set(pause_key(placement_id), "1", ex=PAUSE_TTL_S)
        pipe.execute()
    except RedisError as exc:
        log.warning("pause publish failed placements=%s error=%s", ",".join(placement_ids), exc)
