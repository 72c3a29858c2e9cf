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

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from contract.protocol import colocation_key
from contract.states import PLACEMENT_CURRENT, NodeState, PlacementState, TaskState
from service import lifecycle
from service.core.config import Settings
from service.core.registry import ModelRegistry
from service.models import (
    JOB_TERMINAL,
    PLACEMENT_ACTIVE,
    File,
    Job,
    Node,
    Placement,
    Task,
    Tenant,
    ThroughputProfile,
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
from service.scheduler.estimator import (
    CORRECTION_SAMPLES,
    Estimator,
    EstimatorConfig,
    JobProgress,
    ModelShape,
    Profile,
    TaskWork,
    correction_factor,
    gpu_spec,
)
from service.scheduler.limits import task_priority_ceiling
from service.scheduler.planner import FAIR_HISTORY, SolveOptions, solve, tenant_history
from service.scheduler.problem import Hint, Instance, NodeSpec, Pinned, Plan, TaskSpec

log = logging.getLogger("loraplex.scheduler")

PLAN_LOCK_KEY = 0x4C4F5241  # pg advisory lock: one replan at a time across API replicas
DEFAULT_MAX_WAIT_S = 4 * 3600
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


def _knob(settings: Settings, name: str, default: float) -> Any:
    # Optional Settings fields (scheduler_*); the defaults apply until the config has them.
    return getattr(settings, name, None) or default


def model_shape(registry: ModelRegistry, name: str) -> tuple[ModelShape, int]:
    entry = registry.get(name)
    if entry is None:
        return ModelShape.guess(8_000_000_000), 1
    config_path = Path(entry.path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
        return ModelShape.from_config(entry.parameters, config), entry.gpus
    except (OSError, ValueError):
        return ModelShape.guess(entry.parameters or 8_000_000_000), entry.gpus


def _work(task: Task, jobs: Iterable[Job], file: File | None) -> TaskWork:
    cfg = task.task_settings()
    avg_tokens = float(cfg.max_seq_len)
    if file is not None and file.line_count:
        avg_tokens = min(avg_tokens, file.bytes / file.line_count / EstimatorConfig().bytes_per_token)
    samples = task.num_train_samples or (file.line_count if file else 1)
    return TaskWork(
        task.base_model, max(1, samples), max(1, cfg.epochs), max(1.0, avg_tokens),
        cfg.max_seq_len,
        [JobProgress(int((j.config or {}).get("batch_size", 1)), j.last_step or 0, j.state)
         for j in jobs],
        early_exit=cfg.early_exit.enabled, warmup_fraction=cfg.early_exit.warmup_fraction,
        keep_fraction=cfg.early_exit.keep_fraction)


def _measured_rate(work: TaskWork, since: datetime | None, now: datetime) -> float | None:
    """Tokens/s of a running task from its jobs' steps since the placement was claimed."""
    if since is None:
        return None
    elapsed = (now - since).total_seconds()
    done = sum(j.last_step * j.batch_size * work.avg_tokens_per_sample for j in work.jobs)
    return done / elapsed if elapsed >= 60 and done > 0 else None


def build_instance(session: Session, settings: Settings, now: datetime
                   ) -> tuple[Instance, dict[str, list[Placement]], dict[tuple[str, str], int]]:
    """The planner's instance from Postgres, each task's planned|active placement rows, and each
    queued task's raw (uncorrected) estimate in seconds per GPU type (recorded at publish)."""
    nodes = session.scalars(select(Node).order_by(Node.name)).all()
    tasks = session.scalars(select(Task).where(Task.state.in_((TaskState.QUEUED, TaskState.RUNNING)))
                            .order_by(Task.created_at, Task.id)).all()
    ids = [t.id for t in tasks]
    jobs: dict[str, list[Job]] = {}
    for j in session.scalars(select(Job).where(Job.task_id.in_(ids))):
        jobs.setdefault(j.task_id, []).append(j)
    rows: dict[str, list[Placement]] = {}
    for p in session.scalars(select(Placement).where(Placement.task_id.in_(ids))
                             .order_by(Placement.created_at)):
        rows.setdefault(p.task_id, []).append(p)
    files = {f.id: f for f in session.scalars(
        select(File).where(File.id.in_({t.training_file_id for t in tasks})))}
    tenants = {t.id: t for t in session.scalars(
        select(Tenant).where(Tenant.id.in_({t.tenant_id for t in tasks})))}
    limits = {k: t.max_gpus for k, t in tenants.items() if t.max_gpus is not None}
    guaranteed = {k: t.guaranteed_gpus for k, t in tenants.items() if t.guaranteed_gpus}
    registry = ModelRegistry(settings.models_file)
    shapes, minimum = {}, {}
    for name in {t.base_model for t in tasks}:
        shapes[name], minimum[name] = model_shape(registry, name)
    est = Estimator(shapes, measured_profiles(session, shapes), corrections=_corrections(session, shapes))
    gpu_types = {n.gpu_type: gpu_spec(n.gpu_type, n.gpu_memory_bytes or None,
                                      gpu_tflops(n.meta)) for n in nodes}
    max_wait = int(_knob(settings, "scheduler_max_wait_s", DEFAULT_MAX_WAIT_S))
    specs = []
    raw: dict[tuple[str, str], int] = {}
    for task in tasks:
        work = _work(task, jobs.get(task.id, []), files.get(task.training_file_id))
        mine = rows.get(task.id, [])
        active = next((p for p in reversed(mine) if p.state in PLACEMENT_ACTIVE), None)
        since = active.claimed_at if active is not None else None
        rate = _measured_rate(work, since, now)
        full = {gt: est.estimate_with_raw(work, gt, spec, minimum[task.base_model], rate)
                for gt, spec in gpu_types.items()}
        by_type = {gt: (e.gpus, e.seconds) for gt, e in full.items()}
        g, d = next(iter(by_type.values()), (minimum[task.base_model], 3600))
        tenant = tenants.get(task.tenant_id)
        ceiling = (task_priority_ceiling(tenant, settings) if tenant is not None
                   else task.priority)
        arrival = int((task.created_at - now).total_seconds())
        common = dict(id=task.id, tenant=task.tenant_id, gpus_needed=g, duration_s=d,
                      priority=min(task.priority, ceiling), by_gpu_type=by_type,
                      tenant_priority=tenant.priority if tenant is not None else 0,
                      arrival_s=min(0, arrival))
        if active is not None:
            node_type = next((n.gpu_type for n in nodes if n.id == active.node_id), None)
            start = active.claimed_at or active.published_at or active.planned_start
            started = int((start - now).total_seconds())
            if node_type in by_type:  # remaining time of the running task
                common["duration_s"] = by_type[node_type][1]
            common["gpus_needed"] = len(active.gpu_indices)
            common["by_gpu_type"] = {}
            specs.append(TaskSpec(**common, state=TaskState.RUNNING.value, pinned=Pinned(
                active.node_id, tuple(active.gpu_indices), min(0, started)),
                preemptible=active.stop_requested is None))
            continue
        for gt, e in full.items():
            raw[task.id, gt] = e.raw_seconds
        planned = next((p for p in reversed(mine) if p.state == PlacementState.PLANNED), None)
        hint = max_start = None
        if planned is not None:
            hint = Hint(planned.node_id, max(0, int((planned.planned_start - now).total_seconds())),
                        tuple(planned.gpu_indices))
        max_start = min(0, arrival) + max_wait
        specs.append(TaskSpec(**common, hint=hint, max_start_s=max_start))
    node_specs = [NodeSpec(n.id, n.gpu_type, n.gpu_count, up=n.state == NodeState.UP) for n in nodes]
    history = _fair_history(session, tenants)
    return Instance(node_specs, specs, limits, guaranteed, history), rows, raw


def _fair_history(session: Session, tenants: Iterable[str]) -> dict[str, tuple[float, int]]:
    """Each tenant's fair-share memory (planner.tenant_history): the slowdowns (submitted to
    finished over the measured run of the attempt that ended it) of its latest finished tasks."""
    rows = []
    for tenant in sorted(tenants):
        rows += [(tenant, finished.timestamp(),
                  (finished - created).total_seconds() / max(60.0, run))
                 for created, finished, run in session.execute(
                     select(Task.created_at, Task.finished_at, Placement.run_s)
                     .join(Placement, Placement.task_id == Task.id)
                     .where(Task.tenant_id == tenant, Task.finished_at.is_not(None),
                            Placement.state == PlacementState.FINISHED,
                            Placement.run_s.is_not(None))
                     .order_by(Task.finished_at.desc(), Task.id).limit(FAIR_HISTORY))]
    return tenant_history(rows)


def _corrections(session: Session, models: Iterable[str]) -> dict[str, float]:
    """Per model, the correction factor of its raw estimates from its latest finished placements
    (raw estimate at publish vs measured run: estimator.correction_factor)."""
    pairs: dict[str, list[tuple[float, float]]] = {}
    for model, est, run in session.execute(
            select(Task.base_model, Placement.estimated_s, Placement.run_s)
            .join(Task, Task.id == Placement.task_id)
            .where(Task.base_model.in_(list(models)), Placement.state == PlacementState.FINISHED,
                   Placement.estimated_s.is_not(None), Placement.run_s.is_not(None))
            .order_by(Placement.finished_at.desc(), Placement.id)
            .limit(CORRECTION_SAMPLES * 20)):
        got = pairs.setdefault(model, [])
        if len(got) < CORRECTION_SAMPLES:
            got.append((float(est), float(run)))
    return {model: correction_factor(p) for model, p in pairs.items()}


def measured_profiles(session: Session, models: Iterable[str]
              ) -> dict[tuple[str, str, int, str], list[Profile]]:
    """The measured throughputs (service.profiles) of these models, keyed as the Estimator
    looks them up; one measurement per GPU count it was taken on."""
    out: dict[tuple[str, str, int, str], list[Profile]] = {}
    for p in session.scalars(select(ThroughputProfile).where(
            ThroughputProfile.base_model.in_(list(models)))):
        out.setdefault((p.base_model, p.gpu_type, p.seq_len, p.batch_key), []).append(
            Profile(p.tokens_per_s, p.gpus))
    return out


def gpu_tflops(meta: dict | None) -> float | None:
    value = (meta or {}).get("matmul_tflops")
    return float(value) * 1e12 if isinstance(value, int | float) and value > 0 else None


def _attempt(rows: list[Placement]) -> int:
    return 1 + sum(p.state == PlacementState.FAILED for p in rows)


def solve_options(settings: Settings) -> SolveOptions:
    """The planner's options from the service settings (the bench uses the same)."""
    return SolveOptions(
        unit_s=int(_knob(settings, "scheduler_unit_s", DEFAULT_UNIT_S)),
        work_limit=float(_knob(settings, "scheduler_work_limit", DEFAULT_WORK_LIMIT)),
        time_limit_s=float(_knob(settings, "scheduler_time_limit_s", DEFAULT_TIME_LIMIT_S)),
        fairness=float(getattr(settings, "scheduler_fairness", 0.25)),
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
    unit = int(_knob(settings, "scheduler_unit_s", DEFAULT_UNIT_S))
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
