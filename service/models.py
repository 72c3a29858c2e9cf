"""SQLAlchemy ORM models: the Postgres schema that is loraplex's source of truth.
Every change here needs an Alembic migration in migrations/versions/ (tests never use create_all).
Task, job, placement and node states, exit reasons and their transition tables are declared in
contract.states (re-exported here); service.lifecycle makes every move.
Each table's notes are its class's docstring; ids are prefixed strings like ``task_1f3c...``
unless said otherwise.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from contract.methods import DEFAULT_METHOD
from contract.protocol import TaskSettings
from contract.states import (  # noqa: F401 (re-exported: the service imports them from here)
    EXIT_REASONS,
    JOB_STATES,
    JOB_TERMINAL,
    NODE_STATES,
    PLACEMENT_ACTIVE,
    PLACEMENT_STATES,
    TASK_STATES,
    TASK_TERMINAL,
    JobState,
    NodeState,
    PlacementState,
    TaskState,
)
from service.model_base import TS, Base, new_id, utcnow  # noqa: F401 (Base, new_id: named here too)
from service.model_base import id_default as _id

# the background outboxes' tables, in their own module, named here too
from service.models_outbox import (  # noqa: F401
    INTEGRATION_TYPES,
    MergedModel,
    SampleRequest,
    TaskIntegration,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
)

FILE_FORMATS = ("chat", "completion", "preference")
ARTIFACT_KINDS = ("adapter", "checkpoint")


class Tenant(Base):
    """``tenants(id, name unique, max_gpus null=unlimited, max_queued_tasks null=unlimited,
    priority, max_task_priority null=default, guaranteed_gpus null=none, created_at)``;
    max_queued_tasks caps the tenant's tasks not yet running nor finished."""

    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=_id("ten"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    max_gpus: Mapped[int | None] = mapped_column(Integer)
    max_queued_tasks: Mapped[int | None] = mapped_column(Integer)
    # Operator-set scheduling (service.admin set-limit): the tenant's priority (0-10, weights its
    # tasks in the planner), the ceiling of its tasks' own priority (None: the configured
    # default) and its guaranteed GPU share (None: none), lent out while idle, reclaimed on need.
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    max_task_priority: Mapped[int | None] = mapped_column(Integer)
    guaranteed_gpus: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)


class ApiKey(Base):
    """``api_keys(id, tenant_id, prefix unique, key_hash sha256 hex, created_at, revoked_at)``; a
    key looks like ``lpx-<prefix 10 chars><secret>``; lookup by prefix, compare the hash."""

    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=_id("key"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(32), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(TS)


class File(Base):
    """``files(id, tenant_id, filename, purpose, format chat|completion|preference, bytes,
    line_count, sha256, storage_key, created_at, deleted_at)`` (soft delete)."""

    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=_id("file"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32), default="fine-tune")
    format: Mapped[str] = mapped_column(String(16))
    bytes: Mapped[int] = mapped_column(BigInteger)
    line_count: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    storage_key: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(TS)
    # ix_files_tenant_sha256: an upload finds the tenant's file with the same bytes (dedup)
    __table_args__ = (Index("ix_files_tenant_created", "tenant_id", "created_at", "id"),
                      Index("ix_files_tenant_sha256", "tenant_id", "sha256"))


class Task(Base):
    """``tasks(id, tenant_id, base_model, method (contract.methods), training_file_id, validation_file_id,
    search_space jsonb, settings jsonb (contract.protocol.TaskSettings: validation_split,
    epochs, max_seq_len, seed, early_exit, eval, target_modules, ...), priority,
    num_train_samples, state, error, best_job_id, created_at, started_at, finished_at,
    cancelled_at, suffix, meta jsonb, init_adapter_file_id)``; states: TASK_STATES. ``pausing``:
    its live attempt was asked to stop at a step boundary (it still holds its GPUs and reports);
    ``paused``: stopped with a checkpoint, holds nothing, not planned until resumed
    (service.pausing.request_pause / resume_task). meta: the tenant's string pairs (OpenAI's
    ``metadata``); suffix: part of the fine-tuned model's name."""

    __tablename__ = "tasks"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=_id("task"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    base_model: Mapped[str] = mapped_column(String(200))
    method: Mapped[str] = mapped_column(String(16), default=DEFAULT_METHOD)
    training_file_id: Mapped[str] = mapped_column(ForeignKey("files.id"))
    validation_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    # an uploaded PEFT adapter (purpose "adapter") every job starts from (service.init_adapter)
    init_adapter_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    search_space: Mapped[dict] = mapped_column(JSONB)
    # contract.protocol.TaskSettings as one document (max_seq_len resolved): a new setting
    # needs no column and no migration
    settings: Mapped[dict] = mapped_column(JSONB)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    num_train_samples: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[str] = mapped_column(String(24), default=TaskState.VALIDATING_FILES.value, index=True)
    error: Mapped[dict | None] = mapped_column(JSONB)
    best_job_id: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(TS)
    finished_at: Mapped[datetime | None] = mapped_column(TS)
    cancelled_at: Mapped[datetime | None] = mapped_column(TS)
    suffix: Mapped[str | None] = mapped_column(String(64))
    meta: Mapped[dict | None] = mapped_column(JSONB)
    __table_args__ = (Index("ix_tasks_tenant_created", "tenant_id", "created_at", "id"),)

    def task_settings(self) -> TaskSettings:
        """Its settings document as the contract's model (defaults for settings added since)."""
        return TaskSettings.model_validate(self.settings)


class Job(Base):
    """``jobs(id, task_id, index, config jsonb {learning_rate, lora_rank, lora_alpha, batch_size},
    state, exit_reason, best_val_loss, best_step, last_step, error, ...)``; states: JOB_STATES,
    exit reasons: EXIT_REASONS."""

    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=_id("job"))
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    config: Mapped[dict] = mapped_column(JSONB)
    state: Mapped[str] = mapped_column(String(16), default=JobState.PENDING.value)
    exit_reason: Mapped[str | None] = mapped_column(String(24))
    best_val_loss: Mapped[float | None] = mapped_column(Float)
    best_step: Mapped[int | None] = mapped_column(Integer)
    last_step: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(TS)
    finished_at: Mapped[datetime | None] = mapped_column(TS)
    __table_args__ = (UniqueConstraint("task_id", "index", name="uq_jobs_task_index"),)


class Event(Base):
    """``events(id bigint identity = the cursor, task_id, job_id, level, type, message, data jsonb,
    client_key, created_at)``; unique (task_id, client_key) for retried posts."""

    __tablename__ = "events"
    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    job_id: Mapped[str | None] = mapped_column(String(40))
    level: Mapped[str] = mapped_column(String(8), default="info")
    type: Mapped[str] = mapped_column(String(48))
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict | None] = mapped_column(JSONB)
    client_key: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    __table_args__ = (
        UniqueConstraint("task_id", "client_key", name="uq_events_task_client_key"),
        Index("ix_events_task_id_id", "task_id", "id"),
    )


class MetricPoint(Base):
    """``metric_points(id bigint, task_id, job_id, step, split train|val, loss, data jsonb, tokens,
    gpu_seconds)``; unique (job_id, step, split) so a retried batch is a no-op. tokens and
    gpu_seconds (train points): the usage of that step of the job (service.usage)."""

    __tablename__ = "metric_points"
    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    split: Mapped[str] = mapped_column(String(8))
    loss: Mapped[float] = mapped_column(Float)
    data: Mapped[dict | None] = mapped_column(JSONB)
    # train points: the job's exact sequence tokens of that step and its share of the executor's
    # GPU-seconds (contract.protocol.MetricPointIn); summed per job and task by service.usage
    tokens: Mapped[int | None] = mapped_column(BigInteger)
    gpu_seconds: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    __table_args__ = (
        UniqueConstraint("job_id", "step", "split", name="uq_metric_points_job_step_split"),
    )


class Artifact(Base):
    """``artifacts(id, task_id, job_id null, kind adapter|checkpoint, key, files jsonb [{name,
    bytes, sha256, blob?}], step, meta jsonb, created_at)``; unique (task_id, key); file blobs live
    in storage under ``artifacts/<id>/<name>``, or, for a checkpoint's file carried unchanged from
    an earlier one, under the key in ``blob`` (service.artifact_keys)."""

    __tablename__ = "artifacts"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=_id("art"))
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16))
    key: Mapped[str] = mapped_column(String(200))
    files: Mapped[list] = mapped_column(JSONB)
    step: Mapped[int | None] = mapped_column(Integer)
    meta: Mapped[dict | None] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    __table_args__ = (UniqueConstraint("task_id", "key", name="uq_artifacts_task_key"),)


class Node(Base):
    """``nodes(id, name unique, gpu_type, gpu_count, gpu_memory_bytes, state up|down,
    last_heartbeat_at, registered_at, meta jsonb, executors jsonb, executors_at)``; executors:
    the node's shared executors as its last heartbeat reported them
    (contract.protocol.ExecutorReport dicts), executors_at: when; the scheduler ignores them
    once older than node_timeout_s."""

    __tablename__ = "nodes"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=_id("node"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    gpu_type: Mapped[str] = mapped_column(String(64))
    gpu_count: Mapped[int] = mapped_column(Integer)
    gpu_memory_bytes: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(8), default=NodeState.UP.value)
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(TS)
    registered_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    meta: Mapped[dict | None] = mapped_column(JSONB)
    executors: Mapped[list | None] = mapped_column(JSONB)
    executors_at: Mapped[datetime | None] = mapped_column(TS)


class Placement(Base):
    """``placements(id, task_id, node_id, gpu_indices int[], planned_start, planned_end, state,
    attempt, created_at, published_at, claimed_at, finished_at, error)``; states:
    PLACEMENT_STATES. Only one placement of a task is published|claimed|running. The scheduler
    writes ``planned`` rows (attempt = service.cluster.next_attempt) and publishes with
    service.queue.publish_placement; the worker claims (claimed), its first running job makes it
    running; the task's end makes it finished|failed; cancel makes it cancelled.
    ``stop_requested`` ('pause' | 'requeue'): the service asked the live attempt to checkpoint
    and stop; its stop report makes it ``stopped`` (not a failed attempt). ``estimated_s``: the
    scheduler's raw duration estimate (uncorrected) when it published the placement; ``run_s``:
    claim to finish of an attempt that ended the task (finished): the pairs are the estimate
    error fed back (service.scheduler.estimator.correction_factor)."""

    __tablename__ = "placements"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=_id("pl"))
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), index=True)
    gpu_indices: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    planned_start: Mapped[datetime] = mapped_column(TS)
    planned_end: Mapped[datetime] = mapped_column(TS)
    state: Mapped[str] = mapped_column(String(16), default=PlacementState.PLANNED.value, index=True)
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    published_at: Mapped[datetime | None] = mapped_column(TS)
    claimed_at: Mapped[datetime | None] = mapped_column(TS)
    finished_at: Mapped[datetime | None] = mapped_column(TS)
    error: Mapped[str | None] = mapped_column(Text)
    stop_requested: Mapped[str | None] = mapped_column(String(16))
    estimated_s: Mapped[int | None] = mapped_column(Integer)
    run_s: Mapped[float | None] = mapped_column(Float)


class ThroughputProfile(Base):
    """``throughput_profiles(id, base_model, gpu_type, seq_len, batch_key, gpus, tokens_per_s,
    samples_per_s, memory_k0, memory_k1, updated_at)``; unique (base_model, gpu_type, seq_len,
    batch_key, gpus). Written by executors' throughput reports (service.profiles): tokens_per_s
    is the real tokens/s of a whole placement of ``gpus`` GPUs of that type; gpu_type is the
    reporting node's; batch_key is service.scheduler.estimator.batch_key of the jobs trained."""

    __tablename__ = "throughput_profiles"
    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(200))
    gpu_type: Mapped[str] = mapped_column(String(64))
    seq_len: Mapped[int] = mapped_column(Integer)
    batch_key: Mapped[str] = mapped_column(String(200))
    gpus: Mapped[int] = mapped_column(Integer)
    tokens_per_s: Mapped[float] = mapped_column(Float)
    samples_per_s: Mapped[float | None] = mapped_column(Float)
    memory_k0: Mapped[float | None] = mapped_column(Float)
    memory_k1: Mapped[float | None] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(TS, default=utcnow, onupdate=utcnow)
    __table_args__ = (
        UniqueConstraint("base_model", "gpu_type", "seq_len", "batch_key", "gpus",
                         name="uq_throughput_profiles_key"),
    )


class IdempotencyKey(Base):
    """``idempotency_keys(tenant_id, key, request_hash, resource_id, created_at)``; PK (tenant,
    key)."""

    __tablename__ = "idempotency_keys"
    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    resource_id: Mapped[str] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
