"""Message shapes between the service and the GPU worker daemons (internal API + Redis queue).
Imports only pydantic and the stdlib (with torch + transformers alone, its plain stand-in
contract._plain_models), so the node agent and the trainer use it without the service.

Flow: the worker POSTs NodeRegister to /internal/v1/nodes, then a Heartbeat to
/internal/v1/nodes/{node_id}/heartbeat every few seconds (the reply lists tasks to cancel).
It pops placement ids from the RQ queue ``node_queue_name(node_id)`` (RQ job function name
PLACEMENT_FUNC, job id placement_job_id, single positional argument: the placement id), claims
the placement with POST /internal/v1/placements/{id}/claim (reply: PlacementSpec; a repeated
claim by the same node returns the same spec), downloads files and checkpoints from the URLs in the spec,
then reports with EventBatch, MetricBatch, JobStateUpdate, artifact uploads (multipart:
a ``meta`` form field holding ArtifactMeta JSON plus one ``files`` part per file) and
finally TaskFinished or TaskFailed. Every report is safe to retry, and every report names its
placement (= attempt): the service stores only the reports of a task's current live placement
(409 otherwise, which a daemon drops), so nothing of a superseded attempt or of a finished or
cancelled task is ever stored. The heartbeat reply names the placements to stop.
All internal calls carry ``Authorization: Bearer <worker token>``. A heartbeat answered 404
means the service forgot the node: register again. A daemon that stops cleanly (drained)
POSTs NodeDeregister to /internal/v1/nodes/{node_id}/deregister: the node goes down, its
queue is emptied and the scheduler replans without it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Literal

from contract.states import EXIT_REASONS, JOB_STATES, NODE_STATES, values

try:
    from pydantic import BaseModel, ConfigDict, Field, model_validator
except ImportError:  # torch + transformers alone (a bare GPU image): same shapes, no validation
    from contract._plain_models import (  # type: ignore[assignment]
        BaseModel,
        ConfigDict,
        Field,
        model_validator,
    )

PLACEMENT_FUNC = "worker.daemon.run_placement"
CANCEL_CHANNEL = "loraplex:cancel"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
INT32_MAX = 2**31 - 1


_PATH = re.compile(r"(?:[A-Za-z]:)?[\\/](?:[\w.~@+-]+[\\/])+[\w.~@+-]*")
# What else names the server's insides: URLs (hosts, credentials), Windows paths, relative paths
# to source or data files, IP addresses.
_HIDDEN = (
    (re.compile(r"\b[A-Za-z][\w+.-]*://\S+"), "<url>"),
    (re.compile(r"\b[A-Za-z]:\\[^\s'\"]*"), "<path>"),
    (_PATH, "<path>"),
    (re.compile(r"\b[\w.-]+(?:/[\w.-]+)*/[\w.-]+\.(?:py|pyc|so|json|jsonl|pt|bin|safetensors"
                r"|log|txt|yaml|yml|cfg|ini|sh|cu|cpp|c|h)\b"), "<path>"),
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"), "<address>"),
)


def tenant_safe(text: str, limit: int = 500) -> str:
    """An error message fit for a tenant: its first line only (no traceback), every filesystem
    path replaced by <path> (absolute, home, Windows, or a relative path to a file), URLs by
    <url>, IP addresses by <address>, at most `limit` characters. Workers and the service both apply it."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if first.startswith("Traceback"):
        first = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")
    for pattern, mask in _HIDDEN:
        first = pattern.sub(mask, first)
    return first[:limit]


def node_queue_name(node_id: str) -> str:
    """Name of the RQ queue that carries the placements of one node."""
    return f"loraplex:node:{node_id}"


def placement_job_id(placement_id: str) -> str:
    """Id of the RQ job that carries a placement on its node's queue (one per placement)."""
    return f"placement-{placement_id}"


def pause_key(placement_id: str) -> str:
    """Redis key set (with a TTL) when a placement must checkpoint at a step boundary and stop,
    reporting as usual (pause, preemption): the heartbeat reply's pause_placement_ids says it
    too, durably."""
    return f"loraplex:pause:{placement_id}"


def cancel_key(placement_id: str) -> str:
    """Redis key set (with a TTL) when a placement (an attempt) must stop; the id is also
    published on CANCEL_CHANNEL."""
    return f"loraplex:cancel:{placement_id}"


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


# A GPU's index on its node; strict (a node's messages take the types they document).
GpuIndex = Annotated[int, Field(ge=0, lt=64, strict=True)]


class NodeRegister(_Msg):
    name: str = Field(min_length=1, max_length=200, description="Stable node name (hostname).")
    gpu_type: str = Field(min_length=1, max_length=64, description="e.g. 'H100-80GB', 'cpu'.")
    # strict: a JSON true or 8.0 is not a count (the documented type is integer)
    gpu_count: int = Field(ge=0, le=64, strict=True)
    gpu_memory_bytes: int = Field(ge=0, strict=True, description="Memory of one GPU in bytes.")
    meta: dict | None = Field(default=None, description="Versions, driver, free-form.")


class NodeRegistered(_Msg):
    node_id: str
    queue: str = Field(description="RQ queue name to pull placements from.")
    heartbeat_interval_s: float


class NodeDeregister(_Msg):
    """Sent once by a daemon that shuts down cleanly (drained): the node leaves the plan now
    instead of after the heartbeat timeout."""

    reason: str = Field(default="drained", max_length=500)


class NodeDeregistered(_Msg):
    node_id: str
    state: Literal[values(NODE_STATES)]
    superseded_placement_ids: list[str] = Field(
        default_factory=list, description="Published, unclaimed placements taken off the node.")
    requeued_task_ids: list[str] = Field(
        default_factory=list,
        description="Tasks that still ran there, back in the queue to resume elsewhere.")


def colocation_key(base_model: str, method: str, max_seq_len: int,
                   target_modules: list[str] | None) -> str:
    """What two tasks must share to train on one executor (trainer.executor.HOST_FIELDS that a
    task sets; the rest are the node's): the scheduler joins a task to a warm executor only with
    the same key, and the daemon attaches it only then."""
    targets = ",".join(sorted(target_modules)) if target_modules else "*"
    return f"{base_model}|{method}|{max_seq_len}|{targets}"


class ExecutorReport(_Msg):
    """A shared executor process on a node (co-location, DESIGN.md): one base model on one GPU
    set, hosting the placements (tasks) attached to it. Joining it needs no free GPU: the
    scheduler may place a task with the same colocation_key on exactly these GPUs."""

    key: str = Field(max_length=2000, description="colocation_key of the tasks it can host.")
    gpu_indices: list[GpuIndex] = Field(max_length=64)
    placement_ids: list[str] = Field(default_factory=list, max_length=1000,
                                     description="Placements it hosts now (empty: warm, idle).")
    free_rows: int = Field(ge=0, strict=True, description="Sequence rows of its admission budget that no "
                                             "hosted job uses (what another task's jobs can take).")
    total_rows: int = Field(ge=0, strict=True,
                            description="Its whole admission budget in sequence rows.")
    queued_jobs: int = Field(default=0, ge=0, strict=True,
                             description="Hosted jobs waiting for rows.")


class Heartbeat(_Msg):
    running_placement_ids: list[str] = Field(default_factory=list)
    gpu_utilization: list[Annotated[float, Field(strict=True, allow_inf_nan=False)]] | None = None
    executors: list[ExecutorReport] = Field(
        default_factory=list, description="The node's shared executors (co-location).")


class HeartbeatResponse(_Msg):
    node_id: str
    state: Literal[values(NODE_STATES)]
    cancelled_placement_ids: list[str] = Field(
        default_factory=list,
        description="Placements (attempts) this node runs that must stop now: cancelled, "
                    "superseded or failed by the service. Never a bare task id, so a new attempt "
                    "of the same task on the same node keeps running.")
    pause_placement_ids: list[str] = Field(
        default_factory=list,
        description="Placements this node runs that must checkpoint at a step boundary and stop "
                    "(pause or preemption), still reporting everything up to their stop (a "
                    "retryable 'executor stopped' failure), which the service accepts.")


# ----- the task's settings: ONE set of bounds, checked at create (422) and consumed by the trainer
# as they are (trainer.early_exit and trainer.executor read these classes, no second config).
Finite = Annotated[float, Field(allow_inf_nan=False)]
LearningRate = Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)]
LoraRank = Annotated[int, Field(ge=1, le=1024)]
LoraAlpha = Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]
BatchSize = Annotated[int, Field(ge=1, le=4096)]
DpoBeta = Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)]
Method = Literal["sft", "dpo"]
GRID_KNOBS = ("learning_rate", "lora_rank", "lora_alpha", "batch_size")
DPO_GRID_KNOBS = (*GRID_KNOBS, "beta")  # beta multiplies dpo grids only


def grid_knobs(method: str) -> tuple[str, ...]:
    """The hyperparameters a task's search space multiplies into jobs, for its method."""
    return DPO_GRID_KNOBS if method == "dpo" else GRID_KNOBS


class EarlyExitSettings(_Msg):
    """Loss-aware early exit knobs; defaults from DESIGN.md (ALTO). Frozen: the trainer shares
    one instance between every job's monitor."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    window: int = Field(default=2, ge=2, le=1000,
                        description="w: points in the slope window (a slope needs two).")
    patience: int = Field(default=2, ge=1, le=1000, description="p: consecutive evals to trigger.")
    tau_gap: float = Field(default=0.1, ge=0, le=1000, allow_inf_nan=False,
                           description="Overfitting threshold on (val - ema_train) / ema_train.")
    tau_slope: float = Field(default=0.001, ge=0, le=1000, allow_inf_nan=False,
                             description="Divergence threshold on both loss slopes.")
    warmup_fraction: float = Field(default=0.05, ge=0, lt=1, allow_inf_nan=False,
                                   description="Share of a job's steps before the ranking.")
    keep_fraction: float = Field(default=0.25, gt=0, le=1, allow_inf_nan=False,
                                 description="Share of the configurations the ranking keeps.")
    ema_alpha: float = Field(default=0.1, gt=0, le=1, allow_inf_nan=False,
                             description="EMA factor of the train loss (1 = no smoothing).")
    min_steps: int = Field(
        default=0, ge=0, le=10_000_000,
        description="Grace period: no job is stopped as diverging or overfitting before it has "
                    "trained this many steps (the detectors watch, the decision waits; a "
                    "non-finite loss still stops it at once). Ray Tune's ASHA grace_period.")

    def warmup_steps(self, total_steps: int) -> int:
        """Warmup length of a job with `total_steps` steps: ceil(fraction * total), in [1, total]."""
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        # the epsilon keeps float products like 0.05 * 100 = 5.000000000000001 from rounding up
        return min(total_steps, max(1, math.ceil(self.warmup_fraction * total_steps - 1e-9)))


SAMPLE_CADENCE = 1024  # the default: evaluate every 1024 samples a job trained on
STEP_CADENCE = 50  # the step cadence when a request nulls the sample one without naming steps


class EvalSettings(_Msg):
    """When each job evaluates, and on how many validation samples. By default every 1024
    samples it trained on; each evaluation uses validation samples in proportion to the samples
    the job trained on since its last one (`eval_samples_per_trained`, 0.25: 256 per 1024; one
    costs about 0.3 of a training sample, so evaluation stays near 8% of a job's time), never
    fewer than `eval_min_samples` nor more than the evaluation set (`eval_max_samples`). Every
    evaluation takes a leading subset of one fixed order, so jobs compare on the same samples;
    the warmup ranking evaluates every job on the same subset, and a job's last evaluation is
    sized by all it trained on. One cadence is in use and shown: eval_every_samples, or
    eval_every_steps when a request names it alone (the other is null)."""

    eval_every_steps: int | None = Field(
        default=None, ge=1, le=1_000_000,
        description="Evaluate a job every this many of its steps instead of by samples: the "
                    "cadence when eval_every_samples is null or left out while this is given; "
                    "null while eval_every_samples is in use (which wins when both are given). "
                    f"{STEP_CADENCE} when both are null.")
    eval_max_samples: int | None = Field(
        default=256, ge=1, le=1_000_000,
        description="The evaluation set: the first N of the held-out set (in a fixed "
                    "shuffled order, the same for every job); null: all of them. No evaluation "
                    "uses more.")
    eval_samples_per_trained: float | None = Field(
        default=0.25, gt=0, le=1000, allow_inf_nan=False,
        description="Validation samples an evaluation uses per sample the job trained on since "
                    "its last evaluation (its last one: per sample trained in all), between "
                    "eval_min_samples and the evaluation set; null: the whole evaluation set "
                    "every time.")
    eval_min_samples: int = Field(
        default=64, ge=1, le=1_000_000,
        description="The fewest validation samples of any evaluation (or the whole evaluation "
                    "set when smaller).")
    eval_every_samples: int | None = Field(
        default=SAMPLE_CADENCE, ge=1, le=1_000_000_000,
        description="Evaluate a job each time it has trained on this many more samples "
                    "(steps x its batch size), so jobs of every batch size evaluate equally "
                    "often per sample; null: every eval_every_steps of the job's steps "
                    "(also when eval_every_steps is given without this field).")

    @model_validator(mode="before")
    @classmethod
    def _one_cadence(cls, data: object) -> object:
        # Exactly one cadence is set, the one the trainer uses (trainer.colocate's cadence_due):
        # eval_every_steps named alone means that step cadence (as before the sample default);
        # otherwise samples, and eval_every_steps shows null. Stored documents that hold both
        # (tasks created before issue 43) read back the same way.
        if not isinstance(data, dict):
            return data
        steps = data.get("eval_every_steps")
        if steps is not None and "eval_every_samples" not in data:
            return {**data, "eval_every_samples": None}
        samples = data.get("eval_every_samples", SAMPLE_CADENCE)
        if samples is not None:
            return {**data, "eval_every_steps": None, "eval_every_samples": samples}
        return {**data, "eval_every_steps": STEP_CADENCE if steps is None else steps}


class TaskSettings(_Msg):
    """How a task trains, declared once: the API's create schema extends it, the database keeps
    it as one document (tasks.settings), the placement carries it and the executor holds it. A
    new setting is a field here and the code that reads it."""

    validation_split: float = Field(
        default=0.1, gt=0, lt=0.5, allow_inf_nan=False,
        description="Held-out share when no validation_file.")
    epochs: int = Field(default=1, ge=1, le=100)
    max_seq_len: int | None = Field(default=None, ge=16, le=1_048_576,
                                    description="Defaults to min(2048, the model's limit).")
    seed: int = Field(default=0, ge=0, le=INT32_MAX)
    early_exit: EarlyExitSettings = Field(default_factory=EarlyExitSettings)
    eval: EvalSettings = Field(default_factory=EvalSettings)
    target_modules: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = Field(
        default=None, max_length=32,
        description="Linear layers to adapt (e.g. q_proj, v_proj; qkv_proj on Phi-3); each must "
                    "exist in the base model's family. Null: all of the family's linears.")


class JobHyperparameters(_Msg):
    """One configuration of the search space: every knob a job of any method carries."""

    learning_rate: LearningRate
    lora_rank: LoraRank
    lora_alpha: LoraAlpha
    batch_size: BatchSize
    beta: DpoBeta | None = Field(default=None, description="DPO only: pull to the base model.")


class JobSpec(_Msg):
    job_id: str
    index: int
    state: str = Field(description="Current state; terminal jobs are not retrained on resume.")
    hyperparameters: JobHyperparameters


class PlacementSpec(_Msg):
    """Everything an executor needs to run one task on the GPUs of one placement."""

    task_id: str
    placement_id: str
    attempt: int
    node_id: str
    gpu_indices: list[int]
    method: Method
    base_model: str
    base_model_path: str
    training_file_id: str
    training_file_url: str = Field(description="Path under the service URL, GET with worker token.")
    training_file_format: str
    validation_file_id: str | None = None
    validation_file_url: str | None = None
    init_adapter_file_id: str | None = Field(
        default=None, description="An uploaded PEFT adapter archive every job starts from.")
    init_adapter_url: str | None = Field(
        default=None, description="Its archive (.tar.gz or .zip): path under the service URL, "
                                  "GET with worker token.")
    settings: TaskSettings = Field(description="The task's settings, max_seq_len resolved.")
    jobs: list[JobSpec]
    resume_checkpoint_artifact_id: str | None = None
    resume_checkpoint_files: list[str] = Field(
        default_factory=list, description="URLs of the checkpoint's files (worker token).")


class EventIn(_Msg):
    type: str = Field(min_length=1, max_length=48, description="e.g. 'job_exited', 'log'.")
    message: str = Field(default="", max_length=10_000)
    level: Literal["debug", "info", "warning", "error"] = "info"
    job_id: str | None = None
    data: dict | None = None
    client_key: str | None = Field(
        default=None, max_length=128, description="Retry key: a second post is ignored.")
    created_at: datetime | None = None


class EventBatch(_Msg):
    placement_id: str = Field(description="The attempt that reports (fencing, as for every report).")
    events: list[EventIn] = Field(max_length=1000)


class MetricPointIn(_Msg):
    job_id: str
    step: int = Field(ge=0, le=INT32_MAX)
    split: Literal["train", "val"]
    loss: float
    data: dict | None = Field(default=None, description="lr, tokens, grad norm, ...")
    tokens: int | None = Field(
        default=None, ge=0, le=2**53,
        description="Train points: the exact sequence tokens (no padding; DPO: both sequences "
                    "of each pair) this step of the job trained on; the job's usage.")
    gpu_seconds: float | None = Field(
        default=None, ge=0, le=1e9, allow_inf_nan=False,
        description="Train points: the job's share of the executor's wall time since its "
                    "previous step (times its GPUs), split between the step's jobs by tokens.")


class MetricBatch(_Msg):
    """Points already stored (same job, step, split) are ignored, so a retry is a no-op."""

    placement_id: str = Field(description="The attempt that reports (fencing).")
    points: list[MetricPointIn] = Field(max_length=10_000)


class JobStateUpdate(_Msg):
    placement_id: str = Field(description="The attempt that reports (fencing).")
    state: Literal[values(JOB_STATES)]
    exit_reason: Literal[values(EXIT_REASONS)] | None = None
    best_val_loss: float | None = None
    best_step: int | None = Field(default=None, ge=0, le=INT32_MAX)
    last_step: int | None = Field(default=None, ge=0, le=INT32_MAX)
    error: str | None = Field(default=None, max_length=10_000)


class ArtifactMeta(_Msg):
    """Metadata part of an artifact upload. kind=adapter needs job_id and the two PEFT files;
    kind=checkpoint is per task (step says where training resumes). Same key = same artifact."""

    kind: Literal["adapter", "checkpoint"]
    placement_id: str = Field(description="The attempt that reports (fencing).")
    job_id: str | None = None
    step: int | None = Field(default=None, ge=0, le=INT32_MAX)
    key: str | None = Field(
        default=None, max_length=180,
        description="Checkpoints only: stored as 'checkpoint:<key or step>'. An adapter's key is "
                    "always 'adapter:<job_id>' (one per job; a new upload replaces it).")
    meta: dict | None = None


class ArtifactOut(_Msg):
    artifact_id: str
    kind: str
    key: str
    files: list[dict]


class TaskFinished(_Msg):
    placement_id: str
    best_job_id: str | None = Field(
        default=None, description="Else the service picks the lowest best_val_loss.")
    summary: dict | None = None


class TaskFailed(_Msg):
    placement_id: str
    error: str = Field(max_length=10_000, description="Short and safe: shown to the tenant "
                                                      "(no traceback, no server path).")
    detail: str | None = Field(default=None, max_length=20_000,
                               description="Operator-only diagnostics (traceback); never shown "
                                           "to the tenant.")
    retryable: bool = Field(
        default=True, description="Node/infra failure: retry from the latest checkpoint.")


class ClaimRequest(_Msg):
    node_id: str


class Stored(_Msg):
    stored: int = Field(description="How many items were new (retries count 0).")


class TaskAck(_Msg):
    task_id: str
    state: str
    best_job_id: str | None = None


class ThroughputReport(_Msg):
    """What an executor measured on its GPUs, for the scheduler's duration estimates of the next
    task on the same model (stored per base model, the node's GPU type, sequence length and
    batch mix)."""

    placement_id: str
    gpus: int = Field(ge=1, le=64)
    seq_len: int = Field(ge=1, le=INT32_MAX)
    batch_sizes: list[int] = Field(min_length=1, max_length=4096,
                                   description="Batch size of each job trained in the window.")
    tokens_per_s: float = Field(gt=0, allow_inf_nan=False,
                                description="Real (unpadded) training tokens per second.")
    samples_per_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    memory_k0: float | None = Field(default=None, allow_inf_nan=False,
                                    description="Memory model M(B) = k0 + k1 * B * L, bytes.")
    memory_k1: float | None = Field(default=None, allow_inf_nan=False)


class ExecutorTimings(_Msg):
    """Where an executor's wall time went for one task, sent when its run of the task ended
    (finished or paused): the service keeps it as the task's `timings` event, one per attempt."""

    placement_id: str
    wall_s: float = Field(ge=0, allow_inf_nan=False, description=(
        "The task's own wall: since it joined the executor (a warm shared executor's task), or since "
        "the executor started (the tasks it started with: their wall includes the model load)."))
    first_step_s: float | None = Field(
        default=None, ge=0, allow_inf_nan=False,
        description="From the same origin to the end of the task's first training step.")
    phases: dict[str, float] = Field(
        default_factory=dict, max_length=64,
        description="Seconds per phase (load, profile, train, eval, park, resume, checkpoint, "
                    "export, idle, ...).")
    details: dict[str, int | float | bool | str | None] = Field(
        default_factory=dict, max_length=64,
        description="What else explains them: profile reused, steps with and without "
                    "activation recompute, the shared executor's own wall (host_wall, seconds), ...")


@dataclass(frozen=True)
class Report:
    """A placement's report sent as one message: the type of its spool record, the contract's
    message, and the route it is POSTed to under /internal/v1 ({task_id} filled in). The spool,
    the forwarder and the service client dispatch on this table; a new report is an entry here,
    its message above and the service route that consumes it."""

    kind: str
    message: type[_Msg]
    path: str


REPORTS: dict[str, Report] = {r.kind: r for r in (
    Report("throughput", ThroughputReport, "/tasks/{task_id}/throughput"),
    Report("timings", ExecutorTimings, "/tasks/{task_id}/timings"),
    Report("finished", TaskFinished, "/tasks/{task_id}/finished"),
    Report("failed", TaskFailed, "/tasks/{task_id}/failed"),
)}
