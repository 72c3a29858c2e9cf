"""The planner's instance read from Postgres (service.scheduler.loop plans on it, the dry run
estimates from its pieces): unfinished tasks with their work, measured rates, priorities, bounded
waits and pinned placements; nodes; tenants' quotas and fair-share history; per model its shape,
measured throughputs and the correction of its estimates."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.states import NodeState, PlacementState, TaskState
from service.core.config import Settings
from service.core.registry import ModelRegistry
from service.models import (
    PLACEMENT_ACTIVE,
    File,
    Job,
    Node,
    Placement,
    Task,
    Tenant,
    ThroughputProfile,
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
from service.scheduler.planner import FAIR_HISTORY, tenant_history
from service.scheduler.problem import Hint, Instance, NodeSpec, Pinned, TaskSpec

DEFAULT_MAX_WAIT_S = 4 * 3600


def knob(settings: Settings, name: str, default: float) -> Any:
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
    max_wait = int(knob(settings, "scheduler_max_wait_s", DEFAULT_MAX_WAIT_S))
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
