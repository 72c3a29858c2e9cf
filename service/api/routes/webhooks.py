"""Routes /v1/webhooks: a tenant's webhook endpoints (create answers the signing secret, once),
their delivery log, redelivery on request and a test event. Every id is scoped to the tenant."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service.api.deps import SessionDep, SettingsDep, TenantDep
from service.api.error_docs import errors
from service.core.pagination import cursor_query
from service.schemas import DeletedOut, Page
from service.webhooks import endpoints, outbox
from service.webhooks.schemas import (
    WebhookCreate,
    WebhookCreated,
    WebhookDeliveryDetail,
    WebhookDeliveryOut,
    WebhookOut,
    WebhookUpdate,
)
from service.webhooks.states import DeliveryStateName

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])
Limit = Annotated[int, Query(ge=1, le=100)]
After = Annotated[str | None, cursor_query("whep", "webhook endpoint")]
DeliveryCursor = Annotated[str | None, cursor_query("whdl", "delivery")]
DISABLED = {409: "The endpoint is disabled: enable it first"}


@router.post("", status_code=201, response_model=WebhookCreated,
             responses=errors(409, descriptions={409: "The tenant has too many endpoints"}))
def create_webhook(body: WebhookCreate, session: SessionDep, tenant: TenantDep,
                   settings: SettingsDep) -> WebhookCreated:
    """Register an endpoint; the answer holds its signing secret, which is never shown again.
    Deliveries carry `webhook-id`, `webhook-timestamp` and `webhook-signature` (Standard
    Webhooks: HMAC-SHA256 with the secret)."""
    row, secret = endpoints.create_endpoint(session, tenant, body, settings)
    session.commit()
    return WebhookCreated(**endpoints.endpoint_out(row).model_dump(), secret=secret)


@router.get("", response_model=Page[WebhookOut])
def list_webhooks(session: SessionDep, tenant: TenantDep, limit: Limit = 20,
                  after: After = None) -> Page[WebhookOut]:
    rows, more = endpoints.list_endpoints(session, tenant, limit, after)
    return Page[WebhookOut](data=[endpoints.endpoint_out(r) for r in rows], has_more=more,
                            last_id=rows[-1].id if rows else None)


@router.get("/{webhook_id}", response_model=WebhookOut)
def get_webhook(session: SessionDep, tenant: TenantDep, webhook_id: str) -> WebhookOut:
    return endpoints.endpoint_out(endpoints.get_endpoint(session, tenant, webhook_id))


@router.patch("/{webhook_id}", response_model=WebhookOut)
def update_webhook(body: WebhookUpdate, session: SessionDep, tenant: TenantDep,
                   settings: SettingsDep, webhook_id: str) -> WebhookOut:
    """Change the URL, event types, description, or `enabled` (false: nothing is enqueued or
    sent; pending deliveries wait until it is enabled again)."""
    row = endpoints.update_endpoint(session, tenant, webhook_id, body, settings)
    session.commit()
    return endpoints.endpoint_out(row)


@router.delete("/{webhook_id}", response_model=DeletedOut)
def delete_webhook(session: SessionDep, tenant: TenantDep, webhook_id: str) -> DeletedOut:
    row = endpoints.delete_endpoint(session, tenant, webhook_id)
    session.commit()
    return DeletedOut(id=row.id, object="webhook_endpoint")


@router.get("/{webhook_id}/deliveries", response_model=Page[WebhookDeliveryOut])
def list_deliveries(session: SessionDep, tenant: TenantDep, webhook_id: str,
                    limit: Limit = 20, after: DeliveryCursor = None,
                    state: Annotated[DeliveryStateName | None, Query()] = None
                    ) -> Page[WebhookDeliveryOut]:
    """The delivery log, newest first: each event's attempts, last status code, next attempt."""
    endpoint = endpoints.get_endpoint(session, tenant, webhook_id)
    data, more = outbox.list_deliveries(session, endpoint, limit, after, state)
    return Page[WebhookDeliveryOut](data=data, has_more=more,
                                    last_id=data[-1].id if data else None)


@router.get("/{webhook_id}/deliveries/{delivery_id}", response_model=WebhookDeliveryDetail)
def get_delivery(session: SessionDep, tenant: TenantDep, webhook_id: str,
                 delivery_id: str) -> WebhookDeliveryDetail:
    """One delivery with the body posted and every attempt."""
    endpoint = endpoints.get_endpoint(session, tenant, webhook_id)
    return outbox.delivery_detail(session, outbox.get_delivery(session, endpoint, delivery_id))


@router.post("/{webhook_id}/deliveries/{delivery_id}/redeliver", status_code=202,
             response_model=WebhookDeliveryOut, responses=errors(409, descriptions=DISABLED))
def redeliver(session: SessionDep, tenant: TenantDep, webhook_id: str,
              delivery_id: str) -> WebhookDeliveryOut:
    """Send it again now (same webhook-id and body), whatever its state; its retries and
    give-up time start over."""
    endpoint = endpoints.get_endpoint(session, tenant, webhook_id, lock=True)
    row = outbox.redeliver(session, endpoint, delivery_id)
    session.commit()
    return outbox.delivery_out(row, outbox.event_type(session, row))


@router.post("/{webhook_id}/test", status_code=202, response_model=WebhookDeliveryOut,
             responses=errors(409, descriptions=DISABLED))
def test_webhook(session: SessionDep, tenant: TenantDep, webhook_id: str) -> WebhookDeliveryOut:
    """Send this endpoint a `webhook.test` event (whatever it subscribes to)."""
    endpoint = endpoints.get_endpoint(session, tenant, webhook_id, lock=True)
    row = outbox.enqueue_test(session, endpoint)
    session.commit()
    return outbox.delivery_out(row, "webhook.test")
