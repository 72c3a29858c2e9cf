"""What the internal API does for worker daemons: claim a placement (-> PlacementSpec), the
reports of an attempt (events, loss points, job states, artifacts, the task's end), a node leaving.

Every report passes ONE fence, ``fence_report``: it is stored only when it names the task's current
live placement (= attempt) and the task is not over; anything else is a 409 and stores nothing.
Every call is retry-safe."""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from contract.protocol import (
    EventBatch,
    JobHyperparameters,
    JobSpec,
    JobStateUpdate,
    MetricBatch,
    NodeDeregister,
    NodeDeregistered,
    PlacementSpec,
    TaskFailed,
    TaskFinished,
    tenant_safe,
)
from contract.states import (
    PLACEMENT_CURRENT,
    PLACEMENT_STARTED,
    PLACEMENT_WAITING,
    NodeState,
    PlacementState,
    TaskState,
)
from service import lifecycle
from service.cluster import attempt_lost, cluster_changed, fail_or_requeue
from service.core.config import Settings
from service.core.errors import conflict, invalid, not_found
from service.core.registry import ModelRegistry
from service.events import add_event, ingest_events, ingest_metrics
from service.models import (
    PLACEMENT_ACTIVE,
    TASK_TERMINAL,
    Artifact,
    File,
    Job,
    Node,
    Placement,
    Task,
    utcnow,
)
from service.pausing import attempt_stopped
from service.queue import empty_node_queue, unqueue_placement
from service.scheduler.loop import PLAN_LOCK_KEY
from service.tasks import (
    finish_task_failed,
    finish_task_succeeded,
    update_job_state,
)

log = logging.getLogger("loraplex.worker_api")


def get_task_any(session: Session, task_id: str, lock: bool = False) -> Task:
    query = select(Task).where(Task.id == task_id)
    task = session.scalar(query.with_for_update() if lock else query)
    if task is None:
        raise not_found("task", task_id)
    return task


def claim_placement(session: Session, placement_id: str, node_id: str,
                    registry: ModelRegistry) -> PlacementSpec:
    """Claim a published placement for node_id and return its spec; the same node claiming
    again gets the same spec, anyone else a 409."""
    placement = session.get(Placement, placement_id)
    if placement is None:
        raise not_found("placement", placement_id)
    if placement.node_id != node_id:
        raise conflict(f"placement {placement_id!r} belongs to another node", code="wrong_node")
    # Lock order everywhere: task first, then its placements/jobs (as cancel does).
    task = get_task_any(session, placement.task_id, lock=True)
    session.refresh(placement, with_for_update=True)
    if placement.state in PLACEMENT_STARTED:
        return build_spec(session, placement, task, registry)
    if placement.state != PlacementState.PUBLISHED or task.state in TASK_TERMINAL:
        raise conflict(f"placement {placement_id!r} is {placement.state} (task {task.state})",
                       code=f"placement_{placement.state}")
    spec = build_spec(session, placement, task, registry)
    now = utcnow()
    lifecycle.claim_placement(placement, now)
    if task.state == TaskState.QUEUED:
        lifecycle.start_task(task, now)
    # Tenants read events: no node ids or names (GET /v1/cluster shows them to operators).
    add_event(session, task.id, "task_running",
              f"attempt {placement.attempt} started on {len(placement.gpu_indices)} GPU(s)",
              data={"placement_id": placement.id, "gpu_indices": list(placement.gpu_indices),
                    "attempt": placement.attempt})
    session.commit()
    log.info("placement claimed placement=%s task=%s node=%s", placement.id, task.id, node_id)
    return spec


def latest_checkpoint(session: Session, task_id: str) -> Artifact | None:
    return session.scalar(select(Artifact).where(
        Artifact.task_id == task_id, Artifact.kind == "checkpoint"
    ).order_by(Artifact.step.desc().nulls_last(), Artifact.created_at.desc()).limit(1))


def build_spec(session: Session, placement: Placement, task: Task,
               registry: ModelRegistry) -> PlacementSpec:
    model = registry.get(task.base_model)
    if model is None:
        raise conflict(f"base model {task.base_model!r} is no longer registered",
                       code="model_unavailable")
    train = session.get(File, task.training_file_id)
    assert train is not None
    jobs = session.scalars(select(Job).where(Job.task_id == task.id).order_by(Job.index)).all()
    ckpt = latest_checkpoint(session, task.id)
    return PlacementSpec(
        task_id=task.id, placement_id=placement.id, attempt=placement.attempt,
        node_id=placement.node_id, gpu_indices=list(placement.gpu_indices),
        method=task.method, base_model=task.base_model, base_model_path=model.path,  # type: ignore[arg-type]
        training_file_id=train.id, training_file_url=f"/internal/v1/files/{train.id}/content",
        training_file_format=train.format, validation_file_id=task.validation_file_id,
        validation_file_url=(f"/internal/v1/files/{task.validation_file_id}/content"
                             if task.validation_file_id else None),
        init_adapter_file_id=task.init_adapter_file_id,
        init_adapter_url=(f"/internal/v1/files/{task.init_adapter_file_id}/content"
                          if task.init_adapter_file_id else None),
        settings=task.task_settings(),
        jobs=[JobSpec(job_id=j.id, index=j.index, state=j.state,
                      hyperparameters=JobHyperparameters.model_validate(j.config)) for j in jobs],
        resume_checkpoint_artifact_id=ckpt.id if ckpt else None,
        resume_checkpoint_files=[f"/internal/v1/artifacts/{ckpt.id}/files/{f['name']}"
                                 for f in ckpt.files] if ckpt else [])


def _placement_of(session: Session, task: Task, placement_id: str) -> Placement:
    placement = session.scalar(
        select(Placement).where(Placement.id == placement_id).with_for_update())
    if placement is None or placement.task_id != task.id:
        raise not_found("placement", placement_id, param="placement_id")
    return placement


def _require_live(task: Task, placement: Placement) -> None:
    """A report may only move a task that is not over, through its current placement."""
    if task.state in TASK_TERMINAL:
        raise conflict(f"task {task.id!r} is {task.state}", code=f"task_{task.state}")
    if placement.state not in PLACEMENT_ACTIVE:
        raise conflict(f"placement {placement.id!r} (attempt {placement.attempt}) is "
                       f"{placement.state}: not the task's current attempt", code="stale_attempt")


def fence_report(session: Session, task_id: str, placement_id: str,
                 retry_of: Callable[[Placement], bool] | None = None) -> tuple[Task, Placement]:
    """THE fence of every worker report (events, loss points, job states, artifacts, throughput,
    the task's end): lock the task, then the placement (the lock order of cancel, so a report
    and a cancel never interleave), and let through only the task's current live placement of
    a task that is not over. 404: unknown task, or a placement of another task; 409 task_<state>:
    the task is over; 409 stale_attempt: a superseded, failed, finished or cancelled attempt.

    retry_of(placement) says that the placement ended through this very report (a TaskFinished
    or TaskFailed sent again): it is let through, and the caller answers without storing."""
    task = get_task_any(session, task_id, lock=True)
    placement = _placement_of(session, task, placement_id)
    if retry_of is not None and retry_of(placement):
        return task, placement
    _require_live(task, placement)
    return task, placement


def report_events(session: Session, task_id: str, msg: EventBatch) -> int:
    """Store an attempt's events (client_key already stored: skipped); the new count."""
    task, _ = fence_report(session, task_id, msg.placement_id)
    return ingest_events(session, task, msg.events)


def report_metrics(session: Session, task_id: str, msg: MetricBatch) -> int:
    """Store an attempt's loss points ((job, step, split) already stored: ignored)."""
    task, _ = fence_report(session, task_id, msg.placement_id)
    return ingest_metrics(session, task, msg.points)


def report_job_state(session: Session, job_id: str, msg: JobStateUpdate) -> tuple[Job, bool]:
    """Apply an attempt's job state change; (job, whether it has an adapter)."""
    job = session.get(Job, job_id)
    if job is None:
        raise not_found("job", job_id)
    task, placement = fence_report(session, job.task_id, msg.placement_id)
    session.refresh(job, with_for_update=True)  # after the task: the lock order of cancel
    update_job_state(session, task, job, msg, placement)
    has_adapter = session.scalar(select(Artifact.id).where(
        Artifact.job_id == job.id, Artifact.kind == "adapter")) is not None
    return job, has_adapter


def task_finished(session: Session, task_id: str, msg: TaskFinished, settings: Settings) -> Task:
    task, placement = fence_report(session, task_id, msg.placement_id,
                                   retry_of=lambda p: p.state == PlacementState.FINISHED)
    if placement.state not in PLACEMENT_ACTIVE:
        return task  # a retry: the task already ended through this attempt
    if msg.best_job_id is not None:
        has_adapter = session.scalar(select(Artifact.id).where(
            Artifact.task_id == task.id, Artifact.job_id == msg.best_job_id,
            Artifact.kind == "adapter"))
        if has_adapter is None:
            raise invalid(f"best_job_id {msg.best_job_id!r} has no adapter of this task",
                          param="best_job_id")
    lifecycle.finish_placement(placement, utcnow())
    if placement.claimed_at is not None:  # the measured run the estimate is checked against
        placement.run_s = (placement.finished_at - placement.claimed_at).total_seconds()
    finish_task_succeeded(session, task, msg.best_job_id)
    session.commit()
    log.info("task finished task=%s state=%s best_job=%s", task.id, task.state, task.best_job_id)
    cluster_changed(session, "task_finished", settings)
    return task


def task_failed(session: Session, task_id: str, msg: TaskFailed, settings: Settings) -> Task:
    # The tenant reads a short, safe message (task error, events); the raw error and the
    # traceback stay in the operator-only placement.error (no tenant schema has it).
    error = msg.error if not msg.detail else f"{msg.error}\n\n{msg.detail}"
    # A retry is this attempt failed with this error; an attempt the service failed first (its
    # node was lost) is stale, as for every other report.
    task, placement = fence_report(
        session, task_id, msg.placement_id,
        retry_of=lambda p: p.state in (PlacementState.FAILED, PlacementState.STOPPED)
        and p.error == error)
    if placement.state not in PLACEMENT_ACTIVE:
        return task
    shown = tenant_safe(msg.error) or "training failed"
    if msg.retryable and attempt_stopped(session, task, placement, error):
        # The stop the service asked for (pause, preemption): not a failed attempt.
        session.commit()
        cluster_changed(session, "task_stopped", settings)
        return task
    lifecycle.fail_placement(placement, error, utcnow())
    if msg.retryable:
        fail_or_requeue(session, task, placement, shown, settings)
    else:
        finish_task_failed(session, task, shown)
    session.commit()
    log.warning("task attempt failed task=%s attempt=%d state=%s error=%r", task.id,
                placement.attempt, task.state, msg.error[:200])
    cluster_changed(session, "task_failed", settings)
    return task


def job_of_task(session: Session, task: Task, job_id: str) -> Job:
    job = session.get(Job, job_id)
    if job is None or job.task_id != task.id:
        raise not_found("job", job_id)
    return job



def deregister_node(session: Session, node_id: str, msg: NodeDeregister,
                    settings: Settings) -> NodeDeregistered:
    """A daemon leaves cleanly: its node goes down now (not after the heartbeat timeout), its
    published placements are superseded and its queue emptied, anything still claimed there is
    failed over like a lost node's, then the scheduler replans. Repeating it changes nothing;
    the node comes back up when its daemon registers or heartbeats again."""
    # Wait for a replan in flight (it holds this lock until it commits): one that read the
    # node as up must not publish onto it after we superseded its placements.
    session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PLAN_LOCK_KEY})
    node = session.scalar(select(Node).where(Node.id == node_id).with_for_update())
    if node is None:
        raise not_found("node", node_id)
    was_up = node.state == NodeState.UP
    lifecycle.node_down(node)
    superseded, requeued = [], []
    rows = session.scalars(select(Placement).where(
        Placement.node_id == node.id, Placement.state.in_(PLACEMENT_CURRENT))
        .order_by(Placement.created_at)).all()
    for placement in rows:
        # Lock order everywhere: task first, then its placements (as cancel does).
        task = get_task_any(session, placement.task_id, lock=True)
        session.refresh(placement, with_for_update=True)
        if placement.state in PLACEMENT_WAITING:
            lifecycle.supersede_placement(placement)
            superseded.append(placement.id)
        elif placement.state in PLACEMENT_ACTIVE:
            error = f"node {node.name} left: {msg.reason}"
            lifecycle.fail_placement(placement, error, utcnow())
            was = task.state
            attempt_lost(session, task, placement, settings, "its node left the cluster",
                         "its node left while it stopped")
            if was == TaskState.RUNNING and task.state == TaskState.QUEUED:
                requeued.append(task.id)
    session.commit()
    for placement_id in superseded:
        unqueue_placement(placement_id, node.id, settings)
    dropped = empty_node_queue(node.id, settings)
    log.info("node deregistered node=%s name=%s reason=%s superseded=%d requeued=%d "
             "queue_dropped=%d", node.id, node.name, msg.reason, len(superseded), len(requeued),
             dropped)
    if was_up or superseded or requeued:
        cluster_changed(session, "node_deregistered", settings)
    return NodeDeregistered(node_id=node.id, state=NodeState.DOWN.value, superseded_placement_ids=superseded,
                            requeued_task_ids=requeued)
