"""API shapes of /v1/webhooks: what a tenant sends and gets back (never the stored secret,
except once, in the answer to the create)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.webhooks.catalog import EVENT_TYPES
from service.webhooks.states import DeliveryStateName

EventType = Literal[EVENT_TYPES]  # type: ignore[valid-type]
EventTypes = Annotated[list[EventType], Field(  # type: ignore[valid-type]
    min_length=1, max_length=len(EVENT_TYPES),
    description="The event types to receive: OpenAI's `fine_tuning.job.succeeded|failed|"
                "cancelled` and loraplex's `task.running|paused|succeeded|failed|cancelled`, "
                "`job.exited|completed|failed`.")]
Url = Annotated[str, Field(min_length=1, max_length=2048, description="An http(s) URL whose "
                           "host resolves to public addresses only (unless the operator allows "
                           "private ones).")]
Description = Annotated[str | None, Field(max_length=500)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("url", "description", mode="after", check_fields=False)
    @classmethod
    def _no_nul(cls, v: str | None) -> str | None:
        if v is not None and "\x00" in v:
            raise ValueError("must not contain NUL characters")
        return v

    @field_validator("event_types", mode="after", check_fields=False)
    @classmethod
    def _unique(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else list(dict.fromkeys(v))


class WebhookCreate(_In):
    url: Url
    event_types: EventTypes
    description: Description = None
    enabled: bool = True


def _left_out_is_not_null(schema: dict[str, Any]) -> None:
    """The schema of a field whose default None means "left out" states no default."""
    for name in ("url", "event_types", "enabled"):
        schema["properties"][name].pop("default", None)


class WebhookUpdate(_In):
    """Fields left out stay as they are; `enabled: false` stops deliveries (pending ones wait).
    Only description may be null (none); a null url, event_types or enabled is a 422."""

    model_config = ConfigDict(json_schema_extra=_left_out_is_not_null)

    url: Url = None  # type: ignore[assignment]  # None: left out (a default is not validated)
    event_types: EventTypes = None  # type: ignore[assignment]
    description: Description = None
    enabled: bool = None  # type: ignore[assignment]


class WebhookOut(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    description: str | None
    event_types: list[str]
    enabled: bool
    created_at: datetime
    updated_at: datetime


class WebhookCreated(WebhookOut):
    secret: str = Field(description="The signing secret (`whsec_...`, Standard Webhooks): shown "
                                    "only in this answer.")


class WebhookDeliveryOut(BaseModel):
    id: str
    object: Literal["webhook_delivery"] = "webhook_delivery"
    endpoint_id: str
    event_id: str = Field(description="The event's id: the webhook-id header of every attempt.")
    event_type: str
    state: DeliveryStateName
    attempts: int
    last_status_code: int | None = Field(description="The receiver's last HTTP status (null: "
                                                     "none yet, or no answer).")
    last_error: str | None
    next_attempt_at: datetime | None
    delivered_at: datetime | None
    created_at: datetime


class WebhookAttemptOut(BaseModel):
    attempted_at: datetime
    status_code: int | None
    error: str | None
    duration_ms: int


class WebhookDeliveryDetail(WebhookDeliveryOut):
    payload: dict[str, Any] = Field(description="The body posted (the same on every attempt).")
    attempt_log: list[WebhookAttemptOut] = Field(description="Every attempt, oldest first.")
