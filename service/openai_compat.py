"""OpenAI's fine-tuning API over loraplex tasks: the request and response shapes of
/v1/fine_tuning/jobs and the conversions to and from a task. A fine-tuning job IS a task (same id).

Hyperparameters (per method, `method.supervised.hyperparameters` or `method.dpo.hyperparameters`;
the legacy top-level `hyperparameters` means supervised): each is a number, a list (loraplex's
extension: a search space, every value trained at once as one job each) or "auto". A knob left
out counts as "auto", as at OpenAI. "auto" means:

- learning_rate_multiplier (or learning_rate): search the model's centre LoRA learning rate /3, x1
  and x3 (the native search space's learning_rate "auto", service.learning_rates: the centre
  per model family and size from public LoRA calibrations, e.g. 1e-3 for a 1B model, 3e-4 for
  Llama-3.1-8B);
- lora_rank (extension): search [8, 16];
- lora_alpha (extension): 16, batch_size: 8, n_epochs: 1, beta (dpo): 0.1 (one value each: not
  searched).

So a job with no hyperparameters trains the default space of 3 learning rates x 2 ranks = 6
configurations at once (AUTO_SPACE) and returns the adapter with the best validation loss. A
multiplier given as a number is of BASE_LEARNING_RATE = 1e-4 (the multipliers shown for an auto
grid are its rates / 1e-4). `learning_rate` (absolute, extension) may be given instead of
learning_rate_multiplier. n_epochs is one number for the whole job (not a search space).

fine_tuned_model is `ft:<base model>:<suffix>:<job id>` once the job succeeded; GET
/v1/models/{that name} answers it and its adapter downloads at /v1/tasks/{job id}/adapter.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.states import TASK_SCHEDULED, TaskState
from service.errors import ApiError, invalid, loc_to_param
from service.models import TASK_TERMINAL, Artifact, Event, File, Job, MetricPoint, Task, Tenant
from service.pagination import page_query
from service.scheduler.estimator import EstimatorConfig
from service.schemas import TaskCreate, TaskOut, TaskUsage
from service.task_views import task_outs
from service.tracking.schemas import IntegrationIn, IntegrationOut

BASE_LEARNING_RATE = 1e-4
AUTO_SPACE: dict[str, list] = {  # learning rates: service.learning_rates, per model
    "lora_rank": [8, 16],
    "lora_alpha": [16.0],
    "batch_size": [8],
    "beta": [0.1],
}
AUTO_EPOCHS = 1
OPENAI_METHOD = {"sft": "supervised", "dpo": "dpo"}
NATIVE_METHOD = {v: k for k, v in OPENAI_METHOD.items()}

Auto = Literal["auto"]
Num = Annotated[float, Field(allow_inf_nan=False)]
FloatKnob = Auto | Num | Annotated[list[Num], Field(min_length=1, max_length=64)]
IntKnob = Auto | int | Annotated[list[int], Field(min_length=1, max_length=64)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hyperparameters(_In):
    """A method's hyperparameters: OpenAI's names plus loraplex's (learning_rate, lora_rank,
    lora_alpha); each a value, a list of values (a search space) or "auto"."""

    batch_size: IntKnob = "auto"
    learning_rate_multiplier: FloatKnob | None = None
    learning_rate: FloatKnob | None = None
    n_epochs: Auto | int = "auto"
    beta: FloatKnob = "auto"
    lora_rank: IntKnob = "auto"
    lora_alpha: FloatKnob = "auto"


class MethodParams(_In):
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)


class MethodIn(_In):
    type: Literal["supervised", "dpo"]
    supervised: MethodParams | None = None
    dpo: MethodParams | None = None


Metadata = dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]


class FineTuningJobCreate(_In):
    """POST /v1/fine_tuning/jobs: OpenAI's body, plus loraplex's task settings as extensions."""

    model: str = Field(min_length=1, max_length=200)
    training_file: str = Field(min_length=1, max_length=40)
    validation_file: str | None = Field(default=None, max_length=40)
    hyperparameters: Hyperparameters | None = Field(
        default=None, description="Legacy: the supervised method's hyperparameters.")
    method: MethodIn | None = None
    suffix: str | None = Field(default=None, min_length=1, max_length=64,
                               pattern=r"^[A-Za-z0-9_.-]+$")
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    metadata: Metadata | None = Field(default=None, max_length=16)
    integrations: list[IntegrationIn] | None = Field(
        default=None, max_length=8,
        description="OpenAI's W&B integration (`{\"type\": \"wandb\", \"wandb\": {\"project\": "
                    "...}}`) and loraplex's MLflow (`{\"type\": \"mlflow\", \"mlflow\": "
                    "{\"tracking_uri\": ...}}`): every job is written as a run once the job ended.")
    # loraplex's extensions (the native task's settings)
    validation_split: float | None = Field(default=None, gt=0, lt=0.5, allow_inf_nan=False)
    max_seq_len: int | None = Field(default=None, ge=16, le=1_048_576)
    early_exit: dict | None = None
    eval: dict | None = None
    target_modules: list[str] | None = None
    priority: int | None = Field(default=None, ge=0, le=10)

    @field_validator("model")
    @classmethod
    def _strip(cls, v: str) -> str:
        return v.strip()


def _values(value: Any, auto: list) -> list:
    if value == "auto":
        return list(auto)
    return list(value) if isinstance(value, list) else [value]


def method_params(body: FineTuningJobCreate) -> tuple[str, Hyperparameters, str]:
    """(native method, its hyperparameters, the param path they came from)."""
    if body.method is None:
        return "sft", body.hyperparameters or Hyperparameters(), "hyperparameters"
    if body.hyperparameters is not None:
        raise invalid("give hyperparameters in method.<type>.hyperparameters, not both there "
                      "and at the top level", param="hyperparameters")
    kind = body.method.type
    params = getattr(body.method, kind)
    other = "dpo" if kind == "supervised" else "supervised"
    if getattr(body.method, other) is not None:
        raise invalid(f"method.type is {kind!r} but method.{other} is given",
                      param=f"method.{other}")
    hp = params.hyperparameters if params is not None else Hyperparameters()
    return NATIVE_METHOD[kind], hp, f"method.{kind}.hyperparameters"


def search_space(method: str, hp: Hyperparameters, where: str) -> dict[str, list | str]:
    """The native search space of these hyperparameters ("auto" expanded, lists kept; the
    learning rate's "auto" stays "auto": the create centres it on the model, tasks.resolve_auto)."""
    if hp.learning_rate is not None and hp.learning_rate_multiplier is not None:
        raise invalid("give learning_rate or learning_rate_multiplier, not both",
                      param=f"{where}.learning_rate")
    if hp.learning_rate not in (None, "auto"):
        rates: list | str = [float(f"{r:.6g}") for r in _values(hp.learning_rate, [])]
    elif hp.learning_rate is None and hp.learning_rate_multiplier not in (None, "auto"):
        rates = [float(f"{m * BASE_LEARNING_RATE:.6g}")
                 for m in _values(hp.learning_rate_multiplier, [])]
    else:
        rates = "auto"
    space: dict[str, list | str] = {
        "learning_rate": rates, "lora_rank": _values(hp.lora_rank, AUTO_SPACE["lora_rank"]),
        "lora_alpha": _values(hp.lora_alpha, AUTO_SPACE["lora_alpha"]),
        "batch_size": _values(hp.batch_size, AUTO_SPACE["batch_size"])}
    if method == "dpo":
        space["beta"] = _values(hp.beta, AUTO_SPACE["beta"])
    elif hp.beta != "auto":
        raise invalid("beta is a dpo hyperparameter", param=f"{where}.beta")
    return space


NATIVE_PARAM = {"base_model": "model", "search_space.learning_rate": "learning_rate_multiplier",
                "search_space.lora_rank": "lora_rank", "search_space.lora_alpha": "lora_alpha",
                "search_space.batch_size": "batch_size", "search_space.beta": "beta",
                "search_space": "", "epochs": "n_epochs"}


def openai_param(param: str | None, where: str) -> str | None:
    """The OpenAI-side name of a native task parameter (an error names what the client sent)."""
    if param is None or param not in NATIVE_PARAM:
        return param
    name = NATIVE_PARAM[param]
    if param == "base_model":
        return name
    return f"{where}.{name}" if name else where


def to_task_create(body: FineTuningJobCreate) -> tuple[TaskCreate, str]:
    """The native task of a fine-tuning job create, and where its hyperparameters were given.
    4xx naming the OpenAI param for anything wrong."""
    method, hp, where = method_params(body)
    space = search_space(method, hp, where)
    native: dict[str, Any] = {
        "base_model": body.model, "training_file": body.training_file,
        "validation_file": body.validation_file, "method": method, "search_space": space,
        "epochs": AUTO_EPOCHS if hp.n_epochs == "auto" else hp.n_epochs,
        "suffix": body.suffix, "metadata": body.metadata, "integrations": body.integrations}
    if body.seed is not None:
        native["seed"] = body.seed
    for name in ("validation_split", "max_seq_len", "early_exit", "eval", "target_modules",
                 "priority"):
        value = getattr(body, name)
        if value is not None:
            native[name] = value
    try:
        return TaskCreate.model_validate(native), where
    except ValidationError as exc:
        first = exc.errors()[0]
        param = openai_param(loc_to_param(first.get("loc", ())), where)
        raise invalid(f"{param or 'request'}: {first.get('msg', 'invalid value')}",
                      param=param) from exc


def remap_error(exc: ApiError, where: str) -> ApiError:
    exc.param = openai_param(exc.param, where)
    return exc


# ----- responses ---------------------------------------------------------------------------------
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
    if method == "dpo":
        out["beta"] = _one_or_list(space.get("beta", [0.1]))
    return out


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class FineTuningJobOut(BaseModel):
    """OpenAI's fine_tuning.job object; loraplex adds num_jobs, job_counts, best_job_id."""

    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None = None
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    hyperparameters: dict
    model: str
    organization_id: str
    result_files: list[str] = Field(
        default_factory=list, description="Once it ended with step metrics: its result file "
                                          "(CSV of step metrics, GET /v1/files/{id}/content).")
    seed: int
    status: str
    trained_tokens: int | None = Field(
        default=None, description="Once it ended: the exact sequence tokens its jobs trained "
                                  "on (usage.trained_tokens); null before.")
    training_file: str
    validation_file: str | None = None
    estimated_finish: int | None = None
    integrations: list[IntegrationOut] | None = Field(
        default=None, description="As created (null: none), each with its sync status.")
    metadata: dict[str, str] | None = None
    method: dict
    suffix: str | None = None
    num_jobs: int = Field(description="loraplex: configurations trained (the search space).")
    job_counts: dict[str, int] = Field(default_factory=dict)
    best_job_id: str | None = None
    usage: TaskUsage | None = Field(default=None, description="loraplex: tokens, GPU-seconds and "
                                                              "cost beside the estimate.")


class FineTuningJobPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJobOut]
    has_more: bool


class JobEventOut(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict | None = None
    type: Literal["message", "metrics"]


class JobEventPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobEventOut]
    has_more: bool


class CheckpointMetrics(BaseModel):
    step: float | None = None
    train_loss: float | None = None
    valid_loss: float | None = None
    valid_mean_token_accuracy: float | None = None
    full_valid_loss: float | None = None
    full_valid_mean_token_accuracy: float | None = None


class CheckpointOut(BaseModel):
    """OpenAI's fine_tuning.job.checkpoint: here each job's adapter (its best-validation step);
    loraplex adds job_id, hyperparameters and best (the job's adapter is the task's pick)."""

    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int
    job_id: str
    hyperparameters: dict
    best: bool


class CheckpointPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[CheckpointOut]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


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


def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


# ----- views of tasks ----------------------------------------------------------------------------
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
        if task.state == "failed" and task.error:
            error = JobError(code=str(task.error.get("code", "task_failed")),
                             message=str(task.error.get("message", "training failed")),
                             param=task.error.get("param"))
        out.append(FineTuningJobOut(
            id=task.id, created_at=unix(task.created_at), error=error,
            fine_tuned_model=fine_tuned_model_name(task), finished_at=unix(task.finished_at),
            hyperparameters={k: v for k, v in hp.items() if k != "beta"}, model=task.base_model,
            organization_id=task.tenant_id, seed=view.seed, status=task.state,
            trained_tokens=(_trained_tokens(view, task, mine, files) if terminal else None),
            result_files=view.result_files, usage=view.usage,
            training_file=task.training_file_id, validation_file=task.validation_file_id,
            estimated_finish=(unix(view.planned_end) if task.state in TASK_SCHEDULED else None),
            metadata=task.meta, method=method, suffix=task.suffix, num_jobs=view.num_jobs,
            integrations=view.integrations or None,
            job_counts=view.job_counts, best_job_id=task.best_job_id))
    return out


def avg_tokens_per_sample(task_max_seq_len: int, file: File | None) -> float:
    """Tokens per training record, from the file's bytes per line (the scheduler's estimate)."""
    if file is None or not file.line_count:
        return float(task_max_seq_len)
    per_line = file.bytes / file.line_count / EstimatorConfig().bytes_per_token
    return max(1.0, min(float(task_max_seq_len), per_line))


def _trained_tokens(view: TaskOut, task: Task, jobs: list[Job], files: dict[str, File]) -> int:
    """The exact count once the task's executors reported it; the estimate for tasks trained
    before they did (no step carries tokens)."""
    if view.usage is not None and view.usage.trained_tokens:
        return view.usage.trained_tokens
    return trained_tokens(task, jobs, files.get(task.training_file_id))


def trained_tokens(task: Task, jobs: list[Job], file: File | None) -> int:
    """Tokens trained (an estimate from the file's bytes per record): each job's steps x its
    batch size x tokens per record."""
    per_sample = avg_tokens_per_sample(task.settings["max_seq_len"], file)
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
    more follow; an unknown cursor is a 422 naming `after`."""
    if after is not None:
        pos = next((i for i, item in enumerate(items) if item.id == after), None)
        if pos is None:
            raise invalid(f"unknown cursor {after!r}", param="after")
        items = items[pos + 1:]
    return items[:limit], len(items) > limit
