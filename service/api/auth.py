"""Who is calling: the tenant of a request's ``Bearer lpx-...`` API key (looked up by its
prefix, compared by its sha256 hash; service.tenants makes and revokes keys), and the worker and
operator tokens."""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.db import ReadPool
from service.core.errors import ApiError
from service.models import ApiKey, Tenant
from service.tenants import KEY_PREFIX, PREFIX_LEN, hash_key, lookup_prefix


def authenticate(session: Session, authorization: str | None) -> Tenant:
    """The tenant of a ``Bearer <key>`` header, or a 401. One statement: the key and its
    tenant."""
    key = api_key_of(authorization)
    row = session.execute(select(ApiKey.key_hash, ApiKey.revoked_at, Tenant)
                          .join(Tenant, Tenant.id == ApiKey.tenant_id)
                          .where(ApiKey.prefix == lookup_prefix(key))).first()
    return _accepted(hash_key(key), row)[2]


@dataclass(frozen=True)
class ReadKey:
    """A request's API key as the async read routes (service.api.read_path) use it: its lookup
    prefix and hash, which their statements check again (the tenant is the one of the live key
    of that hash), and its tenant when the key was last seen live."""
    prefix: str
    key_hash: str
    tenant_id: str


# The key of a request to the async read routes, and whether it is live.
READ_KEY_SQL = ("SELECT k.key_hash, k.revoked_at, k.tenant_id FROM api_keys k "
                "JOIN tenants t ON t.id = k.tenant_id WHERE k.prefix = %s")
# A key found live is not asked again for this long before the route's own statement, which
# checks it anyway: so a revoked or deleted key (or tenant) stops reading at once; only the
# order of the errors of a request that is wrong twice (a key revoked these last seconds and
# a bad parameter: 422 before 401) can show the cache.
READ_KEY_TTL_S = 10.0
READ_KEY_CACHE_SIZE = 4096
_live_keys: dict[str, tuple[float, ReadKey]] = {}


async def authenticate_read(pool: ReadPool, authorization: str | None) -> ReadKey:
    """authenticate() for the async read routes, on the event loop: the key, or the same 401s.
    Keys seen live in the last READ_KEY_TTL_S are not asked again here (the routes' statements
    check them: read_key_live)."""
    key = api_key_of(authorization)
    digest = hash_key(key)
    now = time.monotonic()
    cached = _live_keys.get(digest)
    if cached is not None and now - cached[0] < READ_KEY_TTL_S:
        return cached[1]
    rows = await pool.fetch(READ_KEY_SQL, (lookup_prefix(key),))
    _accepted(digest, rows[0] if rows else None)
    found = ReadKey(lookup_prefix(key), digest, rows[0][2])
    if len(_live_keys) >= READ_KEY_CACHE_SIZE:
        _live_keys.clear()
    _live_keys[digest] = (now, found)
    return found


async def read_key_live(pool: ReadPool, key: ReadKey) -> None:
    """A 401 unless key is still live (a route whose statement found nothing asks why)."""
    rows = await pool.fetch(READ_KEY_SQL, (key.prefix,))
    try:
        _accepted(key.key_hash, rows[0] if rows else None)
    except ApiError:
        _live_keys.pop(key.key_hash, None)
        raise


def api_key_of(authorization: str | None) -> str:
    """The API key of a ``Bearer lpx-...`` header, or a 401 when there is none or it is not
    shaped like one."""
    key = bearer(authorization)
    if not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + PREFIX_LEN + 8:
        raise ApiError(401, "invalid_api_key", "invalid API key")
    return key


def _accepted(key_hash: str, row: Any) -> Any:
    """row (key_hash, revoked_at, ...) if it is the live key of that hash, else a 401."""
    if row is None or row[1] is not None or not hmac.compare_digest(row[0], key_hash):
        raise ApiError(401, "invalid_api_key", "invalid API key")
    return row


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
