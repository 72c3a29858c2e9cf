"""Tenants and their API keys: keys are ``lpx-<prefix><secret>``, stored as a sha256 hash with
the prefix kept in clear for lookup; the full key is shown once, when it is created (service.admin
creates and revokes them; service.api.auth checks a request's)."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.errors import conflict
from service.models import ApiKey, Tenant, utcnow

KEY_PREFIX = "lpx-"
PREFIX_LEN = 10


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def lookup_prefix(key: str) -> str:
    """The part of a key stored in clear, to find its row."""
    return key[len(KEY_PREFIX):len(KEY_PREFIX) + PREFIX_LEN]


def create_api_key(session: Session, tenant: Tenant) -> str:
    """Make a new key for tenant, store its hash, return the key (the only time it is known)."""
    while True:
        key = KEY_PREFIX + secrets.token_hex(PREFIX_LEN // 2) + secrets.token_urlsafe(32)
        prefix = lookup_prefix(key)
        if session.scalar(select(ApiKey.id).where(ApiKey.prefix == prefix)) is None:
            break
    session.add(ApiKey(tenant_id=tenant.id, prefix=prefix, key_hash=hash_key(key)))
    session.flush()
    return key


def create_tenant(session: Session, name: str, max_gpus: int | None = None) -> tuple[Tenant, str]:
    """A new tenant and its first API key."""
    if session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise conflict(f"tenant {name!r} already exists", code="tenant_exists", param="name")
    tenant = Tenant(name=name, max_gpus=max_gpus)
    session.add(tenant)
    session.flush()
    return tenant, create_api_key(session, tenant)


def revoke_api_key(session: Session, key: str) -> bool:
    row = session.scalar(select(ApiKey).where(ApiKey.prefix == lookup_prefix(key)))
    if row is None or not hmac.compare_digest(row.key_hash, hash_key(key)):
        return False
    row.revoked_at = utcnow()
    return True
