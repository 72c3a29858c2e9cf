"""Validate, estimate, then start: what POST /v1/tasks?dry_run=true (and the fine-tuning
equivalent) answers. Everything a create checks is checked; nothing is written.

The estimate uses the scheduler's own duration model (service.scheduler.estimator, read only):
tokens to train / throughput (measured profiles, else analytic) per GPU type of the nodes that
are up, and the GPU count from the memory model. The start is the earliest moment the plan in
force leaves that many GPUs of one node free (each GPU is busy until the planned end of its
live and planned placements); queued tasks the plan has not placed yet are not counted, so the
start is a lower bound when the queue is long."""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Literal

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.states import PLACEMENT_CURRENT, TASK_SCHEDULED, NodeState
from service.core.config import Settings
from service.core.registry import ModelRegistry
from service.core.storage import Storage
from service.models import File, Node, Placement, Task, Tenant, utcnow
from service.scheduler.estimator import (
    Estimator,
    JobProgress,
    TaskWork,
    gpu_spec,
    remaining_tokens,
)
from service.scheduler.snapshot import gpu_tflops, measured_profiles, model_shape
from service.schemas import TaskCreate
from service.tasks import check_request, expand_grid, resolve_adapter, resolve_auto
from service.usage import tokens_per_record


class DryRunJob(BaseModel):
    index: int
    hyperparameters: dict


class DryRunOut(BaseModel):
    """What a task would be: validated, nothing created."""

    dry_run: Literal[True] = True
    object: Literal["task.estimate"] = "task.estimate"
    base_model: str
    method: str
    num_jobs: int
    jobs: list[DryRunJob]
    train_samples: int = Field(description="Training records per epoch (validation held out).")
    epochs: int
    trained_tokens: int = Field(description="Tokens to train if every job runs all its steps.")
    expected_tokens: int = Field(description="Tokens expected with early exit as configured.")
    gpus: int | None = Field(description="GPUs per placement (null: no node can run it).")
    gpu_type: str | None = None
    estimated_seconds: int | None = None
    estimated_gpu_hours: float | None = None
    estimated_start: int | None = Field(description="Unix seconds, from the current plan.")
    estimated_finish: int | None = None


def dry_run(session: Session, tenant: Tenant, body: TaskCreate, settings: Settings,
            registry: ModelRegistry, storage: Storage | None = None) -> DryRunOut:
    """The task `body` would create (its jobs) and its estimate; 4xx as a create would."""
    body = resolve_adapter(session, storage, tenant, resolve_auto(body, registry), registry)
    max_seq_len, samples = check_request(session, tenant, body, settings, registry)
    space = body.search_space.model_dump(mode="json")
    configs = expand_grid(space, body.method)  # the method's knobs alone (contract.methods)
    train = session.get(File, body.training_file)
    per_sample = tokens_per_record(max_seq_len, train and train.bytes, train and train.line_count,
                                   body.method)
    work = TaskWork(body.base_model, max(1, samples), body.epochs, per_sample, max_seq_len,
                    [JobProgress(int(c["batch_size"])) for c in configs],
                    early_exit=body.early_exit.enabled,
                    warmup_fraction=body.early_exit.warmup_fraction,
                    keep_fraction=body.early_exit.keep_fraction)
    full = sum(work.steps(j) * j.batch_size * per_sample for j in work.jobs)
    out = DryRunOut(base_model=body.base_model, method=body.method, num_jobs=len(configs),
                    jobs=[DryRunJob(index=i, hyperparameters=c) for i, c in enumerate(configs)],
                    train_samples=samples, epochs=body.epochs, trained_tokens=int(full),
                    expected_tokens=0, gpus=None, estimated_start=None)
    shape, minimum = model_shape(registry, body.base_model)
    est = Estimator({body.base_model: shape}, measured_profiles(session, [body.base_model]))
    out.expected_tokens = int(remaining_tokens(work))
    best = _earliest(session, est, work, minimum)
    if best is None:
        return out
    gpus, seconds, gpu_type, start = best
    out.gpus, out.gpu_type, out.estimated_seconds = gpus, gpu_type, seconds
    out.estimated_gpu_hours = round(gpus * seconds / 3600, 6)
    out.estimated_start = int(start.timestamp())
    out.estimated_finish = int((start + timedelta(seconds=seconds)).timestamp())
    return out


def _earliest(session: Session, est: Estimator, work: TaskWork, minimum: int
              ) -> tuple[int, int, str, datetime] | None:
    """(gpus, seconds, gpu type, start) of the node that would finish the task first."""
    now = utcnow()
    nodes = session.scalars(select(Node).where(Node.state == NodeState.UP).order_by(Node.name)).all()
    free: dict[tuple[str, int], datetime] = {}
    for p in session.scalars(select(Placement).join(Task, Task.id == Placement.task_id).where(
            Placement.state.in_(PLACEMENT_CURRENT),
            Task.state.in_(TASK_SCHEDULED))):
        for g in p.gpu_indices:
            key = (p.node_id, g)
            free[key] = max(free.get(key, now), p.planned_end, now)
    best: tuple[int, int, str, datetime] | None = None
    for node in nodes:
        spec = gpu_spec(node.gpu_type, node.gpu_memory_bytes or None, gpu_tflops(node.meta))
        gpus, seconds = est.estimate(work, node.gpu_type, spec, minimum)
        if gpus > node.gpu_count:
            continue
        times = sorted(free.get((node.id, g), now) for g in range(node.gpu_count))
        start = times[gpus - 1]
        if best is None or start + timedelta(seconds=seconds) < best[3] + timedelta(
                seconds=best[1]):
            best = (gpus, int(math.ceil(seconds)), node.gpu_type, start)
    return best
