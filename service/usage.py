"""Usage and cost: the exact tokens and GPU-seconds each job's training steps used (reported by
the executor on its train loss points, contract.protocol.MetricPointIn.tokens / gpu_seconds,
stored once per job and step), summed per job, per task and per tenant over a period; the cost
is the GPU-seconds at the operator's price per GPU-hour (Settings.price_per_gpu_hour). A task
shows its usage beside its dry run's estimate (TaskUsage)."""

from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field, WithJsonSchema
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from contract.methods import DEFAULT_METHOD, grid_knobs, method_spec
from contract.protocol import TaskSettings
from service.core.errors import invalid
from service.models import MetricPoint, Task, Tenant
from service.scheduler.estimator import EstimatorConfig, JobProgress, TaskWork, remaining_tokens
from service.schemas import TaskUsage


def cost_of(gpu_seconds: float | None, price: float | None) -> float | None:
    if gpu_seconds is None or price is None:
        return None
    return round(gpu_seconds / 3600 * price, 6)


def tokens_per_record(max_seq_len: int, file_bytes: int | None, lines: int | None,
                      method: str = DEFAULT_METHOD) -> float:
    """Tokens per training record from the file's bytes per line (the scheduler's estimate),
    times the method's cost factor (contract.methods)."""
    factor = method_spec(method).cost_factor
    if not file_bytes or not lines:
        return float(max_seq_len) * factor
    per_line = file_bytes / lines / EstimatorConfig().bytes_per_token
    return max(1.0, min(float(max_seq_len), per_line)) * factor


def estimated_tokens(t: dict, file_bytes: int | None, lines: int | None) -> tuple[int, int]:
    """(every job runs all its steps, with early exit as set): what the dry run said."""
    space = t["search_space"] or {}
    sizes = [int(b) for b in space.get("batch_size", [1])]
    others = math.prod(len(space.get(k) or [None]) for k in grid_knobs(t["method"])
                       if k != "batch_size")
    cfg = TaskSettings.model_validate(t["settings"])
    work = TaskWork(t["base_model"], max(1, t["num_train_samples"] or 0), cfg.epochs,
                    tokens_per_record(cfg.max_seq_len, file_bytes, lines, t["method"]), cfg.max_seq_len,
                    [JobProgress(b) for b in sizes for _ in range(max(1, others))],
                    early_exit=cfg.early_exit.enabled,
                    warmup_fraction=cfg.early_exit.warmup_fraction,
                    keep_fraction=cfg.early_exit.keep_fraction)
    full = sum(work.steps(j) * j.batch_size * work.avg_tokens_per_sample for j in work.jobs)
    return int(full), int(remaining_tokens(work))


def task_usage(t: dict, tokens: int | None, gpu_seconds: float | None, file_bytes: int | None,
               lines: int | None, estimated_s: float | None, gpus: int | None,
               price: float | None) -> TaskUsage:
    """A task's usage view from its columns and sums (both read paths build it here)."""
    full, expected = estimated_tokens(t, file_bytes, lines)
    ran = t["started_at"] is not None or tokens is not None
    est_gpu_s = float(estimated_s * gpus) if estimated_s is not None and gpus else None
    used_s = float(gpu_seconds or 0.0) if ran else None
    return TaskUsage(trained_tokens=int(tokens or 0) if ran else None, gpu_seconds=used_s,
                     cost=cost_of(used_s, price), estimated_tokens=full,
                     expected_tokens=expected, estimated_gpu_seconds=est_gpu_s,
                     estimated_cost=cost_of(est_gpu_s, price), price_per_gpu_hour=price)


def job_usage(session: Session, task_id: str) -> dict[str, tuple[int | None, float | None]]:
    """Each job's (tokens, GPU-seconds) summed over its train points."""
    return {job_id: (None if tok is None else int(tok), gs) for job_id, tok, gs in session.execute(
        select(MetricPoint.job_id, func.sum(MetricPoint.tokens), func.sum(MetricPoint.gpu_seconds))
        .where(MetricPoint.task_id == task_id, MetricPoint.split == "train")
        .group_by(MetricPoint.job_id))}


# ----- the per-tenant report of a period -----------------------------------------------------------
class TaskUsageLine(BaseModel):
    task_id: str
    base_model: str
    state: str
    trained_tokens: int
    gpu_seconds: float
    cost: float


class UsageReport(BaseModel):
    """GET /v1/usage: the calling tenant's training in [start, end) (each step counts where it
    was reported), per task and in total."""

    object: str = "usage.report"
    start: datetime
    end: datetime
    price_per_gpu_hour: float
    trained_tokens: int
    gpu_seconds: float
    cost: float
    tasks: list[TaskUsageLine] = Field(description="Tasks that trained in the period, by id.")


# 9999-12-31T23:59:59Z: the last second a datetime holds.
MAX_UNIX_S = 253_402_300_799
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")


def _instant(value: Any) -> Any:
    """A period bound as the query gives it: Unix seconds (a JSON number in [0, MAX_UNIX_S])
    become a UTC time; a string is left to the datetime parser (ISO 8601)."""
    if isinstance(value, str) and _NUMBER.fullmatch(value):
        seconds = float(value)
        if not 0 <= seconds <= MAX_UNIX_S:
            raise ValueError(f"Unix seconds must be in [0, {MAX_UNIX_S}]")
        return datetime.fromtimestamp(seconds, timezone.utc)
    return value


# What GET /v1/usage takes for start and end, in the schema as in the route: an ISO 8601 time
# (UTC when it has no offset), a date (its midnight, UTC) or Unix seconds.
Instant = Annotated[datetime, BeforeValidator(_instant), WithJsonSchema({"anyOf": [
    {"type": "string", "format": "date-time"}, {"type": "string", "format": "date"},
    {"type": "number", "minimum": 0, "maximum": MAX_UNIX_S}]})]


def _utc(ts: datetime) -> datetime:
    return ts.replace(tzinfo=timezone.utc) if ts.tzinfo is None else ts


def usage_report(session: Session, tenant: Tenant, start: datetime, end: datetime,
                 price: float) -> UsageReport:
    """The tenant's usage in [start, end) (naive times are UTC); 422 naming `start` when it is
    after `end`."""
    start, end = _utc(start), _utc(end)
    if start > end:
        raise invalid(f"start {start.isoformat()} is after end {end.isoformat()}", param="start")
    rows = session.execute(
        select(Task.id, Task.base_model, Task.state, func.sum(MetricPoint.tokens),
               func.sum(MetricPoint.gpu_seconds))
        .join(MetricPoint, MetricPoint.task_id == Task.id)
        .where(Task.tenant_id == tenant.id, MetricPoint.split == "train",
               MetricPoint.created_at >= start, MetricPoint.created_at < end)
        .group_by(Task.id, Task.base_model, Task.state).order_by(Task.id)).all()
    lines = [TaskUsageLine(task_id=tid, base_model=model, state=state, trained_tokens=int(tok or 0),
                           gpu_seconds=float(gs or 0.0), cost=cost_of(float(gs or 0.0), price) or 0.0)
             for tid, model, state, tok, gs in rows]
    total_s = sum(line.gpu_seconds for line in lines)
    return UsageReport(start=start, end=end, price_per_gpu_hour=price,
                       trained_tokens=sum(line.trained_tokens for line in lines),
                       gpu_seconds=total_s, cost=cost_of(total_s, price) or 0.0, tasks=lines)

