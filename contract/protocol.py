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

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Literal

from contract.base import (  # noqa: F401
    BaseModel,
    ConfigDict,
    Count,
    Field,
    Message,
    count,
    model_validator,
)
from contract.settings import (  # noqa: F401 - re-exported: the contract's one import path
    GRID_KNOBS,
    INT32_MAX,
    SAMPLE_CADENCE,
    STEP_CADENCE,
    BatchSize,
    DpoBeta,
    EarlyExitSettings,
    EvalSettings,
    Finite,
    JobHyperparameters,
    LearningRate,
    LoraAlpha,
    LoraRank,
    Method,
    SampleSettings,
    TaskSettings,
    grid_knobs,
)
from contract.states import EXIT_REASONS, JOB_STATES, NODE_STATES, values

PLACEMENT_FUNC = "worker.daemon.run_placement"
CANCEL_CHANNEL = "loraplex:cancel"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


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


_Msg = Message  # the shapes below


# A GPU's index on its node; a Count (a node's messages take the types they document).
GpuIndex = count(ge=0, lt=64)


class NodeRegister(_Msg):
    name: str = Field(min_length=1, max_length=200, description="Stable node name (hostname).")
    gpu_type: str = Field(min_length=1, max_length=64, description="e.g. 'H100-80GB', 'cpu'.")
    gpu_count: Count = Field(ge=0, le=64)
    gpu_memory_bytes: Count = Field(ge=0, le=2**63 - 1, description="Memory of one GPU in bytes.")
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
    """A shared executor process on a node (co-location, docs/architecture.md): one base model on one GPU
    set, hosting the placements (tasks) attached to it. Joining it needs no free GPU: the
    scheduler may place a task with the same colocation_key on exactly these GPUs."""

    key: str = Field(max_length=2000, description="colocation_key of the tasks it can host.")
    gpu_indices: list[GpuIndex] = Field(max_length=64)
    placement_ids: list[str] = Field(default_factory=list, max_length=1000,
                                     description="Placements it hosts now (empty: warm, idle).")
    free_rows: Count = Field(ge=0, description="Sequence rows of its admission budget that no "
                                             "hosted job uses (what another task's jobs can take).")
    total_rows: Count = Field(ge=0,
                            description="Its whole admission budget in sequence rows.")
    queued_jobs: Count = Field(default=0, ge=0,
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
    kind=checkpoint is per task (step says where training resumes), its unchanged files may be
    carried from an earlier one (carry_from, carried). Same key = same artifact."""

    kind: Literal["adapter", "checkpoint"]
    placement_id: str = Field(description="The attempt that reports (fencing).")
    job_id: str | None = None
    step: int | None = Field(default=None, ge=0, le=INT32_MAX)
    key: str | None = Field(
        default=None, max_length=180,
        description="Checkpoints only: stored as 'checkpoint:<key or step>'. An adapter's key is "
                    "always 'adapter:<job_id>' (one per job; a new upload replaces it).")
    meta: dict | None = None
    carry_from: str | None = Field(
        default=None, max_length=40,
        description="Checkpoints only: an earlier checkpoint artifact of the task whose files "
                    "named in `carried` this one holds unchanged (not uploaded again).")
    carried: list[str] | None = Field(
        default=None, max_length=100_000,
        description="Names of carry_from's files this checkpoint lists as its own, unchanged "
                    "(a checkpoint's job files are immutable by name). 409 carry_unavailable "
                    "when carry_from or one of them is gone: upload every file instead.")


# the service's answer (409) to a carry it cannot honour: the worker uploads every file instead
CARRY_UNAVAILABLE = "carry_unavailable"


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


class Sample(_Msg):
    """One completion of the samples a task ends with."""

    prompt: str = Field(max_length=8000)
    job_id: str | None = Field(default=None, description="The configuration's job; null: the base model.")
    completion: str = Field(max_length=100_000)
    tokens: int = Field(ge=0, le=1_000_000, description="New tokens generated.")


class TaskSamples(_Msg):
    """The completions a task ended with (SampleSettings): every prompt answered by the leading
    adapters and the base model. The service keeps them as a result file of the task."""

    placement_id: str
    samples: list[Sample] = Field(max_length=32 * 9)


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
    Report("samples", TaskSamples, "/tasks/{task_id}/samples"),
    Report("finished", TaskFinished, "/tasks/{task_id}/finished"),
    Report("failed", TaskFailed, "/tasks/{task_id}/failed"),
)}
