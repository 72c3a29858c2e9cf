"""Task events (monotonic bigint ids, read with ``?after=``) and loss-curve metric points.
Writers take a per-task advisory lock so event ids of one task commit in id order."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from sqlalchemy import select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from service.errors import invalid, not_found
from service.models import Event, Job, MetricPoint, Task, utcnow
from service.protocol import EventIn, MetricPointIn
from service.schemas import EventOut, JobCurves, LossPoint, MetricsOut, finite


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


def task_metrics(session: Session, task: Task, job_id: str | None = None,
                 after_step: int | None = None) -> MetricsOut:
    """Loss curves of the task's jobs (or one job), train and validation, ordered by step;
    after_step keeps only newer points, for clients that poll."""
    job_query = select(Job).where(Job.task_id == task.id)
    point_query = select(MetricPoint.job_id, MetricPoint.split, MetricPoint.step,
                         MetricPoint.loss).where(MetricPoint.task_id == task.id)
    if job_id is not None:
        job_query = job_query.where(Job.id == job_id)
        point_query = point_query.where(MetricPoint.job_id == job_id)
    if after_step is not None:
        point_query = point_query.where(MetricPoint.step > after_step)
    jobs = session.scalars(job_query.order_by(Job.index)).all()
    if job_id is not None and not jobs:
        raise not_found("job", job_id, param="job_id")
    curves: dict[str, dict[str, list[LossPoint]]] = defaultdict(lambda: {"train": [], "val": []})
    points = session.execute(point_query.order_by(MetricPoint.job_id, MetricPoint.step))
    for job_id, split, step, loss in points:
        curves[job_id][split].append(LossPoint(step=step, loss=finite(loss)))
    return MetricsOut(task_id=task.id, jobs=[
        JobCurves(job_id=j.id, index=j.index, state=j.state, train=curves[j.id]["train"],
                  val=curves[j.id]["val"]) for j in jobs])
