"""FastAPI dependencies shared by every route: settings, a DB session, storage, the model
registry, the calling tenant (API key), and the worker / operator tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from service.api.auth import ReadKey, authenticate, authenticate_read, check_token
from service.core.config import Settings
from service.core.registry import ModelRegistry
from service.core.storage import Storage
from service.models import Tenant

_bearer = HTTPBearer(auto_error=False, description="API key: `Authorization: Bearer lpx-...`")
_worker_bearer = HTTPBearer(auto_error=False, scheme_name="WorkerToken",
                            description="Worker token: `Authorization: Bearer <token>`")


# The trivial dependencies are async: FastAPI runs a sync one on the threadpool (a thread hop
# per dependency per request).
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    session = request.app.state.sessionmaker()
    try:
        yield session
    finally:
        session.close()


async def get_storage(request: Request) -> Storage:
    return request.app.state.storage


async def get_registry(request: Request) -> ModelRegistry:
    return request.app.state.registry


async def sent_json(request: Request) -> Any:
    """The request's JSON body as the client sent it (parsed; no default filled in), which an
    Idempotency-Key's digest is taken of; None when it is not JSON (the body's own 422)."""
    try:
        return json.loads(await request.body())
    except ValueError:
        return None


def _header(creds: HTTPAuthorizationCredentials | None) -> str | None:
    return f"{creds.scheme} {creds.credentials}" if creds else None


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
StorageDep = Annotated[Storage, Depends(get_storage)]
RegistryDep = Annotated[ModelRegistry, Depends(get_registry)]
SentJsonDep = Annotated[Any, Depends(sent_json)]


def current_tenant(session: SessionDep,
                   creds: HTTPAuthorizationCredentials | None = Security(_bearer)) -> Tenant:
    tenant = authenticate(session, _header(creds))
    return tenant


def require_worker(settings: SettingsDep,
                   creds: HTTPAuthorizationCredentials | None = Security(_worker_bearer)) -> None:
    check_token(_header(creds), settings.worker_token)


def require_operator(settings: SettingsDep,
                     creds: HTTPAuthorizationCredentials | None = Security(_worker_bearer)) -> None:
    check_token(_header(creds), settings.operator_token)


TenantDep = Annotated[Tenant, Depends(current_tenant)]


async def read_key(request: Request, creds: HTTPAuthorizationCredentials | None
                   = Security(_bearer)) -> ReadKey:
    """current_tenant for the async read routes (service.api.read_path): the caller's API key, on
    the event loop, with the same 401s."""
    return await authenticate_read(request.app.state.read_pool, _header(creds))


ReadKeyDep = Annotated[ReadKey, Depends(read_key)]
