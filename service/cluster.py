"""Nodes (register, heartbeat, timeout), the one hook into the scheduler, cluster_changed(), called
on task creation, cancel, completion/failure and node register/down, and the operator's view.

A node is down only when it was silent while the service itself was healthy: ServiceHealth keeps
this process's view of its database, and mark_stale_nodes counts a node's silence from the later of
its last heartbeat and the service's recovery. Heartbeat replies name placements (attempts) to
stop, never a task, so a new attempt of a task on the same node is never stopped for an old one."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

from sqlalchemy import func, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from contract.protocol import Heartbeat, HeartbeatResponse, NodeRegister
from contract.states import (
    PLACEMENT_CURRENT,
    PLACEMENT_WAITING,
    NodeState,
    PlacementState,
    TaskState,
)
from service import lifecycle
from service.core.config import Settings, get_settings
from service.models import PLACEMENT_ACTIVE, TASK_TERMINAL, Node, Placement, Task, utcnow
from service.pausing import finish_pause
from service.pausing import requeue_task as requeue_task  # re-exported
from service.queue import unqueue_placement
from service.scheduler.limits import tenant_usage
from service.scheduler.replanner import lookup
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
    if session.scalar(select(Task.id).where(Task.state == TaskState.QUEUED).limit(1)) is None:
        return False
    now = utcnow()
    if session.scalar(select(Placement.id).where(
            Placement.state == PlacementState.PLANNED,
            Placement.planned_start <= now).limit(1)) is not None:
        return True
    unplanned = session.scalar(select(Task.id).where(
        Task.state == TaskState.QUEUED,
        ~select(Placement.id).where(Placement.task_id == Task.id,
                                    Placement.state.in_(PLACEMENT_CURRENT))
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


def next_attempt(session: Session, task_id: str) -> int:
    """The attempt number a new placement of this task should carry: 1 + failed placements."""
    failed = session.scalar(select(func.count()).select_from(Placement).where(
        Placement.task_id == task_id, Placement.state == PlacementState.FAILED))
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
                    gpu_memory_bytes=msg.gpu_memory_bytes, meta=msg.meta, state=NodeState.UP.value,
                    last_heartbeat_at=now)
        session.add(node)
        session.flush()
        log.info("node registered node=%s name=%s gpus=%d", node.id, node.name, node.gpu_count)
        return node, True
    changed = (node.state != NodeState.UP or node.gpu_count != msg.gpu_count
               or node.gpu_type != msg.gpu_type or node.gpu_memory_bytes != msg.gpu_memory_bytes)
    node.gpu_type, node.gpu_count = msg.gpu_type, msg.gpu_count
    node.gpu_memory_bytes, node.meta = msg.gpu_memory_bytes, msg.meta
    lifecycle.node_up(node, now)
    node.executors = node.executors_at = None  # a restarted daemon reports them anew
    session.flush()
    return node, changed


def heartbeat(session: Session, node: Node, msg: Heartbeat) -> tuple[HeartbeatResponse, bool]:
    """Refresh the node (a node that was down is up again and keeps every placement that is still
    current) and its shared executors (co-location); name the placements it reports that must
    stop. (response, replan: it came back up, or an executor has new room while tasks wait)."""
    came_back = node.state != NodeState.UP
    before = _executor_room(node.executors)
    lifecycle.node_up(node, utcnow())
    # The node's shared executors as of now: the scheduler reads them while fresh.
    node.executors = [e.model_dump(mode="json") for e in msg.executors]
    node.executors_at = node.last_heartbeat_at
    after = _executor_room(node.executors)
    roomier = any(rows > before.get(k, -1) for k, rows in after.items())
    if roomier and not came_back:
        came_back = session.scalar(select(Task.id).where(Task.state == TaskState.QUEUED).limit(1)) \
            is not None
    stop = placements_to_stop(session, node.id, msg.running_placement_ids)
    pause = placements_to_pause(session, node.id, msg.running_placement_ids)
    session.flush()
    return HeartbeatResponse(node_id=node.id, state=NodeState.UP.value, cancelled_placement_ids=stop,
                             pause_placement_ids=pause), came_back


def _executor_room(reports: list | None) -> dict[tuple[str, str], int]:
    """(key, GPUs) -> free rows of reported executors (a malformed entry counts as none)."""
    room = {}
    for r in reports or []:
        if isinstance(r, dict) and isinstance(r.get("free_rows"), int):
            room[str(r.get("key")), str(sorted(r.get("gpu_indices") or []))] = r["free_rows"]
    return room


def placements_to_pause(session: Session, node_id: str, reported: Iterable[str]) -> list[str]:
    """Of the placements a node says it runs, the live ones of this node the service asked to
    checkpoint and stop (service.pausing.request_pause: pause or preemption)."""
    reported = set(reported)
    if not reported:
        return []
    return sorted(session.scalars(select(Placement.id).where(
        Placement.id.in_(reported), Placement.node_id == node_id,
        Placement.state.in_(PLACEMENT_ACTIVE), Placement.stop_requested.is_not(None))))


def placements_to_stop(session: Session, node_id: str, reported: Iterable[str]) -> list[str]:
    """Of the placements a node says it runs, those that are not the current live placement of
    their task on this node: superseded, failed, finished, cancelled, of a task that is over,
    of another node, or unknown. The service refuses every report of these (fencing), so the
    node may stop them; a task's current attempt is never among them."""
    reported = set(reported)
    if not reported:
        return []
    rows = session.execute(
        select(Placement.id, Placement.task_id, Placement.node_id, Placement.state, Task.state)
        .join(Task, Task.id == Placement.task_id).where(Placement.id.in_(reported))).all()
    live = {pid: task_id for pid, task_id, on, p_state, t_state in rows
            if on == node_id and p_state in PLACEMENT_ACTIVE and t_state not in TASK_TERMINAL}
    current: dict[str, str] = {}
    if live:  # one live placement per task; were there two, only the newest is current
        for pid, task_id in session.execute(
                select(Placement.id, Placement.task_id)
                .where(Placement.task_id.in_(set(live.values())),
                       Placement.state.in_(PLACEMENT_ACTIVE))
                .order_by(Placement.created_at.desc(), Placement.id.desc())):
            current.setdefault(task_id, pid)
    return sorted(pid for pid in reported if current.get(live.get(pid, "")) != pid)


class ServiceHealth:
    """This process's own view of its database, fed by every maintenance pass: since when it has
    reached it without a break. While the database is down the service answers heartbeats with
    errors, which says nothing about the nodes; so a node's silence only counts from the later of
    its last heartbeat and healthy_since. healthy_since starts when the process starts watching
    (an API that was down, or a newly elected leader, gives every node a full timeout) and moves
    on at each recovery: a failed pass followed by a good one, or a good one after a break longer
    than max_gap_s (a loop that was stopped: a deposed leader, a paused process)."""

    def __init__(self, max_gap_s: float, clock: Callable[[], datetime] = utcnow) -> None:
        self.max_gap_s = max_gap_s
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        self.healthy_since: datetime = now
        self.down_since: datetime | None = None
        self.last_ok_at: datetime = now

    @classmethod
    def for_settings(cls, settings: Settings) -> ServiceHealth:
        # A break of G seconds unseen makes a node look silent for G + its heartbeat interval
        # (node_timeout_s / 3), so any break over node_timeout_s / 3 counts as an outage; the
        # passes themselves are maintenance_interval_s apart.
        return cls(max_gap_s=max(settings.node_timeout_s / 3,
                                 1.5 * settings.maintenance_interval_s + 1.0))

    def ok(self) -> None:
        """The database answered just now."""
        now = self._clock()
        with self._lock:
            gap = (now - self.last_ok_at).total_seconds()
            if self.down_since is not None or gap > self.max_gap_s:
                log.warning("service healthy again after_s=%.1f cause=%s: node silence counts "
                            "from now", (now - (self.down_since or self.last_ok_at)).total_seconds(),
                            "database_down" if self.down_since is not None else "no_pass")
                self.healthy_since = now
            self.down_since, self.last_ok_at = None, now

    def failed(self, error: object) -> None:
        """The database could not be reached just now."""
        with self._lock:
            if self.down_since is None:
                self.down_since = self._clock()
                first = str(error).splitlines()[0] if str(error) else type(error).__name__
                log.warning("service unhealthy: database unreachable error=%s", first)

    def check(self, session: Session) -> datetime:
        """Probe the database on this session and return the moment from which node silence
        counts now; a failed probe is recorded and raised."""
        try:
            session.execute(text("SELECT 1"))
        except DBAPIError as exc:
            self.failed(exc)
            raise
        self.ok()
        with self._lock:
            return self.healthy_since


_HEALTH: dict[str, ServiceHealth] = {}
_HEALTH_LOCK = threading.Lock()


def watch_service_health(settings: Settings) -> ServiceHealth:
    """Start this process's health record of settings' database: an API process that may run
    the maintenance loop does so when it starts, so nodes silent while it was down are not
    counted dead. From then on mark_stale_nodes uses it by default."""
    with _HEALTH_LOCK:
        health = _HEALTH[settings.database_url] = ServiceHealth.for_settings(settings)
        return health


def service_health(settings: Settings) -> ServiceHealth | None:
    """This process's health record of settings' database, if it keeps one."""
    with _HEALTH_LOCK:
        return _HEALTH.get(settings.database_url)


def mark_stale_nodes(session: Session, settings: Settings | None = None,
                     health: ServiceHealth | None = None) -> list[str]:
    """Mark down every up node silent for node_timeout_s while the service was healthy; fail
    what ran there and requeue it. With a health record (default: this process's, see
    watch_service_health) each call probes the database and silence counts from max(last
    heartbeat, healthy_since); without one, from the last heartbeat. Returns the ids of the
    nodes marked down (the maintenance loop calls this periodically)."""
    settings = settings or get_settings()
    health = health or service_health(settings)
    cutoff = utcnow() - timedelta(seconds=settings.node_timeout_s)
    if health is not None and health.check(session) > cutoff:
        return []  # no node can have been silent that long while the service was healthy
    stale = session.scalars(select(Node).where(
        Node.state == NodeState.UP,
        (Node.last_heartbeat_at < cutoff) | Node.last_heartbeat_at.is_(None)).with_for_update(
        skip_locked=True)).all()
    if not stale:
        return []
    for node in stale:
        lifecycle.node_down(node)
        log.warning("node down node=%s name=%s", node.id, node.name)
        lost = session.scalars(select(Placement).where(
            Placement.node_id == node.id,
            Placement.state.in_(PLACEMENT_CURRENT))).all()
        for placement in lost:
            # Lock order everywhere: task first, then its placements (as cancel does).
            task = session.scalar(select(Task).where(Task.id == placement.task_id)
                                  .with_for_update())
            session.refresh(placement)
            if placement.state not in PLACEMENT_CURRENT:
                continue
            if placement.state in PLACEMENT_WAITING:
                lifecycle.supersede_placement(placement)
                unqueue_placement(placement.id, node.id, settings)
            else:
                lifecycle.fail_placement(placement, f"node {node.name} went down", utcnow())
                if task is not None:
                    attempt_lost(session, task, placement, settings, "its node went down",
                                 "its node went down while it stopped")
    session.commit()
    cluster_changed(session, "node_down", settings)
    return [n.id for n in stale]


def attempt_lost(session: Session, task: Task, placement: Placement, settings: Settings,
                 error: str, stopping_reason: str) -> None:
    """The task's live attempt is gone with its node (failed by the caller): a running task is
    retried or failed (fail_or_requeue), one that was pausing ends paused, holding nothing."""
    if task.state == TaskState.RUNNING:
        fail_or_requeue(session, task, placement, error, settings)
    elif task.state == TaskState.PAUSING:
        finish_pause(session, task, stopping_reason)


def fail_or_requeue(session: Session, task: Task, placement: Placement, error: str,
                    settings: Settings) -> None:
    """Retry the task from its latest checkpoint while attempts remain, else fail it."""
    if placement.attempt < settings.max_attempts:
        requeue_task(session, task, f"attempt {placement.attempt} failed: {error}")
        return
    from service.tasks import finish_task_failed

    finish_task_failed(session, task, error)


def cluster_view(session: Session, settings: Settings | None = None) -> ClusterOut:
    """GET /v1/cluster: nodes, the plan (flat and per GPU, with tenant and priority), each
    tenant's usage against its limits, and what the last replan of this process decided."""
    nodes = session.scalars(select(Node).order_by(Node.name)).all()
    rows = session.execute(
        select(Placement, Task.tenant_id, Task.priority).join(Task, Task.id == Placement.task_id)
        .where(Placement.state.in_(PLACEMENT_CURRENT))
        .order_by(Placement.planned_start, Placement.id)).all()
    plan = [PlacementOut.model_validate(p, from_attributes=True).model_copy(
        update={"tenant_id": tenant_id, "priority": priority}) for p, tenant_id, priority in rows]
    counts = dict(session.execute(select(Task.state, func.count()).where(
        Task.state.in_((TaskState.QUEUED, TaskState.RUNNING))).group_by(Task.state)).all())
    return ClusterOut(
        nodes=[NodeOut.model_validate(n, from_attributes=True) for n in nodes],
        gpus_total=sum(n.gpu_count for n in nodes),
        gpus_up=sum(n.gpu_count for n in nodes if n.state == NodeState.UP),
        plan=plan, gpus=_per_gpu(nodes, plan),
        tenants=tenant_usage(session, settings or get_settings()),
        queued_tasks=counts.get(TaskState.QUEUED, 0), running_tasks=counts.get(TaskState.RUNNING, 0),
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
