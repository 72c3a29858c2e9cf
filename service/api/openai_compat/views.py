"""Tasks seen through OpenAI's objects: jobs (the chosen configuration, trained tokens), their
events (messages and metrics) and checkpoints (each job's adapter), with cursor pages.

fine_tuned_model is `ft:<base model>:<suffix>:<job id>` once the job succeeded; GET
/v1/models/{that name} answers it and its adapter downloads at /v1/tasks/{job id}/adapter.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.methods import METHOD_KNOBS, method_spec
from contract.states import TASK_SCHEDULED, TaskState
from service.api.openai_compat.create import BASE_LEARNING_RATE, OPENAI_METHOD
from service.api.openai_compat.schemas import (
    CheckpointMetrics,
    CheckpointOut,
    FineTuningJobOut,
    JobError,
    JobEventOut,
)
from service.core.pagination import page_query, unknown_cursor
from service.models import TASK_TERMINAL, Artifact, Event, File, Job, MetricPoint, Task, Tenant
from service.schemas import TaskOut
from service.task_views import task_outs
from service.usage import tokens_per_record


def unix(ts: datetime | None) -> int | None:
    return None if ts is None else int(ts.timestamp())


def _one_or_list(values: list) -> Any:
    return values[0] if len(values) == 1 else values


def hyperparameters_out(method: str, space: dict, epochs: int,
                        chosen: dict | None = None) -> dict:
    """The job's hyperparameters as OpenAI shows them: the chosen (best) configuration once it
    succeeded, else the search space (one value as a number, several as a list)."""
    if chosen is not None:
        space = {k: [v] for k, v in chosen.items() if v is not None}
    lr = [float(f"{x / BASE_LEARNING_RATE:.6g}") for x in space.get("learning_rate", [])]
    out = {"batch_size": _one_or_list(space.get("batch_size", [])),
           "learning_rate_multiplier": _one_or_list(lr), "n_epochs": epochs,
           "lora_rank": _one_or_list(space.get("lora_rank", [])),
           "lora_alpha": _one_or_list(space.get("lora_alpha", []))}
    for knob in method_spec(method).knobs:  # the method's own (contract.methods: dpo's beta)
        out[knob.name] = _one_or_list(space.get(knob.name, [knob.default]))
    return out


def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def fine_tuned_model_name(task: Task) -> str | None:
    """The name the adapter of a succeeded job goes by: ft:<base model>:<suffix>:<job id>."""
    if task.state != TaskState.SUCCEEDED:
        return None
    return f"ft:{task.base_model}:{task.suffix or ''}:{task.id}"


def task_of_model_name(name: str) -> str | None:
    """The job (task) id in a fine_tuned_model name, else None."""
    if not name.startswith("ft:"):
        return None
    return next((part for part in reversed(name.split(":")) if part.startswith("task_")), None)


def job_outs(session: Session, tasks: list[Task], price: float | None = None
             ) -> list[FineTuningJobOut]:
    """OpenAI views of tasks: task_outs (states, counts, plan, usage, result file) plus each
    task's chosen configuration, in two more statements for the whole page."""
    if not tasks:
        return []
    views = {v.id: v for v in task_outs(session, tasks, price)}
    ids = [t.id for t in tasks]
    jobs: dict[str, list[Job]] = {}
    for job in session.scalars(select(Job).where(Job.task_id.in_(ids))):
        jobs.setdefault(job.task_id, []).append(job)
    files = {f.id: f for f in session.scalars(select(File).where(
        File.id.in_({t.training_file_id for t in tasks})))}
    out = []
    for task in tasks:
        view = views[task.id]
        mine = jobs.get(task.id, [])
        best = next((j for j in mine if j.id == task.best_job_id), None)
        hp = hyperparameters_out(task.method, task.search_space, view.epochs,
                                 best.config if best is not None else None)
        method = {"type": OPENAI_METHOD.get(task.method, task.method),
                  OPENAI_METHOD.get(task.method, task.method): {"hyperparameters": hp}}
        terminal = task.state in TASK_TERMINAL
        error = None
        if task.state == TaskState.FAILED and task.error:
            error = JobError(code=str(task.error.get("code", "task_failed")),
                             message=str(task.error.get("message", "training failed")),
                             param=task.error.get("param"))
        out.append(FineTuningJobOut(
            id=task.id, created_at=unix(task.created_at), error=error,
            fine_tuned_model=fine_tuned_model_name(task), finished_at=unix(task.finished_at),
            hyperparameters={k: v for k, v in hp.items() if k not in METHOD_KNOBS}, model=task.base_model,
            organization_id=task.tenant_id, seed=view.seed, status=task.state,
            trained_tokens=(_trained_tokens(view, task, mine, files) if terminal else None),
            result_files=view.result_files, usage=view.usage,
            training_file=task.training_file_id, validation_file=task.validation_file_id,
            estimated_finish=(unix(view.planned_end) if task.state in TASK_SCHEDULED else None),
            metadata=task.meta, method=method, suffix=task.suffix, num_jobs=view.num_jobs,
            integrations=view.integrations or None,
            job_counts=view.job_counts, best_job_id=task.best_job_id))
    return out


def _trained_tokens(view: TaskOut, task: Task, jobs: list[Job], files: dict[str, File]) -> int:
    """The exact count once the task's executors reported it; the estimate for tasks trained
    before they did (no step carries tokens)."""
    if view.usage is not None and view.usage.trained_tokens:
        return view.usage.trained_tokens
    return trained_tokens(task, jobs, files.get(task.training_file_id))


def trained_tokens(task: Task, jobs: list[Job], file: File | None) -> int:
    """Tokens trained (an estimate from the file's bytes per record): each job's steps x its
    batch size x tokens per record."""
    per_sample = tokens_per_record(task.settings["max_seq_len"], file and file.bytes,
                                   file and file.line_count, task.method)
    return int(sum((j.last_step or 0) * int((j.config or {}).get("batch_size", 1)) * per_sample
                   for j in jobs))


def list_jobs(session: Session, tenant: Tenant, limit: int, after: str | None,
              metadata: dict[str, str] | None) -> tuple[list[Task], bool]:
    scope = select(Task).where(Task.tenant_id == tenant.id)
    query = scope
    if metadata:
        query = query.where(Task.meta.contains(metadata))
    return page_query(session, Task, query, limit, after, scope=scope)


_LEVELS = {"debug": "info", "info": "info", "warning": "warn", "error": "error"}


def job_events(session: Session, task: Task, after: str | None, limit: int
               ) -> tuple[list[JobEventOut], bool]:
    """The job's events, newest first (OpenAI's order; `after` = the last id of the previous
    page): the task's own events as type "message" (ids ftevent-<n>) and one "metrics" event per
    job and evaluation step (ids ftevent-m<n>), with step, train_loss and valid_loss (and SFT's
    valid_mean_token_accuracy)."""
    msgs = session.execute(select(Event.id, Event.created_at, Event.level, Event.message,
                                  Event.type, Event.job_id, Event.data)
                           .where(Event.task_id == task.id)).all()
    index = dict(session.execute(select(Job.id, Job.index).where(Job.task_id == task.id)).all())
    train = {(job_id, step): loss for job_id, step, loss in session.execute(
        select(MetricPoint.job_id, MetricPoint.step, MetricPoint.loss).where(
            MetricPoint.task_id == task.id, MetricPoint.split == "train"))}
    vals = session.execute(select(MetricPoint.id, MetricPoint.created_at, MetricPoint.job_id,
                                  MetricPoint.step, MetricPoint.loss, MetricPoint.data).where(
        MetricPoint.task_id == task.id, MetricPoint.split == "val")).all()
    items: list[tuple[tuple, JobEventOut]] = []
    for eid, at, level, message, kind, job_id, data in msgs:
        payload = {"type": kind, **({"job_id": job_id} if job_id else {}), **(data or {})}
        items.append(((at, 1, eid), JobEventOut(
            id=f"ftevent-{eid}", created_at=unix(at), level=_LEVELS.get(level, "info"),
            message=message, data=payload, type="message")))
    for mid, at, job_id, step, loss, numbers in vals:
        tl = finite_or_none(train.get((job_id, step)))
        vl = finite_or_none(loss)
        data = {"step": step, "job_id": job_id, "job_index": index.get(job_id),
                "train_loss": tl, "valid_loss": vl}
        accuracy = token_accuracy(numbers)
        if accuracy is not None:
            data["valid_mean_token_accuracy"] = accuracy
        items.append(((at, 0, mid), JobEventOut(
            id=f"ftevent-m{mid}", created_at=unix(at), level="info", type="metrics",
            message=f"job {index.get(job_id)} step {step}: train loss "
                    f"{'-' if tl is None else f'{tl:.4f}'}, valid loss "
                    f"{'-' if vl is None else f'{vl:.4f}'}"
                    + ("" if accuracy is None else f", valid token accuracy {accuracy:.4f}"),
            data=data)))
    items.sort(key=lambda kv: kv[0], reverse=True)
    return _page_after([e for _, e in items], after, limit)


def token_accuracy(numbers: dict | None) -> float | None:
    """The mean token accuracy of a validation point's reported numbers (SFT), else None."""
    value = (numbers or {}).get("token_accuracy")
    return finite_or_none(float(value)) if isinstance(value, int | float) else None


def job_checkpoints(session: Session, task: Task, after: str | None, limit: int
                    ) -> tuple[list[CheckpointOut], bool]:
    """One checkpoint per job with an adapter (its best-validation step: what its adapter
    holds), newest first; `best` marks the task's pick."""
    rows = session.execute(
        select(Artifact.id, Artifact.created_at, Artifact.step, Job)
        .join(Job, Job.id == Artifact.job_id)
        .where(Artifact.task_id == task.id, Artifact.kind == "adapter")
        .order_by(Artifact.created_at.desc(), Artifact.id.desc())).all()
    train = {(job_id, step): loss for job_id, step, loss in session.execute(
        select(MetricPoint.job_id, MetricPoint.step, MetricPoint.loss).where(
            MetricPoint.task_id == task.id, MetricPoint.split == "train"))}
    accuracy = {(job_id, step): token_accuracy(numbers) for job_id, step, numbers in
                session.execute(select(MetricPoint.job_id, MetricPoint.step, MetricPoint.data).where(
                    MetricPoint.task_id == task.id, MetricPoint.split == "val"))}
    name = f"ft:{task.base_model}:{task.suffix or ''}:{task.id}"
    out = []
    for art_id, at, art_step, job in rows:
        step = job.best_step if job.best_step is not None else (art_step or job.last_step or 0)
        valid = finite_or_none(job.best_val_loss)
        out.append(CheckpointOut(
            id=art_id, created_at=unix(at), fine_tuned_model_checkpoint=f"{name}:{job.id}",
            fine_tuning_job_id=task.id, step_number=step, job_id=job.id,
            hyperparameters=job.config, best=job.id == task.best_job_id,
            metrics=CheckpointMetrics(
                step=step, train_loss=finite_or_none(train.get((job.id, step))), valid_loss=valid,
                full_valid_loss=valid, valid_mean_token_accuracy=accuracy.get((job.id, step)),
                full_valid_mean_token_accuracy=accuracy.get((job.id, step)))))
    return _page_after(out, after, limit)


def _page_after(items: list, after: str | None, limit: int) -> tuple[list, bool]:
    """The page after the item whose id is `after` (from the start without one), and whether
    more follow; an unknown cursor is a 404 naming `after`."""
    if after is not None:
        pos = next((i for i, item in enumerate(items) if item.id == after), None)
        if pos is None:
            raise unknown_cursor(after)
        items = items[pos + 1:]
    return items[:limit], len(items) > limit
