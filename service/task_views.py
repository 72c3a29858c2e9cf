"""What a tenant reads of tasks and jobs: TaskOut and JobOut built from rows, one statement
for a whole page (service.api.read_path serves the hottest list from the same task_view)."""

from __future__ import annotations

from collections import Counter
from datetime import datetime

from sqlalchemy import func, literal_column, select, true
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.orm import Session

from contract.protocol import TaskSettings
from contract.states import PlacementState
from service.models import Artifact, File, Job, MetricPoint, Placement, Task
from service.samples import SAMPLES_FILE_SQL
from service.schemas import JobOut, TaskOut, finite
from service.tracking.integrations import VIEW_SQL, integration_views
from service.usage import job_usage, task_usage


def task_out(session: Session, task: Task, price: float | None = None) -> TaskOut:
    return task_outs(session, [task], price)[0]


def task_outs(session: Session, tasks: list[Task], price: float | None = None) -> list[TaskOut]:
    """API views of tasks: one statement for the whole page (each task's job states, failed
    attempts, the placement that says most about "when": the live one, else the latest that
    ran, its usage sums and its result file), since every round trip counts on the list
    endpoint. price: the operator's price per GPU-hour (the usage's cost; None: not shown)."""
    if not tasks:
        return []
    latest = (select(Placement.attempt, Placement.planned_start, Placement.planned_end,
                     Placement.estimated_s, func.cardinality(Placement.gpu_indices))
              .where(Placement.task_id == Task.id,
                     Placement.state.not_in((PlacementState.SUPERSEDED,
                                              PlacementState.CANCELLED)))
              .order_by(Placement.created_at.desc()).limit(1).lateral("latest"))
    train = (MetricPoint.task_id == Task.id, MetricPoint.split == "train")
    rows = session.execute(
        select(Task.id,
               select(func.array_agg(Job.state)).where(Job.task_id == Task.id)
               .scalar_subquery(),
               select(func.count()).where(Placement.task_id == Task.id,
                                          Placement.state == PlacementState.FAILED).scalar_subquery(),
               *latest.c,
               select(func.sum(MetricPoint.tokens)).where(*train).scalar_subquery(),
               select(func.sum(MetricPoint.gpu_seconds)).where(*train).scalar_subquery(),
               select(File.bytes).where(File.id == Task.training_file_id).scalar_subquery(),
               select(File.line_count).where(File.id == Task.training_file_id).scalar_subquery(),
               select(func.array_agg(aggregate_order_by(File.id, (File.format == "csv").desc())))
               .where(File.id.in_([func.concat("file_", func.split_part(Task.id, "_", 2)),
                                   literal_column(SAMPLES_FILE_SQL.format(task="tasks"))]),
                      File.deleted_at.is_(None)).scalar_subquery(),
               literal_column(VIEW_SQL.format(task="tasks")))
        .outerjoin(latest, true()).where(Task.id.in_([t.id for t in tasks])))
    views = {row[0]: row[1:] for row in rows}
    return [TaskOut(**task_view({c: getattr(task, c) for c in TASK_COLUMNS}, *views[task.id],
                                price=price))
            for task in tasks]


# The task's own columns a view shows (service.api.read_path selects these by name, in this order).
TASK_COLUMNS = ("id", "state", "base_model", "method", "training_file_id", "validation_file_id",
                "search_space", "settings", "priority", "best_job_id", "error", "created_at",
                "started_at", "finished_at", "suffix", "meta", "num_train_samples",
                "init_adapter_file_id")


def task_view(t: dict, job_states: list[str] | None, failed: int, attempt: int | None,
              planned_start: datetime | None, planned_end: datetime | None,
              estimated_s: float | None = None, gpus: int | None = None,
              tokens: int | None = None, gpu_seconds: float | None = None,
              file_bytes: int | None = None, file_lines: int | None = None,
              result_files: list[str] | None = None, integrations: list | None = None, *,
              price: float | None = None) -> dict:
    """TaskOut's fields, in its order, from a task's TASK_COLUMNS and what task_outs adds (its
    job states, failed attempts, the placement that says most about "when" with its estimate
    and GPUs, its usage sums, its training file's size, its result files and its integrations):
    the one view of a task, for the ORM path and the read path alike."""
    counts = dict(Counter(job_states or ()))
    usage = task_usage(t, tokens, gpu_seconds, file_bytes, file_lines, estimated_s, gpus, price)
    settings = TaskSettings.model_validate(t["settings"]).model_dump(mode="json")
    return {**settings, "id": t["id"], "object": "task", "state": t["state"],
            "base_model": t["base_model"], "method": t["method"],
            "training_file": t["training_file_id"], "validation_file": t["validation_file_id"],
            "search_space": t["search_space"], "priority": t["priority"],
            "num_jobs": sum(counts.values()), "job_counts": counts,
            "best_job_id": t["best_job_id"], "error": t["error"],
            "attempt": attempt if attempt is not None else failed + 1,
            "planned_start": planned_start, "planned_end": planned_end,
            "created_at": t["created_at"], "started_at": t["started_at"],
            "finished_at": t["finished_at"], "suffix": t["suffix"], "metadata": t["meta"],
            "result_files": list(result_files or []),
            "usage": usage.model_dump(), "init_adapter_file": t.get("init_adapter_file_id"),
            "integrations": integration_views(integrations, t["state"])}


def list_jobs(session: Session, task: Task) -> list[JobOut]:
    jobs = session.scalars(select(Job).where(Job.task_id == task.id).order_by(Job.index)).all()
    with_adapter = set(session.scalars(select(Artifact.job_id).where(
        Artifact.task_id == task.id, Artifact.kind == "adapter")))
    usage = job_usage(session, task.id)
    return [job_out(j, j.id in with_adapter, usage.get(j.id)) for j in jobs]


def job_out(job: Job, has_adapter: bool,
            usage: tuple[int | None, float | None] | None = None) -> JobOut:
    tokens, gpu_seconds = usage or (None, None)
    return JobOut(id=job.id, task_id=job.task_id, index=job.index, hyperparameters=job.config,
                  state=job.state, exit_reason=job.exit_reason,
                  best_val_loss=finite(job.best_val_loss), best_step=job.best_step,
                  last_step=job.last_step, error=job.error, has_adapter=has_adapter,
                  created_at=job.created_at, started_at=job.started_at,
                  finished_at=job.finished_at, trained_tokens=tokens, gpu_seconds=gpu_seconds)
