"""API shapes of /v1/fine_tuning/jobs: OpenAI's create body (each hyperparameter a value, a list
or "auto": service.api.openai_compat.create says what they mean) and its fine_tuning.job, event and
checkpoint objects and their pages, with loraplex's extensions."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from contract.methods import openai_methods
from service.schemas import TaskUsage
from service.tracking.schemas import IntegrationIn, IntegrationOut

Auto = Literal["auto"]
Num = Annotated[float, Field(allow_inf_nan=False)]
FloatKnob = Auto | Num | Annotated[list[Num], Field(min_length=1, max_length=64)]
IntKnob = Auto | int | Annotated[list[int], Field(min_length=1, max_length=64)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _SharedHyperparameters(_In):
    batch_size: IntKnob = "auto"
    learning_rate_multiplier: FloatKnob | None = None
    learning_rate: FloatKnob | None = None
    n_epochs: Auto | int = "auto"


# A method's own knobs (contract.methods: DPO's beta) for every method OpenAI offers
Hyperparameters = create_model(
    "Hyperparameters", __base__=_SharedHyperparameters, __module__=__name__,
    __doc__="A method's hyperparameters: OpenAI's names plus loraplex's (learning_rate, "
            "lora_rank, lora_alpha); each a value, a list of values (a search space) or "
            '"auto".',
    **{k.name: (FloatKnob, "auto") for m in openai_methods().values() for k in m.knobs},
    lora_rank=(IntKnob, "auto"), lora_alpha=(FloatKnob, "auto"))


class MethodParams(_In):
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)  # type: ignore[valid-type]


# OpenAI's method object: its type and one field per method type (supervised, dpo)
MethodIn = create_model(
    "MethodIn", __base__=_In, __module__=__name__,
    type=(Literal[tuple(openai_methods())], ...),  # type: ignore[valid-type]
    **{name: (MethodParams | None, None) for name in openai_methods()})


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
