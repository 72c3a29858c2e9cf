"""Tenants and API keys: keys are ``lpx-<prefix><secret>``, stored as a sha256 hash with the
prefix kept in clear for lookup; the full key is shown once, when it is created."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import ApiError, conflict
from service.models import ApiKey, Tenant, utcnow

KEY_PREFIX = "lpx-"
PREFIX_LEN = 10


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _lookup_prefix(key: str) -> str:
    return key[len(KEY_PREFIX):len(KEY_PREFIX) + PREFIX_LEN]


def create_api_key(session: Session, tenant: Tenant) -> str:
    """Make a new key for tenant, store its hash, return the key (the only time it is known)."""
    while True:
        key = KEY_PREFIX + secrets.token_hex(PREFIX_LEN // 2) + secrets.token_urlsafe(32)
        prefix = _lookup_prefix(key)
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
    row = session.scalar(select(ApiKey).where(ApiKey.prefix == _lookup_prefix(key)))
    if row is None or not hmac.compare_digest(row.key_hash, hash_key(key)):
        return False
    row.revoked_at = utcnow()
    return True


def authenticate(session: Session, authorization: str | None) -> Tenant:
    """The tenant of a ``Bearer <key>`` header, or a 401."""
    key = bearer(authorization)
    if not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + PREFIX_LEN + 8:
        raise ApiError(401, "invalid_api_key", "invalid API key")
    row = session.scalar(select(ApiKey).where(ApiKey.prefix == _lookup_prefix(key)))
    if row is None or row.revoked_at is not None or not hmac.compare_digest(
            row.key_hash, hash_key(key)):
        raise ApiError(401, "invalid_api_key", "invalid API key")
    tenant = session.get(Tenant, row.tenant_id)
    assert tenant is not None
    return tenant


def bearer(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header, or a 401."""
    if not authorization:
        raise ApiError(401, "missing_api_key", "missing Authorization: Bearer <key> header")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "invalid_api_key", "expected Authorization: Bearer <key>")
    return token.strip()


def check_token(authorization: str | None, expected: str) -> None:
    """401 unless the bearer token equals expected (constant-time)."""
    if not hmac.compare_digest(bearer(authorization).encode(), expected.encode()):
        raise ApiError(401, "invalid_token", "invalid token")
