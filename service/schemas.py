"""Public API schemas (pydantic v2): what tenants send and what they get back.
Separate from the ORM models so no column a tenant should not see (hashes, paths) leaks."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from contract.methods import DEFAULT_METHOD, METHODS, Method
from contract.protocol import (
    BatchSize,
    LearningRate,
    LoraAlpha,
    LoraRank,
    TaskSettings,
)
from service.merged.states import MergeStateName
from service.tracking.schemas import IntegrationIn, IntegrationOut

T = TypeVar("T")


def finite(x: float | None) -> float | None:
    """JSON has no NaN/inf: a diverged loss is reported as null."""
    if x is None or not math.isfinite(x):
        return None
    return x


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Page(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool = False
    last_id: str | None = Field(default=None, description="Pass as `after` for the next page.")


class FileOut(BaseModel):
    """OpenAI's file object, plus what loraplex found in the file (format, records, digest)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int = Field(description="Unix seconds.")
    filename: str
    purpose: str
    status: Literal["processed", "error"] = Field(
        default="processed", description="Files are validated on upload: a stored file is "
                                         "processed (a bad one is refused with a 422).")
    status_details: str | None = None
    format: Literal["chat", "completion", "preference", "text", "csv", "adapter"] = Field(
        description="csv: a result file of a task (purpose fine-tune-results); adapter: a "
                    "PEFT LoRA adapter archive (purpose adapter), line_count its LoRA modules.")
    line_count: int
    sha256: str

    @field_validator("created_at", mode="before")
    @classmethod
    def _unix(cls, v: object) -> object:
        return int(v.timestamp()) if isinstance(v, datetime) else v


class ErrorDetail(BaseModel):
    type: str | None = Field(default=None, description="OpenAI-style class: "
                             "invalid_request_error, authentication_error, ...")
    code: str
    message: str
    param: str | None = Field(description="The request field at fault, when there is one.")


class ErrorOut(BaseModel):
    """Every error the API returns: ``{"error": {"type", "code", "message", "param"}}``."""

    error: ErrorDetail


class DeletedOut(BaseModel):
    id: str
    object: str
    deleted: bool = True


class ModelOut(BaseModel):
    id: str
    object: Literal["model"] = "model"
    family: str | None = None
    parameters: int | None = None
    gpus: int
    max_seq_len: int
    created: int = Field(default=0, description="Unix seconds (OpenAI's Model.created).")
    owned_by: str = Field(default="system", description="system: a registered base model; "
                                                      "else the tenant of a fine-tuned model.")


def _unique(values: list) -> list:
    if len(set(values)) != len(values):
        raise ValueError("values must be unique")
    return values


class _SharedSearchSpace(_In):
    learning_rate: Annotated[list[LearningRate], Field(min_length=1, max_length=64)] | Literal[
        "auto"] = Field(
        default=[1e-4],
        description='"auto": the base model\'s centre LoRA learning rate / 3, x1 and x3, the centre '
                    "from its family and parameter count (README: Learning rates of auto).")
    lora_rank: list[LoraRank] = Field(default=[8], min_length=1, max_length=64)
    lora_alpha: list[LoraAlpha] = Field(default=[16.0], min_length=1, max_length=64)
    batch_size: list[BatchSize] = Field(default=[8], min_length=1, max_length=64)

    @field_validator("*")
    @classmethod
    def _distinct(cls, v: list | str) -> list | str:
        return v if isinstance(v, str) else _unique(v)


# Lists per knob; every method's own knobs (contract.methods) after the shared ones.
SearchSpace = create_model(
    "SearchSpace", __base__=_SharedSearchSpace, __module__=__name__,
    __doc__="Lists per knob; the grid (cartesian product) is expanded into jobs. Each value has "
            "the bounds of the job's hyperparameter (contract.protocol.JobHyperparameters), the "
            "one contract.",
    **{k.name: (list[k.value_type()], Field(  # type: ignore[valid-type]
        default=[k.default], min_length=1, max_length=64,
        description=f"{k.description} A knob of the grid for method {m.name}; other methods "
                    "ignore it.")) for m in METHODS.values() for k in m.knobs})


class TaskCreate(TaskSettings):
    """A task: its base model, data and search space, and its settings (contract.protocol's
    TaskSettings, the one declaration of how a task trains)."""

    model_config = ConfigDict(extra="forbid")

    base_model: str = Field(min_length=1, max_length=200)
    training_file: str = Field(min_length=1, max_length=40)
    validation_file: str | None = Field(default=None, max_length=40)
    init_adapter_file: str | None = Field(
        default=None, min_length=1, max_length=40,
        description="A file uploaded with purpose `adapter` (a PEFT LoRA adapter) every job "
                    "starts from instead of a fresh adapter. It fixes the rank, alpha and "
                    "target modules: search_space.lora_rank / lora_alpha and target_modules "
                    "must be left out or equal to the adapter's; it must fit the base model.")
    method: Method = DEFAULT_METHOD  # type: ignore[valid-type]
    search_space: SearchSpace = Field(default_factory=SearchSpace)
    priority: int = Field(default=0, ge=0, le=10)
    suffix: str | None = Field(default=None, min_length=1, max_length=64,
                               pattern=r"^[A-Za-z0-9_.-]+$",
                               description="Part of the fine-tuned model's name.")
    metadata: dict[Annotated[str, Field(max_length=64)],
                   Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16, description="Up to 16 string pairs, yours to filter by.")
    integrations: list[IntegrationIn] | None = Field(
        default=None, max_length=8,
        description="Tracking: once the task ended, every job is written as a run to each W&B "
                    "project (`{\"type\": \"wandb\", \"wandb\": {\"project\": ...}}`, "
                    "OpenAI's shape) and MLflow server (`{\"type\": \"mlflow\", \"mlflow\": "
                    "{\"tracking_uri\": ...}}`) given; up to 8.")

    @field_validator("target_modules")
    @classmethod
    def _distinct_targets(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else _unique(v)

    def task_settings(self) -> TaskSettings:
        """The request's settings, as the task stores them."""
        return TaskSettings.model_validate(self.model_dump(include=set(TaskSettings.model_fields)))


class TaskUsage(BaseModel):
    """What a task used, beside what its dry run estimated (service.usage)."""

    trained_tokens: int | None = Field(
        description="Exact sequence tokens its jobs trained on (each training step's sequences, "
                    "no padding; a step redone after a resume counts once); null before it ran.")
    gpu_seconds: float | None = Field(
        description="GPU-seconds of its executors' wall time (a shared executor's split between "
                    "its tasks by tokens); null before it ran.")
    cost: float | None = Field(description="gpu_seconds / 3600 x price_per_gpu_hour.")
    estimated_tokens: int = Field(
        description="The dry run's trained_tokens: every job runs all its steps, tokens per "
                    "record estimated from the training file's size.")
    expected_tokens: int = Field(description="The dry run's estimate with early exit as set.")
    estimated_gpu_seconds: float | None = Field(
        description="The scheduler's duration estimate of its latest placement x its GPUs.")
    estimated_cost: float | None = None
    price_per_gpu_hour: float | None = Field(description="The operator's price (null: unknown "
                                                         "to this view).")


class TaskOut(TaskSettings):
    """A task as its tenant sees it: its settings (TaskSettings, max_seq_len resolved) and state."""

    model_config = ConfigDict(extra="ignore")

    max_seq_len: int
    id: str
    object: Literal["task"] = "task"
    state: str
    base_model: str
    method: str
    training_file: str
    validation_file: str | None
    search_space: dict
    priority: int
    num_jobs: int
    job_counts: dict[str, int]
    best_job_id: str | None
    error: dict | None
    attempt: int = Field(description="Current or last attempt (1 + failed placements).")
    planned_start: datetime | None = Field(
        default=None, description="When the scheduler plans (or planned) to start it.")
    planned_end: datetime | None = Field(default=None, description="Its estimated end.")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    suffix: str | None = None
    metadata: dict[str, str] | None = None
    result_files: list[str] = Field(
        default_factory=list, description="Once it ended with step metrics: the id of its "
                                          "result file (CSV, GET /v1/files/{id}/content).")
    usage: TaskUsage | None = None
    init_adapter_file: str | None = Field(
        default=None, description="The uploaded adapter its jobs started from (null: fresh).")
    integrations: list[IntegrationOut] = Field(
        default_factory=list, description="Its tracking integrations with each one's sync.")


class JobOut(BaseModel):
    id: str
    object: Literal["job"] = "job"
    task_id: str
    index: int
    hyperparameters: dict
    state: str
    exit_reason: str | None
    best_val_loss: float | None
    best_step: int | None
    last_step: int | None
    error: str | None
    has_adapter: bool
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    trained_tokens: int | None = Field(default=None, description="Exact sequence tokens it "
                                                                 "trained on (null: not run).")
    gpu_seconds: float | None = Field(default=None, description="Its share of GPU-seconds.")


class EventOut(BaseModel):
    id: int
    object: Literal["event"] = "event"
    task_id: str
    job_id: str | None
    level: str
    type: str
    message: str
    data: dict | None
    created_at: datetime


class EventPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[EventOut]
    has_more: bool
    last_id: int | None = Field(default=None, description="Pass as `after` to get newer events.")


class LossPoint(BaseModel):
    step: int
    loss: float | None


class ValPoint(LossPoint):
    token_accuracy: float | None = Field(
        default=None, description="SFT: mean token accuracy on the validation samples (the "
                                  "model's argmax equals the target, over target tokens); absent "
                                  "for DPO and points reported without it.")


class JobCurves(BaseModel):
    job_id: str
    index: int
    state: str
    train: list[LossPoint]
    val: list[ValPoint]


class MetricsOut(BaseModel):
    object: Literal["metrics"] = "metrics"
    task_id: str
    jobs: list[JobCurves]


class NodeOut(BaseModel):
    id: str
    name: str
    gpu_type: str
    gpu_count: int
    gpu_memory_bytes: int
    state: str
    last_heartbeat_at: datetime | None


class PlacementOut(BaseModel):
    id: str
    task_id: str
    node_id: str
    gpu_indices: list[int]
    planned_start: datetime
    planned_end: datetime
    state: str
    attempt: int
    tenant_id: str | None = None
    priority: int | None = None


class GpuPlanOut(BaseModel):
    """One GPU of a node: what runs there now and what is planned next, by planned start."""

    node_id: str
    node_name: str
    index: int
    running_task_id: str | None = Field(
        default=None, description="The task holding the GPU (published, claimed or running).")
    placements: list[PlacementOut]


class TenantUsageOut(BaseModel):
    tenant_id: str
    name: str
    running_tasks: int
    queued_tasks: int = Field(description="Tasks neither running nor finished.")
    gpus_in_use: int = Field(description="GPUs of the tenant's published/claimed/running "
                                         "placements.")
    max_gpus: int | None
    max_queued_tasks: int | None
    priority: int = Field(default=0, description="Operator-set tenant priority (0-10): weights "
                                                 "its tasks in the planner.")
    max_task_priority: int = Field(default=10, description="Highest priority a task of the "
                                   "tenant may ask for (operator-set, else the service default).")
    guaranteed_gpus: int | None = Field(default=None, description="Share reclaimed for the "
                                        "tenant from borrowers when it has waiting work.")
    borrowed_gpus: int = Field(default=0, description="GPUs in use beyond guaranteed_gpus (all "
                               "of gpus_in_use when no share is set): lent, reclaimable.")


class UnschedulableOut(BaseModel):
    task_id: str
    reason: str


class PlanInfoOut(BaseModel):
    at: datetime | None = Field(description="When the replan ran (null: none yet).")
    status: str = Field(description="optimal, feasible (CP-SAT), heuristic (list-scheduling "
                                    "fallback), empty (nothing to plan) or none (no replan yet).")
    makespan_s: int
    gap: float = Field(description="Relative optimality gap of the makespan (0 when optimal).")
    solve_time_s: float
    relaxed_waiting: bool = Field(description="Bounded waiting was dropped to find a plan.")
    unschedulable: list[UnschedulableOut]
    reasons: list[str] = Field(default_factory=list,
                               description="What triggered it (task_created, periodic, ...).")


class ClusterOut(BaseModel):
    object: Literal["cluster"] = "cluster"
    nodes: list[NodeOut]
    gpus_total: int
    gpus_up: int
    plan: list[PlacementOut]
    gpus: list[GpuPlanOut] = Field(default_factory=list,
                                   description="The plan per node and GPU.")
    tenants: list[TenantUsageOut] = Field(
        default_factory=list, description="Tenants with unfinished tasks or limits: usage "
                                          "against their limits.")
    queued_tasks: int
    running_tasks: int
    last_plan: PlanInfoOut | None = Field(
        default=None, description="The scheduler's last replan in this API process: status, "
                                  "makespan, gap, solve time, unschedulable tasks.")


class MergedModelOut(BaseModel):
    """A job's adapter merged into the task's base model: a plain transformers model directory
    (sharded safetensors in the base's dtype, config, tokenizer), as a tar archive once
    `succeeded`."""

    id: str
    object: Literal["merged_model"] = "merged_model"
    task_id: str
    job_id: str
    base_model: str
    state: MergeStateName
    error: str | None = Field(description="Why the merge failed (state failed)")
    dtype: str | None = Field(description="The weights' dtype: the base model's")
    bytes: int | None = Field(description="Size of the archive")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
