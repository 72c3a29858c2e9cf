"""The FastAPI application: create_app() wires settings, database, storage, model registry,
Redis, error handlers, Prometheus instrumentation and the routers. ``service.app:app`` for uvicorn."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.cluster import mark_stale_nodes, start_replanner, stop_replanner
from service.config import Settings, get_settings
from service.db import make_engine, make_sessionmaker, session_scope
from service.errors import error_body, install_error_handlers
from service.queue import configure as configure_queue
from service.queue import republish_all
from service.registry import ModelRegistry
from service.routes import files, internal, ops, tasks
from service.storage import LocalStorage

log = logging.getLogger("loraplex.api")
API_VERSION = "0.1.0"


@dataclass
class Prom:
    registry: CollectorRegistry
    requests: Counter
    latency: Histogram
    tasks: Gauge
    nodes_up: Gauge
    gpus_up: Gauge


def _prom() -> Prom:
    reg = CollectorRegistry()
    return Prom(
        registry=reg,
        requests=Counter("loraplex_http_requests", "HTTP requests", ["method", "route", "status"],
                         registry=reg),
        latency=Histogram("loraplex_http_request_seconds", "HTTP request latency",
                          ["method", "route"], registry=reg),
        tasks=Gauge("loraplex_tasks", "Tasks by state", ["state"], registry=reg),
        nodes_up=Gauge("loraplex_nodes_up", "Nodes up", registry=reg),
        gpus_up=Gauge("loraplex_gpus_up", "GPUs on nodes that are up", registry=reg),
    )


class Instrument:
    """Pure ASGI middleware: request counts/latency by route template, and an early 413 for
    uploads whose Content-Length is already over the limit (before the body is read)."""

    def __init__(self, app: ASGIApp, prom: Prom, settings: Settings) -> None:
        self.app, self.prom, self.settings = app, prom, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "POST" and scope["path"] == "/v1/files":
            length = dict(scope["headers"]).get(b"content-length")
            if length and length.isdigit() and int(length) > self.settings.max_upload_bytes + 65536:
                await _send_json(send, 413, error_body(
                    "file_too_large", f"upload of {int(length)} bytes is over the limit of "
                    f"{self.settings.max_upload_bytes}", "file"))
                return
        status = {"code": 500}

        async def _send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        start = time.perf_counter()
        try:
            await self.app(scope, receive, _send)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.prom.requests.labels(scope["method"], route, str(status["code"])).inc()
            self.prom.latency.labels(scope["method"], route).observe(time.perf_counter() - start)


async def _send_json(send: Send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})


def _maintenance(factory: sessionmaker[Session], settings: Settings,
                 stop: threading.Event) -> None:
    """Background upkeep: nodes silent for node_timeout_s go down (their tasks are requeued),
    and published placements missing from Redis are queued again."""
    while not stop.wait(settings.maintenance_interval_s):
        try:
            with session_scope(factory) as session:
                mark_stale_nodes(session, settings)
                republish_all(session, settings)
        except Exception:
            log.exception("maintenance pass failed")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    engine = make_engine(settings.database_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.republish_on_startup:
            try:
                with session_scope(app.state.sessionmaker) as session:
                    republish_all(session, settings)
            except Exception as exc:  # the API can serve reads while Redis/Postgres come up
                log.warning("republish at startup failed error=%s", exc)
        stop = threading.Event()
        thread = None
        if settings.maintenance_interval_s > 0:
            thread = threading.Thread(target=_maintenance, name="loraplex-maintenance",
                                      args=(app.state.sessionmaker, settings, stop), daemon=True)
            thread.start()
        replanner = start_replanner(app.state.sessionmaker, settings)
        app.state.replanner = replanner
        yield
        stop_replanner(replanner, settings)
        stop.set()
        if thread is not None:
            thread.join(timeout=10)
        engine.dispose()

    app = FastAPI(title="loraplex", version=API_VERSION, lifespan=lifespan,
                  description="Multi-tenant LoRA fine-tuning service: many adapters per "
                              "backbone, loss-aware early exit, CP-SAT scheduling.")
    app.state.settings = settings
    app.state.sessionmaker = make_sessionmaker(engine)
    app.state.storage = LocalStorage(settings.storage_dir)
    app.state.registry = ModelRegistry(settings.models_file)
    app.state.prom = _prom()
    app.state.replanner = None  # the background replanner, while the lifespan runs
    configure_queue(settings.redis_url)
    install_error_handlers(app)
    for module in (files, tasks, internal, ops):
        app.include_router(module.router)
    app.add_middleware(Instrument, prom=app.state.prom, settings=settings)
    return app


_default_app: FastAPI | None = None


def __getattr__(name: str) -> FastAPI:
    # `uvicorn service.app:app` builds the app on first access, from the environment's
    # settings, so merely importing this module has no effects.
    global _default_app
    if name == "app":
        if _default_app is None:
            _default_app = create_app()
        return _default_app
    raise AttributeError(name)
