"""The browser dashboard, served by the API itself from files shipped in the package: ``/`` and
``/ui/`` answer the page, ``/ui/static/<name>`` its script and style, and
``GET /ui/v1/tasks/{id}/live`` streams one task as server-sent events (tenant API key, as every
/v1 route; the page reads it with fetch, so the key travels in the Authorization header);
``GET /ui/v1/methods`` lists the training methods (contract.methods) the create form offers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, RedirectResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from contract.methods import METHODS
from service import tasks
from service.api.deps import SessionDep, SettingsDep, TenantDep
from service.api.ui.live import LiveState, tick
from service.core.errors import not_found

router = APIRouter()
STATIC = Path(__file__).resolve().parent.parent / "ui" / "static"
MEDIA = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# The page loads nothing but its own files and talks only to this API.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; "
                                      "frame-ancestors 'none'; base-uri 'none'",
           "Referrer-Policy": "no-referrer"}
TICK_S = 1.0


def _static(name: str) -> FileResponse:
    files = {p.name: p for p in STATIC.iterdir() if p.suffix in MEDIA}
    path = files.get(name)
    if path is None:
        raise not_found("file", name, param="name")
    return FileResponse(path, media_type=MEDIA[path.suffix], headers=HEADERS)


@router.get("/", include_in_schema=False)
def root() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui", include_in_schema=False)
@router.get("/ui/", include_in_schema=False)
def index() -> FileResponse:
    return _static("index.html")


@router.get("/ui/static/{name}", include_in_schema=False)
def static(name: str) -> FileResponse:
    return _static(name)


@router.get("/ui/v1/methods", include_in_schema=False)
def methods() -> dict:
    """The methods, their files and their own knobs with defaults (no key: nothing private)."""
    return {"data": [{"name": m.name, "summary": m.summary, "formats": list(m.formats),
                      "knobs": [{"name": k.name, "default": k.default, "description": k.description}
                                for k in m.knobs]} for m in METHODS.values()]}


@router.get("/ui/v1/tasks/{task_id}/live", tags=["tasks"], response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "Server-sent events: `update` (JSON: task, jobs, "
                                            "events, points by job and split, reset), `end`."}})
def task_live(request: Request, session: SessionDep, tenant: TenantDep, settings: SettingsDep,
              task_id: str,
              max_points: Annotated[int, Query(ge=4, le=100_000)] = 500,
              duration_s: Annotated[float, Query(gt=0, le=600)] = 20) -> StreamingResponse:
    """The task as it trains: a first `update` with everything (curves downsampled to
    max_points), then one per second with what changed; `end` when the task has ended or after
    duration_s (reconnect for more). Streams stay short so that a restarting API process, which
    lets open responses finish, is never held long by a dashboard left open."""
    tasks.get_task(session, tenant, task_id)  # 404 for another tenant's task, before streaming
    sessionmaker = request.app.state.sessionmaker
    tenant_id = tenant.id

    def step(live: LiveState) -> tuple[dict | None, bool]:
        with sessionmaker() as s:
            return tick(s, tenant_id, task_id, live)

    async def stream() -> AsyncIterator[str]:
        live = LiveState(max_points=max_points, price=settings.price_per_gpu_hour)
        deadline = time.monotonic() + duration_s
        while True:
            update, ended = await run_in_threadpool(step, live)
            if update is not None:
                yield f"event: update\ndata: {json.dumps(update)}\n\n"
            else:
                yield ": idle\n\n"
            if ended or time.monotonic() >= deadline or await request.is_disconnected():
                yield f"event: end\ndata: {json.dumps({'ended': ended})}\n\n"
                return
            await asyncio.sleep(TICK_S)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
