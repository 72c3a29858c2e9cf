"""The background outboxes' tables: webhook endpoints, events, deliveries and attempts; merged
models; tracking integrations; sample requests. Each worked on the one leased outbox
(service.outbox) by service.webhooks, service.merged, service.tracking and, for sample requests,
the node daemons through service.sample_requests; service.models names them too."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
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

from service.merged.states import MERGE_LIVE, MergeState
from service.model_base import TS, Base, utcnow
from service.model_base import id_default as _id
from service.model_base import state_in as _state_in
from service.sample_requests.states import SAMPLE_REQUEST_LIVE, SampleRequestState
from service.tracking.states import SyncState
from service.webhooks.states import DeliveryState


class WebhookEndpoint(Base):
    """A tenant's webhook receiver: where to POST which event types, signed with its secret
    (``secret``: ``fernet:<token>`` encrypted with LORAPLEX_WEBHOOK_SECRET_KEY, or ``plain:<whsec_>``
    without a key; never shown after create). Deleting sets deleted_at (the log stays)."""

    __tablename__ = "webhook_endpoints"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=_id("whep"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(String(2048))
    description: Mapped[str | None] = mapped_column(String(500))
    event_types: Mapped[list] = mapped_column(JSONB)
    secret: Mapped[str] = mapped_column(Text)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True, server_default="true")
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(TS, default=utcnow, onupdate=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(TS)
    __table_args__ = (Index("ix_webhook_endpoints_tenant_created", "tenant_id", "created_at", "id"),)


class WebhookEvent(Base):
    """One event as receivers get it (``payload`` is the JSON body; ``id`` is its webhook-id, the
    same on every attempt and redelivery), written in the transaction of the change it tells."""

    __tablename__ = "webhook_events"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=_id("evt"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"),
                                           index=True)
    type: Mapped[str] = mapped_column(String(64))
    # json, not jsonb: the body keeps its key order, so every attempt posts the same bytes.
    payload: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)


class WebhookDelivery(Base):
    """The outbox: one event for one endpoint. ``pending`` rows are due at next_attempt_at; a
    deliverer claims one by moving next_attempt_at past its attempt (lease_token says whose
    attempt it is), so one that dies mid-attempt leaves it due again. ``attempts`` counts them
    all, ``tries`` those since scheduled_at (creation or the last redelivery request)."""

    __tablename__ = "webhook_deliveries"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=_id("whdl"))
    endpoint_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    event_id: Mapped[str] = mapped_column(ForeignKey("webhook_events.id", ondelete="CASCADE"))
    state: Mapped[str] = mapped_column(String(16), default=DeliveryState.PENDING.value)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    tries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    next_attempt_at: Mapped[datetime | None] = mapped_column(TS)
    scheduled_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(TS)
    lease_token: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    __table_args__ = (
        UniqueConstraint("endpoint_id", "event_id", name="uq_webhook_deliveries_endpoint_event"),
        Index("ix_webhook_deliveries_endpoint_created", "endpoint_id", "created_at", "id"),
        Index("ix_webhook_deliveries_due", "next_attempt_at",
              postgresql_where=_state_in(DeliveryState.PENDING)),
    )


class WebhookAttempt(Base):
    """Every delivery attempt: when, the receiver's status code or the error, how long."""

    __tablename__ = "webhook_attempts"
    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    delivery_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), index=True)
    attempted_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    duration_ms: Mapped[int] = mapped_column(Integer)


class MergedModel(Base):
    """A job's adapter merged into its task's base model (service.merged). ``queued`` rows are
    claimed by a merger thread (lease_token / lease_until: whose run it is, until when; a process
    that dies mid-merge leaves the row claimable again once the lease ends).

    ``merged_models(id, tenant_id, task_id, job_id unique, artifact_id, state, error, dtype,
    bytes, storage_key, attempts, lease_token, lease_until, created_at, started_at,
    finished_at)``; states: MergeState (service.merged.states); one per job; the archive blob
    lives in storage under ``merged/<id>/model.tar``."""

    __tablename__ = "merged_models"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=_id("mrg"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    artifact_id: Mapped[str] = mapped_column(ForeignKey("artifacts.id", ondelete="CASCADE"))
    state: Mapped[str] = mapped_column(String(16), default=MergeState.QUEUED.value)
    error: Mapped[str | None] = mapped_column(Text)
    dtype: Mapped[str | None] = mapped_column(String(16))
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    storage_key: Mapped[str | None] = mapped_column(String(200))
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    lease_token: Mapped[str | None] = mapped_column(String(40))
    lease_until: Mapped[datetime | None] = mapped_column(TS)
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(TS)
    finished_at: Mapped[datetime | None] = mapped_column(TS)
    __table_args__ = (
        UniqueConstraint("job_id", name="uq_merged_models_job"),
        Index("ix_merged_models_due", "created_at",
              postgresql_where=_state_in(*MERGE_LIVE)),
    )


# ----- tracking integrations (service.tracking) -----------------------------------------------
INTEGRATION_TYPES = ("wandb", "mlflow")


class TaskIntegration(Base):
    """One of a task's tracking integrations and the outbox row of its sync: ``pending`` until the
    task ended and its runs were written (due at next_attempt_at once the task is terminal; a
    syncer claims it by moving next_attempt_at past its lease, lease_token says whose attempt it
    is), then ``synced`` (result: what was written, e.g. MLflow run ids) or ``failed`` (given up;
    last_error says why). A failure never touches the task.

    ``task_integrations(id, task_id, position, type wandb|mlflow, config jsonb, state, attempts,
    last_error, next_attempt_at, lease_token, result jsonb, synced_at, created_at)``; states:
    SyncState (service.tracking.states); the task's `integrations`, in order."""

    __tablename__ = "task_integrations"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=_id("tint"))
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    position: Mapped[int] = mapped_column(Integer)
    type: Mapped[str] = mapped_column(String(16))
    config: Mapped[dict] = mapped_column(JSONB)
    state: Mapped[str] = mapped_column(String(16), default=SyncState.PENDING.value)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_error: Mapped[str | None] = mapped_column(Text)
    next_attempt_at: Mapped[datetime | None] = mapped_column(TS, default=utcnow)
    lease_token: Mapped[str | None] = mapped_column(String(40))
    result: Mapped[dict | None] = mapped_column(JSONB)
    synced_at: Mapped[datetime | None] = mapped_column(TS)
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    __table_args__ = (
        UniqueConstraint("task_id", "position", name="uq_task_integrations_task_position"),
        Index("ix_task_integrations_due", "next_attempt_at",
              postgresql_where=_state_in(SyncState.PENDING)),
    )


# ----- samples on demand (service.sample_requests) -------------------------------------------


class SampleRequest(Base):
    """A tenant's prompts to be answered by adapters of a finished task and by its base model
    (issue 44). ``queued`` rows are claimed by node daemons (lease_token / lease_until: whose run
    it is, until when; a node that dies leaves the row claimable again once the lease ends).
    The prompts and completions live in the row: they go with the task (cascade).

    ``sample_requests(id, tenant_id, task_id, state, error, settings jsonb (the request:
    contract.sample_requests.SampleRequestSettings), job_ids jsonb (the adapters chosen),
    samples jsonb (the completions, once succeeded), attempts, node_id, lease_token,
    lease_until, created_at, started_at, finished_at)``; states: SampleRequestState."""

    __tablename__ = "sample_requests"
    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=_id("smpl"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    state: Mapped[str] = mapped_column(String(16), default=SampleRequestState.QUEUED.value)
    error: Mapped[str | None] = mapped_column(Text)
    settings: Mapped[dict] = mapped_column(JSONB)
    job_ids: Mapped[list] = mapped_column(JSONB)
    samples: Mapped[list | None] = mapped_column(JSONB)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    node_id: Mapped[str | None] = mapped_column(String(40))
    lease_token: Mapped[str | None] = mapped_column(String(40))
    lease_until: Mapped[datetime | None] = mapped_column(TS)
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(TS)
    finished_at: Mapped[datetime | None] = mapped_column(TS)
    __table_args__ = (
        Index("ix_sample_requests_due", "created_at",
              postgresql_where=_state_in(*SAMPLE_REQUEST_LIVE)),
    )
