"""The live view of one task for the dashboard's event stream: each tick reads what changed since
the last one (the task, its jobs, new events, new loss points of each curve) from Postgres.

The first tick is a snapshot (curves downsampled to max_points, the latest events); later ticks
carry only new points, found per curve with one indexed statement (each job's points past the
last step already sent of that job and split)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from sqlalchemy import Integer, String, and_, column, select, values
from sqlalchemy.orm import Session

from service import events, task_views
from service.models import TASK_TERMINAL, Event, MetricPoint, Task
from service.schemas import EventOut, finite

SNAPSHOT_EVENTS = 300
MAX_DELTA_POINTS = 20_000  # more new points than this in one tick: send a fresh snapshot


@dataclass
class LiveState:
    """What one stream has sent so far."""

    max_points: int
    price: float | None = None  # per GPU-hour: the task's usage shows its cost, as GET /v1/tasks/{id}
    task_json: str = ""
    jobs_json: str = ""
    last_event_id: int | None = None
    last_step: dict[tuple[str, str], int] = field(default_factory=dict)
    started: bool = False


def _task(session: Session, tenant_id: str, task_id: str) -> Task | None:
    return session.scalar(select(Task).where(Task.id == task_id, Task.tenant_id == tenant_id))


def _event_outs(rows: list[Event]) -> list[dict]:
    return [EventOut(id=r.id, task_id=r.task_id, job_id=r.job_id, level=r.level, type=r.type,
                     message=r.message, data=r.data, created_at=r.created_at
                     ).model_dump(mode="json") for r in rows]


def _snapshot_curves(session: Session, task: Task, live: LiveState) -> dict:
    curves = json.loads(events.task_metrics_json(session, task, max_points=live.max_points))
    live.last_step = {}
    for job in curves["jobs"]:
        for split in ("train", "val"):
            if job[split]:
                live.last_step[(job["job_id"], split)] = job[split][-1]["step"]
    return {job["job_id"]: {"train": [[p["step"], p["loss"]] for p in job["train"]],
                            "val": [[p["step"], p["loss"]] for p in job["val"]]}
            for job in curves["jobs"]}


def _new_points(session: Session, job_ids: list[str], live: LiveState) -> dict | None:
    """{job_id: {"train": [[step, loss]], "val": [...]}} past the last steps sent; None when
    there are too many for a delta."""
    if not job_ids:
        return {}
    rows = [(j, s, live.last_step.get((j, s), -1)) for j in job_ids for s in ("train", "val")]
    sent = values(column("job_id", String), column("split", String), column("last", Integer),
                  name="sent").data(rows)
    mp = MetricPoint
    found = session.execute(
        select(mp.job_id, mp.split, mp.step, mp.loss)
        .join(sent, and_(mp.job_id == sent.c.job_id, mp.split == sent.c.split,
                         mp.step > sent.c.last))
        .order_by(mp.job_id, mp.split, mp.step).limit(MAX_DELTA_POINTS + 1)).all()
    if len(found) > MAX_DELTA_POINTS:
        return None
    out: dict[str, dict[str, list]] = {}
    for job_id, split, step, loss in found:
        out.setdefault(job_id, {"train": [], "val": []})[split].append([step, finite(loss)])
        live.last_step[(job_id, split)] = step
    return out


def tick(session: Session, tenant_id: str, task_id: str, live: LiveState
         ) -> tuple[dict | None, bool]:
    """(the update to send, or None when nothing changed; whether the task has ended).
    A task of another tenant reads as gone: ({"gone": True}, True)."""
    task = _task(session, tenant_id, task_id)
    if task is None:
        return {"gone": True}, True
    update: dict = {}
    task_json = task_views.task_out(session, task, live.price).model_dump_json()
    if task_json != live.task_json:
        live.task_json = task_json
        update["task"] = json.loads(task_json)
    jobs = task_views.list_jobs(session, task)
    jobs_json = json.dumps([j.model_dump(mode="json") for j in jobs])
    if jobs_json != live.jobs_json:
        live.jobs_json = jobs_json
        update["jobs"] = json.loads(jobs_json)
    if not live.started:
        rows = session.scalars(select(Event).where(Event.task_id == task.id)
                               .order_by(Event.id.desc()).limit(SNAPSHOT_EVENTS)).all()
        update["events"] = _event_outs(list(reversed(rows)))
    else:
        page, _ = events.list_events(session, task, live.last_event_id, 1000)
        if page:
            update["events"] = [e.model_dump(mode="json") for e in page]
    if update.get("events"):
        live.last_event_id = update["events"][-1]["id"]
    delta = None if not live.started else _new_points(session, [j.id for j in jobs], live)
    if delta is None:
        update["reset"] = True
        update["points"] = _snapshot_curves(session, task, live)
    elif delta:
        update["points"] = delta
    live.started = True
    return (update or None), task.state in TASK_TERMINAL
