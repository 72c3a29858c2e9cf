"""The durable outbox: the deliveries a task event creates, written in the transaction of the
change itself (so an event is enqueued exactly when its change commits, and survives any
restart), plus the tenant's view of it: the delivery log and redelivery on request."""

from __future__ import annotations

import threading

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.db import after_commit
from service.core.errors import conflict, not_found
from service.core.pagination import page_query
from service.lifecycle import move
from service.models import (
    Task,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    new_id,
    utcnow,
)
from service.webhooks.catalog import FROM_TASK_EVENT, TEST_TYPE, event_body, event_data
from service.webhooks.schemas import (
    WebhookAttemptOut,
    WebhookDeliveryDetail,
    WebhookDeliveryOut,
)
from service.webhooks.states import DELIVERY_TRANSITIONS, DeliveryState, DeliveryStateName

# Set when this process committed new deliveries: its deliverers look at once, not at their
# next poll (service.webhooks.delivery); other processes find them by polling.
enqueued = threading.Event()


def move_delivery(delivery: WebhookDelivery, target: DeliveryState) -> None:
    move("webhook delivery", delivery, DELIVERY_TRANSITIONS, target, DeliveryState.PENDING)


def _wake() -> None:
    enqueued.set()


def on_task_event(session: Session, task_id: str, type: str, message: str,
                  job_id: str | None, data: dict | None) -> int:
    """Enqueue the webhook events a task event is (service.events.add_event calls this in the
    same transaction) for every enabled endpoint of the task's tenant subscribed to them.
    Returns the number of deliveries added."""
    types = FROM_TASK_EVENT.get(type)
    if not types:
        return 0
    rows = session.execute(
        select(WebhookEndpoint.id, WebhookEndpoint.event_types, Task.tenant_id, Task.meta)
        .join(Task, Task.tenant_id == WebhookEndpoint.tenant_id)
        .where(Task.id == task_id, WebhookEndpoint.enabled.is_(True),
               WebhookEndpoint.deleted_at.is_(None))).all()
    added = 0
    for webhook_type in types:
        subscribed = [r for r in rows if webhook_type in r.event_types]
        if not subscribed:
            continue
        tenant_id, meta = subscribed[0].tenant_id, subscribed[0].meta
        payload = event_data(webhook_type, task_id, meta, message, job_id, data)
        event = _add_event(session, tenant_id, webhook_type, payload)
        for endpoint in subscribed:
            session.add(WebhookDelivery(endpoint_id=endpoint.id, event_id=event.id,
                                        next_attempt_at=event.created_at,
                                        scheduled_at=event.created_at))
            added += 1
    if added:
        session.flush()
        after_commit(session, _wake)
    return added


def _add_event(session: Session, tenant_id: str, type: str, data: dict) -> WebhookEvent:
    now = utcnow()
    event_id = new_id("evt")
    event = WebhookEvent(id=event_id, tenant_id=tenant_id, type=type, created_at=now,
                         payload=event_body(event_id, type, now, data))
    session.add(event)
    session.flush()  # the deliveries reference it
    return event


def enqueue_test(session: Session, endpoint: WebhookEndpoint) -> WebhookDelivery:
    """A `webhook.test` event for this endpoint alone (whatever it subscribes to); flushed."""
    if not endpoint.enabled:
        raise conflict(f"webhook endpoint {endpoint.id!r} is disabled; enable it first",
                       code="webhook_disabled")
    event = _add_event(session, endpoint.tenant_id, TEST_TYPE,
                       {"id": endpoint.id, "object": "webhook_endpoint", "url": endpoint.url})
    delivery = WebhookDelivery(endpoint_id=endpoint.id, event_id=event.id,
                               next_attempt_at=event.created_at, scheduled_at=event.created_at)
    session.add(delivery)
    session.flush()
    after_commit(session, _wake)
    return delivery


def list_deliveries(session: Session, endpoint: WebhookEndpoint, limit: int, after: str | None,
                    state: DeliveryStateName | None) -> tuple[list[WebhookDeliveryOut], bool]:
    """The endpoint's deliveries, newest first."""
    scope = select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint.id)
    base = scope if state is None else scope.where(WebhookDelivery.state == state)
    rows, more = page_query(session, WebhookDelivery, base, limit, after, scope=scope)
    types = dict(session.execute(select(WebhookEvent.id, WebhookEvent.type).where(
        WebhookEvent.id.in_([r.event_id for r in rows]))).all()) if rows else {}
    return [delivery_out(r, types[r.event_id]) for r in rows], more


def get_delivery(session: Session, endpoint: WebhookEndpoint, delivery_id: str,
                 lock: bool = False) -> WebhookDelivery:
    query = select(WebhookDelivery).where(WebhookDelivery.id == delivery_id,
                                          WebhookDelivery.endpoint_id == endpoint.id)
    row = session.scalar(query.with_for_update() if lock else query)
    if row is None:
        raise not_found("webhook delivery", delivery_id, param="delivery_id")
    return row


def delivery_detail(session: Session, delivery: WebhookDelivery) -> WebhookDeliveryDetail:
    event = session.get(WebhookEvent, delivery.event_id)
    assert event is not None
    attempts = session.scalars(select(WebhookAttempt).where(
        WebhookAttempt.delivery_id == delivery.id).order_by(WebhookAttempt.id)).all()
    return WebhookDeliveryDetail(
        **delivery_out(delivery, event.type).model_dump(), payload=event.payload,
        attempt_log=[WebhookAttemptOut(attempted_at=a.attempted_at, status_code=a.status_code,
                                       error=a.error, duration_ms=a.duration_ms)
                     for a in attempts])


def redeliver(session: Session, endpoint: WebhookEndpoint, delivery_id: str) -> WebhookDelivery:
    """Send the delivery again now, with the same webhook-id and body, and start its backoff
    and give-up clock over (whatever its state); flushed. 409 while the endpoint is disabled."""
    if not endpoint.enabled:
        raise conflict(f"webhook endpoint {endpoint.id!r} is disabled; enable it first",
                       code="webhook_disabled")
    delivery = get_delivery(session, endpoint, delivery_id, lock=True)
    now = utcnow()
    move_delivery(delivery, DeliveryState.PENDING)
    delivery.tries, delivery.lease_token = 0, None
    delivery.next_attempt_at = delivery.scheduled_at = now
    session.flush()
    after_commit(session, _wake)
    return delivery


def delivery_out(row: WebhookDelivery, event_type: str) -> WebhookDeliveryOut:
    return WebhookDeliveryOut(
        id=row.id, endpoint_id=row.endpoint_id, event_id=row.event_id, event_type=event_type,
        state=row.state, attempts=row.attempts, last_status_code=row.last_status_code,
        last_error=row.last_error, next_attempt_at=row.next_attempt_at,
        delivered_at=row.delivered_at, created_at=row.created_at)


def event_type(session: Session, delivery: WebhookDelivery) -> str:
    return session.scalar(select(WebhookEvent.type).where(WebhookEvent.id == delivery.event_id))
