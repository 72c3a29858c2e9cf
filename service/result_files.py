"""A finished task's result file: its step metrics as a CSV (OpenAI's `result_files`), stored as a
file object of the tenant (purpose fine-tune-results), downloadable at /v1/files/{id}/content.

The file's id is derived from the task's (`result_file_id`), so making it twice makes one file:
the terminal transitions make it (eagerly, after their commit) and every read of a task that
shows it makes it when it is missing (a crash between the two loses nothing). Columns (RESULT_COLUMNS,
documented in the README): OpenAI's `step, train_loss, train_accuracy, valid_loss,
valid_mean_token_accuracy` (the accuracies are DPO's reward accuracy, empty for SFT), then
loraplex's per-job columns: the job, its hyperparameters and the tokens it trained."""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import math

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from service.core.storage import Storage
from service.models import TASK_TERMINAL, File, Job, MetricPoint, Task

log = logging.getLogger("loraplex.result_files")

PURPOSE = "fine-tune-results"
RESULT_COLUMNS = ("step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy",
                  "job_id", "job_index", "learning_rate", "lora_rank", "lora_alpha", "batch_size",
                  "tokens", "trained_tokens")


def result_file_id(task_id: str) -> str:
    """The one id a task's result file can have (file_ + the task id's random part)."""
    return "file_" + task_id.split("_", 1)[-1]


def _num(x: float | None) -> str:
    if x is None:
        return ""
    return repr(float(x)) if math.isfinite(x) else str(float(x))


def step_metrics(session: Session, task: Task) -> tuple[dict[str, Job], dict[tuple, dict]]:
    """The task's jobs by id and its step metrics: {(job index, step, job id): {train_loss,
    train_accuracy, tokens, valid_loss, valid_mean_token_accuracy, at}} for every job and step
    with a train or validation point (the accuracies: DPO's reward accuracy; at: when the step's
    first point was stored). The one read of a task's curves that its result file and its
    tracking runs (service.tracking) are made from."""
    jobs = {j.id: j for j in session.scalars(select(Job).where(Job.task_id == task.id))}
    points: dict[tuple[int, int, str], dict] = {}
    for p in session.execute(select(MetricPoint.job_id, MetricPoint.step, MetricPoint.split,
                                    MetricPoint.loss, MetricPoint.data, MetricPoint.tokens,
                                    MetricPoint.created_at)
                             .where(MetricPoint.task_id == task.id)):
        job = jobs[p.job_id]
        row = points.setdefault((job.index, p.step, job.id), {})
        accuracy = (p.data or {}).get("reward_accuracy")
        if p.split == "train":
            row.update(train_loss=p.loss, train_accuracy=accuracy, tokens=p.tokens)
        else:
            row.update(valid_loss=p.loss, valid_mean_token_accuracy=accuracy)
        row["at"] = min(row.get("at", p.created_at), p.created_at)
    return jobs, points


def results_csv(session: Session, task: Task) -> tuple[bytes, int]:
    """The CSV of the task's step metrics (one row per job and step with a train or validation
    point, jobs by index, steps in order) and its number of data rows."""
    jobs, points = step_metrics(session, task)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(RESULT_COLUMNS)
    trained: dict[str, int] = {}
    for (index, step, job_id), row in sorted(points.items()):
        config = jobs[job_id].config or {}
        tokens = row.get("tokens")
        trained[job_id] = trained.get(job_id, 0) + (tokens or 0)
        writer.writerow([
            step, _num(row.get("train_loss")), _num(row.get("train_accuracy")),
            _num(row.get("valid_loss")), _num(row.get("valid_mean_token_accuracy")), job_id, index,
            config.get("learning_rate", ""), config.get("lora_rank", ""),
            config.get("lora_alpha", ""), config.get("batch_size", ""),
            "" if tokens is None else tokens, trained[job_id]])
    return out.getvalue().encode(), len(points)


def ensure_result_file(session: Session, storage: Storage, task: Task) -> str | None:
    """The id of the task's result file, made now if the task is over, has step metrics and has
    none yet (idempotent; concurrent callers make one file); None while it runs or without
    metrics. A result file the tenant deleted stays deleted. Flushes; the caller commits."""
    if task.state not in TASK_TERMINAL:
        return None
    file_id = result_file_id(task.id)
    row = session.get(File, file_id)
    if row is not None:
        return None if row.deleted_at is not None else file_id
    body, count = results_csv(session, task)
    if count == 0:
        return None
    key = f"files/{task.tenant_id}/{file_id}.csv"
    storage.put(key, io.BytesIO(body))
    session.execute(insert(File).values(
        id=file_id, tenant_id=task.tenant_id, filename=f"{task.id}_step_metrics.csv",
        purpose=PURPOSE, format="csv", bytes=len(body), line_count=count,
        sha256=hashlib.sha256(body).hexdigest(), storage_key=key, created_at=task.finished_at
        or task.created_at).on_conflict_do_nothing(index_elements=["id"]))
    session.flush()
    log.info("result file made task=%s file=%s rows=%d", task.id, file_id, count)
    return file_id


def ensure_result_files(session: Session, storage: Storage, tasks: list[Task]) -> None:
    """Before showing tasks: make the result files of those that ended without one (the
    terminal transition's attempt failed or never ran), and commit them. Best effort: a failure
    is logged and the view shows no result file yet."""
    for task in tasks:
        if task.state not in TASK_TERMINAL:
            continue
        try:
            if session.get(File, result_file_id(task.id)) is None and \
                    ensure_result_file(session, storage, task):
                session.commit()
        except Exception:  # noqa: BLE001 - a read must not fail for it; the next one retries
            session.rollback()
            log.exception("result file not made task=%s (made on the next read)", task.id)


def make_result_file_after_end(session: Session, storage: Storage, task_id: str) -> None:
    """After a terminal transition committed: make the result file now (best effort)."""
    task = session.get(Task, task_id)
    if task is not None:
        ensure_result_files(session, storage, [task])
