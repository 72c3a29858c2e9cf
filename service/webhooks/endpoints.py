"""A tenant's webhook endpoints: create (the secret is returned once), list, get, update,
delete. Plain functions over a session; the caller commits."""

from __future__ import annotations

import logging

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.core.config import Settings
from service.core.errors import conflict, invalid, not_found
from service.core.pagination import page_query
from service.models import Tenant, WebhookEndpoint, utcnow
from service.webhooks.schemas import WebhookCreate, WebhookOut, WebhookUpdate
from service.webhooks.security import AddressRefused, new_secret, resolve, seal

log = logging.getLogger("loraplex.webhooks")
MAX_ENDPOINTS = 20  # per tenant, deleted ones not counted


def check_url(url: str, settings: Settings) -> None:
    """422 naming `url` unless it is http(s) and its host resolves to allowed addresses."""
    try:
        resolve(url, settings.webhook_allow_private)
    except AddressRefused as exc:
        raise invalid(f"url: {exc}", param="url", code="invalid_url") from exc


def create_endpoint(session: Session, tenant: Tenant, body: WebhookCreate,
                    settings: Settings) -> tuple[WebhookEndpoint, str]:
    """A new endpoint and its secret (the only time the secret leaves the service); flushed."""
    check_url(body.url, settings)
    # Lock the tenant row so two creates at the limit count one after the other.
    session.scalar(select(Tenant.id).where(Tenant.id == tenant.id).with_for_update())
    live = session.scalar(select(func.count()).where(WebhookEndpoint.tenant_id == tenant.id,
                                                     WebhookEndpoint.deleted_at.is_(None)))
    if live >= MAX_ENDPOINTS:
        raise conflict(f"a tenant has at most {MAX_ENDPOINTS} webhook endpoints; delete one "
                       "first", code="too_many_webhooks")
    secret = new_secret()
    row = WebhookEndpoint(tenant_id=tenant.id, url=body.url, description=body.description,
                          event_types=list(body.event_types), enabled=body.enabled,
                          secret=seal(secret, settings.webhook_secret_key))
    session.add(row)
    session.flush()
    log.info("webhook endpoint created endpoint=%s tenant=%s", row.id, tenant.id)
    return row, secret


def get_endpoint(session: Session, tenant: Tenant, endpoint_id: str,
                 lock: bool = False) -> WebhookEndpoint:
    query = select(WebhookEndpoint).where(WebhookEndpoint.id == endpoint_id,
                                          WebhookEndpoint.tenant_id == tenant.id,
                                          WebhookEndpoint.deleted_at.is_(None))
    row = session.scalar(query.with_for_update() if lock else query)
    if row is None:
        raise not_found("webhook endpoint", endpoint_id, param="webhook_id")
    return row


def list_endpoints(session: Session, tenant: Tenant, limit: int, after: str | None
                   ) -> tuple[list[WebhookEndpoint], bool]:
    base = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant.id,
                                         WebhookEndpoint.deleted_at.is_(None))
    return page_query(session, WebhookEndpoint, base, limit, after)


def update_endpoint(session: Session, tenant: Tenant, endpoint_id: str, body: WebhookUpdate,
                    settings: Settings) -> WebhookEndpoint:
    """Change what the body sets (WebhookUpdate refuses a null url, event_types or enabled);
    flushed."""
    given = body.model_fields_set
    if body.url is not None:
        check_url(body.url, settings)
    row = get_endpoint(session, tenant, endpoint_id, lock=True)
    if body.url is not None:
        row.url = body.url
    if body.event_types is not None:
        row.event_types = list(body.event_types)
    if "description" in given:
        row.description = body.description
    if body.enabled is not None:
        row.enabled = body.enabled
    row.updated_at = utcnow()
    session.flush()
    log.info("webhook endpoint updated endpoint=%s fields=%s", row.id, ",".join(sorted(given)))
    return row


def delete_endpoint(session: Session, tenant: Tenant, endpoint_id: str) -> WebhookEndpoint:
    """Gone from the API at once; its pending deliveries are never attempted again."""
    row = get_endpoint(session, tenant, endpoint_id, lock=True)
    row.deleted_at = row.updated_at = utcnow()
    row.enabled = False
    session.flush()
    log.info("webhook endpoint deleted endpoint=%s", row.id)
    return row


def endpoint_out(row: WebhookEndpoint) -> WebhookOut:
    return WebhookOut(id=row.id, url=row.url, description=row.description,
                      event_types=list(row.event_types), enabled=row.enabled,
                      created_at=row.created_at, updated_at=row.updated_at)
