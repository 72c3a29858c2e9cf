"""replan(): load unfinished tasks and nodes from Postgres, estimate, solve with the CP-SAT planner,
write the plan as ``planned`` placement rows and publish those that start now on free GPUs.

Called on task arrival, cancel, completion/failure and node join/leave through
service.cluster.cluster_changed (by the app's background replanner thread, or inline in sync mode),
and by the replanner's periodic pass; it flushes but never commits (the caller does). Rules:
- a task with a published|claimed|running placement is pinned there (never moved);
- a queued task's old ``planned`` row is kept when the new plan agrees with it, else superseded;
- bounded waiting counts from the task's arrival (created_at): ``scheduler_max_wait_s``, soft and
  per task (planner.py);
- priorities: the tenant's operator-set priority, and the task's own clamped to the tenant's
  ceiling (``max_task_priority``, else ``scheduler_default_task_priority_ceiling``);
- quotas: ``max_gpus`` is a hard cap, ``guaranteed_gpus`` a share lent out while idle; the running
  tasks the plan preempts to reclaim it are asked to pause at a checkpoint and requeue
  (service.pausing.request_pause); their GPUs go to the owner at the replan after they stop;
- estimate error fed back: a published placement records the raw estimate (estimated_s), the
  finish report the run (run_s); each model's later estimates are corrected by their ratio
  (estimator.correction_factor; bounded, per model);
- co-location (service.scheduler.colocation): the planner sees each shared executor's GPUs once,
  held until its last hosted task ends; after solving, a task the plan starts now moves onto a
  warm idle executor of its key (no model load), and queued tasks the plan does not start now
  join busy shared executors that nodes' fresh heartbeats report (same colocation_key, one GPU,
  free rows for their smallest job), published at once on the executor's GPUs;
- time is discretised to ``unit_s`` seconds (default 60); durations are rounded up; the solver
  has a deterministic work limit (``scheduler_work_limit``): the same state gives the same plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from contract.protocol import colocation_key
from contract.states import PLACEMENT_CURRENT, NodeState, PlacementState, TaskState
from service import lifecycle
from service.core.config import Settings
from service.models import (
    JOB_TERMINAL,
    PLACEMENT_ACTIVE,
    Job,
    Node,
    Placement,
    Task,
    utcnow,
)
from service.queue import publish_placement
from service.scheduler.colocation import (
    Colocated,
    CoState,
    Join,
    JoinCandidate,
    LivePlacement,
    NodeReports,
    colocate_instance,
    demand,
    fresh_executors,
    prefer_warm,
    task_shares,
    tenant_usage,
    usable_executors,
)
from service.scheduler.planner import SolveOptions, solve
from service.scheduler.problem import Instance, Plan
from service.scheduler.snapshot import build_instance, knob

log = logging.getLogger("loraplex.scheduler")

PLAN_LOCK_KEY = 0x4C4F5241  # pg advisory lock: one replan at a time across API replicas
DEFAULT_UNIT_S = 60
DEFAULT_TIME_LIMIT_S = 10.0
DEFAULT_WORK_LIMIT = 0.1


@dataclass
class PlanInfo:
    """What the last replan of this process decided (for GET /v1/cluster)."""

    at: datetime | None = None
    status: str = "none"
    makespan_s: int = 0
    gap: float = 0.0
    solve_time_s: float = 0.0
    relaxed_waiting: bool = False
    unschedulable: dict[str, str] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)  # what triggered it (set by the caller)


_last = PlanInfo()


def last_plan_info() -> PlanInfo:
    return _last


def set_last_plan_info(info: PlanInfo) -> None:
    """Adopt the leader's last plan: an API process that does not lead never replans
    (service.api.background), yet its GET /v1/cluster shows the plan in force."""
    global _last
    _last = info


def _attempt(rows: list[Placement]) -> int:
    return 1 + sum(p.state == PlacementState.FAILED for p in rows)


def solve_options(settings: Settings) -> SolveOptions:
    """The planner's options from the service settings (the bench uses the same)."""
    return SolveOptions(
        unit_s=int(knob(settings, "scheduler_unit_s", DEFAULT_UNIT_S)),
        work_limit=float(knob(settings, "scheduler_work_limit", DEFAULT_WORK_LIMIT)),
        time_limit_s=float(knob(settings, "scheduler_time_limit_s", DEFAULT_TIME_LIMIT_S)),
        fairness=float(settings.scheduler_fairness),
        tail=float(getattr(settings, "scheduler_tail", 0.0)))


def _preempt(session: Session, plan: Plan, settings: Settings, colocated: Colocated) -> None:
    """Ask the running tasks the plan preempts (quota reclaim) to pause at a checkpoint and
    requeue (a shared executor's occupant: every task it hosts); a task that ended meanwhile is
    left alone."""
    from service.core.errors import ApiError
    from service.pausing import request_pause

    for task_id in colocated.pausing(plan):
        task = session.scalar(select(Task).where(Task.id == task_id).with_for_update())
        if task is None or task.state != TaskState.RUNNING:
            continue
        try:
            request_pause(session, task, requeue=True, settings=settings,
                          reason="its GPUs are reclaimed for a tenant's guaranteed share")
        except ApiError:
            continue
        log.info("quota reclaim: preempting task=%s", task_id)


def replan(session: Session, settings: Settings) -> Plan:
    """Replan every unfinished task; write planned rows and publish what starts now."""
    global _last
    session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PLAN_LOCK_KEY})
    now = utcnow()
    unit = int(knob(settings, "scheduler_unit_s", DEFAULT_UNIT_S))
    inst, rows, raw = build_instance(session, settings, now)
    gpu_type = {n.id: n.gpu_type for n in inst.nodes}
    co = colocation(session, settings, inst, now)
    plan = solve(co.colocated.instance, solve_options(settings))
    for task_id, a in prefer_warm(plan, co.idle, co.keys, gpu_type).items():
        log.info("task starts on a warm idle executor task=%s node=%s gpus=%s", task_id,
                 a.node_id, ",".join(map(str, a.gpu_indices)))
    # Free GPUs first: only tasks the plan does not start now may join a busy shared executor.
    joins = co.joins(inst, plan)
    _preempt(session, plan, settings, co.colocated)
    # Off the request path a cancel or completion can commit while the solver runs: lock the
    # waiting tasks (task before placements, the order cancel uses) and plan only those still
    # queued, so nothing is published for a task that has just ended.
    waiting = [t.id for t in inst.tasks if t.pinned is None]
    still_queued = set(session.scalars(select(Task.id).where(
        Task.id.in_(waiting), Task.state == TaskState.QUEUED).order_by(Task.id).with_for_update()))
    busy: dict[str, set[int]] = {}
    for p in session.scalars(select(Placement).where(Placement.state.in_(PLACEMENT_ACTIVE))):
        busy.setdefault(p.node_id, set()).update(p.gpu_indices)
    joined = publish_joins(session, settings, [j for j in joins if j.task_id in still_queued],
                           rows, now)
    published, joined_ids = joined, {j.task_id for j in joins}
    for spec in co.colocated.instance.tasks:
        if spec.pinned is not None or spec.id not in still_queued or spec.id in joined_ids:
            continue
        mine = rows.get(spec.id, [])
        old = [p for p in mine if p.state == PlacementState.PLANNED]
        a = plan.assignments.get(spec.id)
        if a is None:
            for p in old:
                lifecycle.supersede_placement(p)
            log.warning("task unschedulable task=%s reason=%s", spec.id,
                        plan.unschedulable.get(spec.id))
            continue
        start = now + timedelta(seconds=a.start_s)
        end = now + timedelta(seconds=a.end_s)
        keep = next((p for p in old if p.node_id == a.node_id
                     and tuple(p.gpu_indices) == a.gpu_indices
                     and abs((p.planned_start - start).total_seconds()) < unit), None)
        for p in old:
            if p is not keep:
                lifecycle.supersede_placement(p)
        if keep is None:
            keep = Placement(task_id=spec.id, node_id=a.node_id, gpu_indices=list(a.gpu_indices),
                             state=PlacementState.PLANNED.value,
                             planned_start=start, planned_end=end, attempt=_attempt(mine))
            session.add(keep)
        else:
            keep.planned_end = end
        if a.start_s == 0 and not busy.get(a.node_id, set()) & set(a.gpu_indices):
            keep.planned_start = now
            keep.estimated_s = raw.get((spec.id, gpu_type.get(a.node_id, "")))
            session.flush()
            publish_placement(session, keep, settings)
            busy.setdefault(a.node_id, set()).update(a.gpu_indices)
            published += 1
    session.flush()
    _last = PlanInfo(now, plan.status, plan.makespan_s, plan.gap, plan.solve_time_s,
                     plan.relaxed_waiting, dict(plan.unschedulable))
    log.info("replan status=%s tasks=%d published=%d joined=%d shared_executors=%d "
             "makespan_s=%d gap=%.3f solve_s=%.2f unschedulable=%d relaxed_waiting=%s",
             plan.status, len(inst.tasks), published, joined, len(co.colocated.occupants),
             plan.makespan_s, plan.gap, plan.solve_time_s, len(plan.unschedulable),
             plan.relaxed_waiting)
    return plan


def colocation(session: Session, settings: Settings, inst: Instance, now: datetime) -> CoState:
    """Co-location (service.scheduler.colocation): the instance the planner solves (each shared
    executor's GPUs once) and the usable warm executors, busy and idle, with what joining needs."""
    nodes = [NodeReports(n.id, n.gpu_type, n.gpu_count, n.state == NodeState.UP, n.executors,
                         n.executors_at)
             for n in session.scalars(select(Node).where(Node.executors_at.is_not(None))
                                      .order_by(Node.name))]
    executors = fresh_executors(nodes, now, settings.node_timeout_s)
    if not executors and not _shares_gpus(inst):
        return CoState(colocate_instance(inst))
    live, keys, sizes = _live_placements(session, inst)
    state = CoState(colocate_instance(inst, tenant_usage(live), task_shares(live)), live=live,
                    keys=keys)
    ends = {t.id: t.duration_s for t in inst.tasks if t.pinned is not None}
    for ex in usable_executors(executors, live, ends):
        (state.idle if ex.idle else state.busy).append(ex)
    for t in inst.tasks:
        if t.pinned is None and t.id in keys:
            low, total = demand(sizes.get(t.id, []))
            if total:
                state.candidates[t.id] = JoinCandidate(t.id, keys[t.id], low, total)
    return state


def _shares_gpus(inst: Instance) -> bool:
    seen: set[tuple[str, int]] = set()
    for t in inst.tasks:
        if t.pinned is not None:
            spots = {(t.pinned.node_id, g) for g in t.pinned.gpu_indices}
            if spots & seen:
                return True
            seen |= spots
    return False


def _live_placements(session: Session, inst: Instance
                     ) -> tuple[list[LivePlacement], dict[str, str], dict[str, list[int]]]:
    """Every live placement (its task's tenant, colocation key and rows), each unfinished task's
    key, and the batch sizes of its unfinished jobs."""
    rows = session.execute(
        select(Placement.id, Placement.node_id, Placement.gpu_indices, Placement.stop_requested,
               Task)
        .join(Task, Task.id == Placement.task_id)
        .where(Placement.state.in_(PLACEMENT_ACTIVE)).order_by(Placement.id)).all()
    tasks = {t.id: t for *_, t in rows}
    want = {t.id for t in inst.tasks} - set(tasks)
    if want:
        tasks.update({t.id: t for t in session.scalars(select(Task).where(Task.id.in_(want)))})
    keys = {tid: colocation_key(t.base_model, t.method, t.settings["max_seq_len"],
                                t.settings["target_modules"]) for tid, t in tasks.items()}
    sizes: dict[str, list[int]] = {}
    for task_id, config in session.execute(
            select(Job.task_id, Job.config).where(Job.task_id.in_(list(tasks)),
                                                  Job.state.not_in(JOB_TERMINAL))
            .order_by(Job.task_id, Job.index)):
        sizes.setdefault(task_id, []).append(int((config or {}).get("batch_size", 1)))
    live = [LivePlacement(pid, t.id, t.tenant_id, keys[t.id], node_id, tuple(sorted(gpus)),
                          demand(sizes.get(t.id, []))[1], stopping is not None)
            for pid, node_id, gpus, stopping, t in rows]
    return live, keys, sizes


def publish_joins(session: Session, settings: Settings, joins: list[Join],
                  rows: dict[str, list[Placement]], now: datetime) -> int:
    """Publish a placement for each join on its executor's node and GPUs (the daemon attaches
    it to the running executor); the task's older planned rows are superseded. A co-located
    run records no raw estimate: its time depends on its neighbours, so it is not fed back."""
    for j in joins:
        mine = rows.get(j.task_id, [])
        for p in mine:
            if p.state == PlacementState.PLANNED:
                lifecycle.supersede_placement(p)
        keep = Placement(task_id=j.task_id, node_id=j.executor.node_id,
                         state=PlacementState.PLANNED.value,
                         gpu_indices=list(j.executor.gpus), planned_start=now,
                         planned_end=now + timedelta(seconds=j.duration_s), attempt=_attempt(mine))
        session.add(keep)
        session.flush()
        publish_placement(session, keep, settings)
        log.info("task joins a shared executor task=%s node=%s gpus=%s key=%s rows=%d "
                 "share=%.3f", j.task_id, j.executor.node_id,
                 ",".join(map(str, j.executor.gpus)), j.executor.key, j.rows, j.share)
    return len(joins)


def current_plan(session: Session) -> list[Placement]:
    """The plan as stored: planned and active placements, by planned start."""
    return list(session.scalars(select(Placement).where(
        Placement.state.in_(PLACEMENT_CURRENT)).order_by(Placement.planned_start)))
