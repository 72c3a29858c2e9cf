"""Task events (monotonic bigint ids, read with ``?after=``) and loss-curve metric points.
An event's id is taken at insert, under a per-task advisory lock, so ids of one task follow the
order events arrived and commit in; lists are ordered by id (never by a worker's clock). Worker
reports reach here only through service.worker_api.fence_report (the task's current attempt)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from pydantic_core import to_json
from sqlalchemy import (
    ColumnElement,
    Float,
    Select,
    and_,
    bindparam,
    cast,
    func,
    literal_column,
    select,
    text,
    true,
)
from sqlalchemy.dialects.postgresql import aggregate_order_by, insert
from sqlalchemy.orm import Session

from contract.protocol import EventIn, MetricPointIn
from service.core.errors import invalid, not_found
from service.downsample import downsample, keep_indices
from service.models import Event, Job, MetricPoint, Task, utcnow
from service.schemas import EventOut, finite
from service.tracking import integrations as tracking
from service.webhooks import outbox as webhook_outbox


def _lock_task_events(session: Session, task_id: str) -> None:
    # Identity values are taken at insert but become visible at commit; serialising the writers
    # of one task keeps "after=<last id seen>" from skipping an event committed late.
    session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": f"events:{task_id}"})


def add_event(session: Session, task_id: str, type: str, message: str = "",
              job_id: str | None = None, data: dict | None = None, level: str = "info") -> None:
    """Record a service-side event (task created, queued, cancelled, job state changes...)."""
    _lock_task_events(session, task_id)
    session.add(Event(task_id=task_id, job_id=job_id, type=type, message=message, data=data,
                      level=level))
    session.flush()
    # The webhook outbox, in this same transaction: delivered exactly when the change commits.
    webhook_outbox.on_task_event(session, task_id, type, message, job_id, data)
    tracking.on_task_event(session, task_id, type)  # its end: the integrations' syncer looks


def ingest_events(session: Session, task: Task, events: Sequence[EventIn]) -> int:
    """Store worker events; those whose client_key was already stored are skipped."""
    if not events:
        return 0
    job_ids = {e.job_id for e in events if e.job_id}
    if job_ids:
        known = set(session.scalars(
            select(Job.id).where(Job.task_id == task.id, Job.id.in_(job_ids))))
        unknown = job_ids - known
        if unknown:
            raise invalid(f"job {sorted(unknown)[0]!r} is not a job of task {task.id!r}",
                          param="events.job_id")
    _lock_task_events(session, task.id)
    now = utcnow()
    rows = [{"task_id": task.id, "job_id": e.job_id, "level": e.level, "type": e.type,
             "message": e.message, "data": e.data, "client_key": e.client_key,
             "created_at": e.created_at or now} for e in events]
    stmt = insert(Event).values(rows).on_conflict_do_nothing(
        constraint="uq_events_task_client_key").returning(Event.id)
    return len(session.execute(stmt).all())


def list_events(session: Session, task: Task, after: int | None, limit: int
                ) -> tuple[list[EventOut], bool]:
    query = select(Event).where(Event.task_id == task.id)
    if after is not None:
        query = query.where(Event.id > after)
    rows = session.scalars(query.order_by(Event.id).limit(limit + 1)).all()
    out = [EventOut(id=r.id, task_id=r.task_id, job_id=r.job_id, level=r.level, type=r.type,
                    message=r.message, data=r.data, created_at=r.created_at) for r in rows[:limit]]
    return out, len(rows) > limit


def ingest_metrics(session: Session, task: Task, points: Sequence[MetricPointIn]) -> int:
    """Store loss points; a (job, step, split) already stored is ignored (retry-safe)."""
    if not points:
        return 0
    job_ids = {p.job_id for p in points}
    known = set(session.scalars(select(Job.id).where(Job.task_id == task.id, Job.id.in_(job_ids))))
    unknown = job_ids - known
    if unknown:
        raise invalid(f"job {sorted(unknown)[0]!r} is not a job of task {task.id!r}",
                      param="points.job_id")
    rows = [{"task_id": task.id, "job_id": p.job_id, "step": p.step, "split": p.split,
             "loss": p.loss, "data": p.data,
             "tokens": p.tokens if p.split == "train" else None,
             "gpu_seconds": p.gpu_seconds if p.split == "train" else None} for p in points]
    stmt = insert(MetricPoint).values(rows).on_conflict_do_nothing(
        constraint="uq_metric_points_job_step_split").returning(MetricPoint.id)
    return len(session.execute(stmt).all())


def task_metrics_json(session: Session, task: Task, job_id: str | None = None,
                      after_step: int | None = None, max_points: int | None = None) -> bytes:
    """Loss curves of the task's jobs (or one job), train and validation, ordered by step, as the
    JSON of MetricsOut; after_step keeps only newer points, for clients that poll. Built for
    the most-read route: one statement, whose rows are curves (each job's steps and losses of a
    split as two arrays), not points, and no model object per point (a curve has thousands).
    max_points cuts each curve to that many points (service.downsample: first, last, extremes).
    The async route (service.api.read_path) runs the same statement."""
    rows = session.execute(metrics_statement(job_id is not None, after_step is not None),
                           metrics_params(task.tenant_id, task.id, job_id, after_step))
    return metrics_body(task.id, rows, job_id, max_points)


# The splits drawn as curves, as SQL literals: the statement has only named parameters, so
# service.api.read_path runs it as compiled once.
_CURVES = {"train": literal_column("'train'"), "val": literal_column("'val'")}
# a validation point's token accuracy (SFT), from its reported numbers; null where absent
_TOKEN_ACCURACY = cast(MetricPoint.data.op("->>")(literal_column("'token_accuracy'")), Float)


def _curve_of(split: str, column: ColumnElement) -> ColumnElement:
    """A split's values of column in step order (null when it has no points)."""
    return (func.array_agg(aggregate_order_by(column, MetricPoint.step))
            .filter(MetricPoint.split == _CURVES[split]))


def metrics_statement(one_job: bool, after: bool, tenant: ColumnElement | None = None) -> Select:
    """The curves of a task of a tenant: one row per job (task_id, job id, index, state, then
    steps and losses of train, then of val); a task without (matching) jobs gives one row of
    nulls after its id (the last column: the val points' token accuracies), an unknown task (or another tenant's) gives none. Parameters:
    metrics_params; the tenant is the parameter tenant_id unless given (service.api.read_path: the
    API key's). One aggregate pass per job, the splits told apart by FILTER (grouping by split
    sorted every job's points once more: 1.25 -> 1.0 ms of PostgreSQL CPU per request)."""
    points = (select(*(_curve_of(split, column) for split in _CURVES
                       for column in (MetricPoint.step, MetricPoint.loss)),
                     _curve_of("val", _TOKEN_ACCURACY))
              .where(MetricPoint.job_id == Job.id, MetricPoint.split.in_(list(_CURVES.values()))))
    if after:
        points = points.where(MetricPoint.step > bindparam("after_step"))
    curve = points.lateral("curve")
    on = Job.task_id == Task.id
    if one_job:
        on = and_(on, Job.id == bindparam("job_id"))
    return (select(Task.id, Job.id, Job.index, Job.state, *curve.c).select_from(Task)
            .outerjoin(Job, on).outerjoin(curve, true())
            .where(Task.id == bindparam("task_id"),
                   Task.tenant_id == (bindparam("tenant_id") if tenant is None else tenant))
            .order_by(Job.index))


def metrics_params(tenant_id: str | None, task_id: str, job_id: str | None,
                   after_step: int | None) -> dict:
    params = {"tenant_id": tenant_id, "task_id": task_id}
    if job_id is not None:
        params["job_id"] = job_id
    if after_step is not None:
        params["after_step"] = after_step
    return params


def metrics_body(task_id: str, rows: Iterable[Sequence], job_id: str | None,
                 max_points: int | None) -> bytes:
    """MetricsOut's JSON from metrics_statement's rows (of a task that exists): the bytes
    MetricsOut.model_dump_json() gives, written a curve at a time (a model or a dict per point
    was most of the route's time: curves have thousands of points)."""
    jobs = []
    for _, jid, index, state, train_steps, train, val_steps, val, accuracy in rows:
        if jid is not None:
            head = to_json({"job_id": jid, "index": index, "state": state}).decode()[:-1]
            jobs.append(f'{head},"train":[{_curve(train_steps, train, max_points)}],'
                        f'"val":[{_curve(val_steps, val, max_points, accuracy)}]}}')
    if job_id is not None and not jobs:
        raise not_found("job", job_id, param="job_id")
    body = ",".join(jobs)
    return f'{{"object":"metrics","task_id":{to_json(task_id).decode()},"jobs":[{body}]}}'.encode()


def _curve(steps: list[int] | None, losses: list[float] | None, max_points: int | None,
           accuracy: list[float | None] | None = None) -> str:
    """The JSON of a curve's points without its brackets: {"step":s,"loss":x} each, a
    non-finite loss as null, the numbers as pydantic writes them (one to_json of all losses);
    with `accuracy` (validation), a point that has one gets its "token_accuracy" too."""
    if not steps or not losses:
        return ""
    if not math.isfinite(sum(losses)):  # some loss is NaN or infinite (or the sum overflowed)
        losses = [finite(x) for x in losses]
    if accuracy is None or all(a is None for a in accuracy):
        steps, losses = downsample(steps, losses, max_points)
        accuracy = None
    else:  # the same points downsample keeps, with their accuracies
        keep = range(len(steps)) if max_points is None else keep_indices(losses, max_points)
        steps, losses, accuracy = ([xs[i] for i in keep] for xs in (steps, losses, accuracy))
    if not steps:
        return ""
    written = to_json(losses).decode()[1:-1].split(",")
    if accuracy is None:
        return ",".join([f'{{"step":{s},"loss":{x}}}' for s, x in zip(steps, written, strict=True)])
    acc = to_json([None if a is None else finite(a) for a in accuracy]).decode()[1:-1].split(",")
    return ",".join([f'{{"step":{s},"loss":{x}}}' if a == "null" else
                     f'{{"step":{s},"loss":{x},"token_accuracy":{a}}}'
                     for s, x, a in zip(steps, written, acc, strict=True)])
