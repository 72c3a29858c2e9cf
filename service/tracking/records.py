"""What a tracking run is made of: an ended task, its jobs and their step metrics as PostgreSQL
holds them (read through service.result_files.step_metrics, the read its result file is made
from), as plain values a writer can use without a session."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy.orm import Session

from service.models import Task
from service.result_files import step_metrics

# The step metrics a run's history holds, named as in the task's result file.
METRICS = ("train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy")


def millis(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp() * 1000)


@dataclass(frozen=True)
class Step:
    step: int
    at: datetime
    metrics: dict[str, float]  # finite values only (a diverged NaN loss is left out)


@dataclass(frozen=True)
class JobRecord:
    id: str
    index: int
    hyperparameters: dict
    state: str
    exit_reason: str | None
    best: bool  # the task's best job (its adapter is the task's)
    best_val_loss: float | None
    best_step: int | None
    last_step: int | None
    started_at: datetime | None
    finished_at: datetime | None
    steps: list[Step] = field(default_factory=list)

    @property
    def summary(self) -> dict:
        """The job's outcome, as a run's final values."""
        out: dict = {"state": self.state, "exit_reason": self.exit_reason, "best": self.best,
                     "best_step": self.best_step, "last_step": self.last_step}
        if self.best_val_loss is not None and math.isfinite(self.best_val_loss):
            out["best_valid_loss"] = self.best_val_loss
        return out


@dataclass(frozen=True)
class TaskRecord:
    id: str
    tenant_id: str
    base_model: str
    method: str
    epochs: int
    max_seq_len: int
    seed: int
    state: str
    suffix: str | None
    best_job_id: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    jobs: list[JobRecord]

    @property
    def settings(self) -> dict:
        """The task's settings every job shares (beside the job's own hyperparameters)."""
        return {"base_model": self.base_model, "method": self.method, "epochs": self.epochs,
                "max_seq_len": self.max_seq_len, "seed": self.seed, "task_id": self.id}

    def params(self, job: JobRecord) -> dict:
        """A job's run parameters: its hyperparameters, its index and the task's settings."""
        return {**job.hyperparameters, "job_index": job.index, "job_id": job.id,
                **self.settings}


def load_task(session: Session, task_id: str) -> TaskRecord:
    """The task as its tracking runs show it (jobs by index, steps in order)."""
    task = session.get(Task, task_id)
    assert task is not None
    jobs, points = step_metrics(session, task)
    steps: dict[str, list[Step]] = {}
    for (_, step, job_id), row in sorted(points.items()):
        values = {k: float(row[k]) for k in METRICS
                  if row.get(k) is not None and math.isfinite(row[k])}
        steps.setdefault(job_id, []).append(Step(step=step, at=row["at"], metrics=values))
    return TaskRecord(
        id=task.id, tenant_id=task.tenant_id, base_model=task.base_model, method=task.method,
        epochs=task.settings["epochs"], max_seq_len=task.settings["max_seq_len"],
        seed=task.settings["seed"], state=task.state,
        suffix=task.suffix, best_job_id=task.best_job_id, created_at=task.created_at,
        started_at=task.started_at, finished_at=task.finished_at,
        jobs=[JobRecord(id=j.id, index=j.index, hyperparameters=dict(j.config or {}),
                        state=j.state, exit_reason=j.exit_reason, best=j.id == task.best_job_id,
                        best_val_loss=j.best_val_loss, best_step=j.best_step,
                        last_step=j.last_step, started_at=j.started_at,
                        finished_at=j.finished_at, steps=steps.get(j.id, []))
              for j in sorted(jobs.values(), key=lambda j: j.index)])
