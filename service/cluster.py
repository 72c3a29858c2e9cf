"""Nodes (register, heartbeat, timeout), the one hook into the scheduler, cluster_changed(), called
on task creation, cancel, completion/failure and node register/down, and the operator's view."""

from __future__ import annotations

import dataclasses
import logging
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings, get_settings
from service.db import session_scope
from service.events import add_event
from service.models import PLACEMENT_ACTIVE, Job, Node, Placement, Task, utcnow
from service.protocol import Heartbeat, HeartbeatResponse, NodeRegister, tenant_safe
from service.queue import unqueue_placement
from service.scheduler.limits import tenant_usage
from service.scheduler.replanner import Replanner, lookup, register, unregister
from service.schemas import ClusterOut, GpuPlanOut, NodeOut, PlacementOut, PlanInfoOut

log = logging.getLogger("loraplex.cluster")


def cluster_changed(session: Session, reason: str, settings: Settings | None = None) -> None:
    """Tell the scheduler the cluster changed (task arrival, cancel, completion/failure, node
    join/leave). Background mode (the default): commit and signal this process's replanner
    thread, so no request waits for the solver. Sync mode, or no replanner running in this
    process (CLI, scripts): replan here, then commit. Either way the caller commits the
    triggering change first: a failing replan is logged and rolled back, never undoing it."""
    settings = settings or get_settings()
    if not settings.scheduler_enabled:
        return
    if settings.scheduler_replan == "background":
        replanner = lookup(settings.database_url)
        if replanner is not None:
            session.commit()
            replanner.trigger(reason)
            return
    replan_now(session, settings, [reason])


def replan_now(session: Session, settings: Settings, reasons: list[str]) -> None:
    """Run service.scheduler.replan on this session and commit; log and roll back on failure."""
    try:
        from service.scheduler import replan  # type: ignore[attr-defined]
    except ImportError:
        log.info("replan skipped reason=%s detail=service.scheduler.replan not available",
                 ",".join(reasons))
        return
    try:
        replan(session, settings)
        session.commit()
        _note_reasons(reasons)
        log.info("replanned reason=%s", ",".join(reasons))
    except Exception:
        session.rollback()
        log.exception("replan failed reason=%s", ",".join(reasons))


def _note_reasons(reasons: list[str]) -> None:
    try:
        from service.scheduler import last_plan_info  # type: ignore[attr-defined]

        info = last_plan_info()
        if hasattr(info, "reasons"):
            info.reasons = list(reasons)
    except (ImportError, AttributeError):
        pass


def replan_due(session: Session, settings: Settings) -> bool:
    """Whether a periodic pass should replan: a planned start has arrived, a queued task has
    no plan at all (a lost trigger), or the last replan is older than 12 intervals while tasks
    wait (estimates drift as running tasks report progress)."""
    if session.scalar(select(Task.id).where(Task.state == "queued").limit(1)) is None:
        return False
    now = utcnow()
    if session.scalar(select(Placement.id).where(
            Placement.state == "planned", Placement.planned_start <= now).limit(1)) is not None:
        return True
    unplanned = session.scalar(select(Task.id).where(
        Task.state == "queued",
        ~select(Placement.id).where(Placement.task_id == Task.id,
                                    Placement.state.in_(("planned", *PLACEMENT_ACTIVE)))
        .exists()).limit(1))
    if unplanned is not None:
        return True
    at = _last_plan_at()
    return at is None or (now - at).total_seconds() > 12 * max(settings.scheduler_interval_s, 1)


def _last_plan_at() -> datetime | None:
    try:
        from service.scheduler import last_plan_info  # type: ignore[attr-defined]

        return getattr(last_plan_info(), "at", None)
    except (ImportError, AttributeError):
        return None


def start_replanner(factory: sessionmaker[Session], settings: Settings) -> Replanner | None:
    """Start (and register for cluster_changed) the background replanner of an app, in
    background mode with the scheduler enabled; it replans once at start, to publish what
    became due while no API ran. None in the other modes."""
    if not settings.scheduler_enabled or settings.scheduler_replan != "background":
        return None

    def run(reasons: list[str]) -> None:
        session = factory()
        try:
            replan_now(session, settings, reasons)
        finally:
            session.close()

    def due() -> bool:
        with session_scope(factory) as session:
            return replan_due(session, settings)

    replanner = Replanner(run, due, settings.scheduler_interval_s, settings.scheduler_debounce_s)
    register(settings.database_url, replanner)
    replanner.start()
    replanner.trigger("startup")
    return replanner


def stop_replanner(replanner: Replanner | None, settings: Settings) -> None:
    if replanner is not None:
        unregister(settings.database_url, replanner)
        replanner.stop()


def next_attempt(session: Session, task_id: str) -> int:
    """The attempt number a new placement of this task should carry: 1 + failed placements."""
    failed = session.scalar(select(func.count()).select_from(Placement).where(
        Placement.task_id == task_id, Placement.state == "failed"))
    return int(failed or 0) + 1


def active_placement(session: Session, task_id: str) -> Placement | None:
    return session.scalar(select(Placement).where(
        Placement.task_id == task_id, Placement.state.in_(PLACEMENT_ACTIVE)
    ).order_by(Placement.created_at.desc()).limit(1))


def register_node(session: Session, msg: NodeRegister) -> tuple[Node, bool]:
    """Create or refresh the node of this name (a restarted daemon keeps its id); (node, changed)
    where changed means the scheduler should replan."""
    node = session.scalar(select(Node).where(Node.name == msg.name))
    now = utcnow()
    if node is None:
        node = Node(name=msg.name, gpu_type=msg.gpu_type, gpu_count=msg.gpu_count,
                    gpu_memory_bytes=msg.gpu_memory_bytes, meta=msg.meta, state="up",
                    last_heartbeat_at=now)
        session.add(node)
        session.flush()
        log.info("node registered node=%s name=%s gpus=%d", node.id, node.name, node.gpu_count)
        return node, True
    changed = (node.state != "up" or node.gpu_count != msg.gpu_count
               or node.gpu_type != msg.gpu_type or node.gpu_memory_bytes != msg.gpu_memory_bytes)
    node.gpu_type, node.gpu_count = msg.gpu_type, msg.gpu_count
    node.gpu_memory_bytes, node.meta = msg.gpu_memory_bytes, msg.meta
    node.state, node.last_heartbeat_at = "up", now
    session.flush()
    return node, changed


def heartbeat(session: Session, node: Node, msg: Heartbeat) -> tuple[HeartbeatResponse, bool]:
    """Refresh the node; list the tasks it runs that must stop. (response, came back up)."""
    came_back = node.state != "up"
    node.state, node.last_heartbeat_at = "up", utcnow()
    cancelled: set[str] = set()
    if msg.running_placement_ids:
        rows = session.execute(
            select(Placement.id, Placement.task_id, Placement.state, Placement.node_id, Task.state)
            .join(Task, Task.id == Placement.task_id)
            .where(Placement.id.in_(msg.running_placement_ids)))
        for _, task_id, p_state, node_id, t_state in rows:
            if p_state not in PLACEMENT_ACTIVE or t_state == "cancelled" or node_id != node.id:
                cancelled.add(task_id)
    recent = utcnow() - timedelta(minutes=10)
    cancelled.update(session.scalars(select(Placement.task_id).where(
        Placement.node_id == node.id, Placement.state == "cancelled",
        Placement.claimed_at.is_not(None), Placement.finished_at >= recent)))
    session.flush()
    return HeartbeatResponse(node_id=node.id, state="up",
                             cancelled_task_ids=sorted(cancelled)), came_back


def requeue_task(session: Session, task: Task, reason: str) -> None:
    """Put a task whose placement died back in the queue; unfinished jobs become pending."""
    task.state = "queued"
    for job in session.scalars(select(Job).where(Job.task_id == task.id, Job.state == "running")):
        job.state = "pending"
    add_event(session, task.id, "task_requeued", tenant_safe(reason, limit=1000), level="warning")


def mark_stale_nodes(session: Session, settings: Settings | None = None) -> list[str]:
    """Mark down every up node silent for node_timeout_s; fail what ran there and requeue it.
    Returns the ids of the nodes marked down (the scheduler loop calls this periodically)."""
    settings = settings or get_settings()
    cutoff = utcnow() - timedelta(seconds=settings.node_timeout_s)
    stale = session.scalars(select(Node).where(
        Node.state == "up",
        (Node.last_heartbeat_at < cutoff) | Node.last_heartbeat_at.is_(None)).with_for_update(
        skip_locked=True)).all()
    if not stale:
        return []
    for node in stale:
        node.state = "down"
        log.warning("node down node=%s name=%s", node.id, node.name)
        lost = session.scalars(select(Placement).where(
            Placement.node_id == node.id,
            Placement.state.in_(("planned", *PLACEMENT_ACTIVE)))).all()
        for placement in lost:
            # Lock order everywhere: task first, then its placements (as cancel does).
            task = session.scalar(select(Task).where(Task.id == placement.task_id)
                                  .with_for_update())
            session.refresh(placement)
            if placement.state not in ("planned", *PLACEMENT_ACTIVE):
                continue
            if placement.state in ("planned", "published"):
                placement.state = "superseded"
                unqueue_placement(placement.id, node.id, settings)
            else:
                placement.state, placement.error = "failed", f"node {node.name} went down"
                placement.finished_at = utcnow()
                if task is not None and task.state == "running":
                    fail_or_requeue(session, task, placement, f"node {node.name} went down",
                                    settings)
    session.commit()
    cluster_changed(session, "node_down", settings)
    return [n.id for n in stale]


def fail_or_requeue(session: Session, task: Task, placement: Placement, error: str,
                    settings: Settings) -> None:
    """Retry the task from its latest checkpoint while attempts remain, else fail it."""
    if placement.attempt < settings.max_attempts:
        requeue_task(session, task, f"attempt {placement.attempt} failed: {error}")
        return
    from service.tasks import finish_task_failed

    finish_task_failed(session, task, error)


def cluster_view(session: Session) -> ClusterOut:
    """GET /v1/cluster: nodes, the plan (flat and per GPU, with tenant and priority), each
    tenant's usage against its limits, and what the last replan of this process decided."""
    nodes = session.scalars(select(Node).order_by(Node.name)).all()
    rows = session.execute(
        select(Placement, Task.tenant_id, Task.priority).join(Task, Task.id == Placement.task_id)
        .where(Placement.state.in_(("planned", *PLACEMENT_ACTIVE)))
        .order_by(Placement.planned_start, Placement.id)).all()
    plan = [PlacementOut.model_validate(p, from_attributes=True).model_copy(
        update={"tenant_id": tenant_id, "priority": priority}) for p, tenant_id, priority in rows]
    counts = dict(session.execute(select(Task.state, func.count()).where(
        Task.state.in_(("queued", "running"))).group_by(Task.state)).all())
    return ClusterOut(
        nodes=[NodeOut.model_validate(n, from_attributes=True) for n in nodes],
        gpus_total=sum(n.gpu_count for n in nodes),
        gpus_up=sum(n.gpu_count for n in nodes if n.state == "up"),
        plan=plan, gpus=_per_gpu(nodes, plan), tenants=tenant_usage(session),
        queued_tasks=counts.get("queued", 0), running_tasks=counts.get("running", 0),
        last_plan=_last_plan())


def _per_gpu(nodes: list[Node], plan: list[PlacementOut]) -> list[GpuPlanOut]:
    out = []
    for node in nodes:
        for index in range(node.gpu_count):
            mine = [p for p in plan if p.node_id == node.id and index in p.gpu_indices]
            running = next((p.task_id for p in mine if p.state in PLACEMENT_ACTIVE), None)
            out.append(GpuPlanOut(node_id=node.id, node_name=node.name, index=index,
                                  running_task_id=running, placements=mine))
    return out


def _last_plan() -> PlanInfoOut | None:
    try:
        from service.scheduler import last_plan_info  # type: ignore[attr-defined]

        info = last_plan_info()
    except (ImportError, AttributeError):
        return None
    if not (dataclasses.is_dataclass(info) and not isinstance(info, type)):
        return None
    data = dataclasses.asdict(info)
    data["status"] = str(data.get("status", "none")).lower()
    data["unschedulable"] = [{"task_id": k, "reason": v}
                             for k, v in sorted(data.get("unschedulable", {}).items())]
    return PlanInfoOut.model_validate(data)
