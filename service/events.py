"""Task events (monotonic bigint ids, read with ``?after=``) and loss-curve metric points.
An event's id is taken at insert, under a per-task advisory lock, so ids of one task follow the
order events arrived and commit in; lists are ordered by id (never by a worker's clock). Worker
reports reach here only through service.worker_api.fence_report (the task's current attempt)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic_core import to_json
from sqlalchemy import func, select, text, true
from sqlalchemy.dialects.postgresql import aggregate_order_by, insert
from sqlalchemy.orm import Session

from service.downsample import downsample
from service.errors import invalid, not_found
from service.models import Event, Job, MetricPoint, Task, utcnow
from service.protocol import EventIn, MetricPointIn
from service.schemas import EventOut, finite


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
             "loss": p.loss, "data": p.data} for p in points]
    stmt = insert(MetricPoint).values(rows).on_conflict_do_nothing(
        constraint="uq_metric_points_job_step_split").returning(MetricPoint.id)
    return len(session.execute(stmt).all())


def task_metrics_json(session: Session, task: Task, job_id: str | None = None,
                      after_step: int | None = None, max_points: int | None = None) -> bytes:
    """Loss curves of the task's jobs (or one job), train and validation, ordered by step, as the
    JSON of MetricsOut; after_step keeps only newer points, for clients that poll. Built for
    the most-read route: one statement, whose rows are curves (each job's steps and losses of a
    split as two arrays), not points, and no model object per point (a curve has thousands).
    max_points cuts each curve to that many points (service.downsample: first, last, extremes)."""
    points = (select(MetricPoint.split,
                     func.array_agg(aggregate_order_by(MetricPoint.step, MetricPoint.step)),
                     func.array_agg(aggregate_order_by(MetricPoint.loss, MetricPoint.step)))
              .where(MetricPoint.job_id == Job.id, MetricPoint.split.in_(("train", "val")))
              .group_by(MetricPoint.split))
    if after_step is not None:
        points = points.where(MetricPoint.step > after_step)
    curve = points.lateral("curve")
    query = (select(Job.id, Job.index, Job.state, *curve.c).outerjoin(curve, true())
             .where(Job.task_id == task.id).order_by(Job.index))
    if job_id is not None:
        query = query.where(Job.id == job_id)
    jobs: dict[str, dict] = {}
    for jid, index, state, split, steps, losses in session.execute(query):
        job = jobs.setdefault(jid, {"job_id": jid, "index": index, "state": state,
                                    "train": [], "val": []})
        if split is not None:
            steps, losses = downsample(steps, [finite(x) for x in losses], max_points)
            job[split] = [{"step": step, "loss": loss}
                          for step, loss in zip(steps, losses, strict=True)]
    if job_id is not None and not jobs:
        raise not_found("job", job_id, param="job_id")
    return to_json({"object": "metrics", "task_id": task.id, "jobs": list(jobs.values())})
