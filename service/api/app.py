"""The FastAPI application: create_app() wires settings, database, storage, model registry,
Redis, error handlers, Prometheus instrumentation and the routers. ``service.api.app:app`` for uvicorn."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.background import Background
from service.api.error_docs import document_errors
from service.api.routes import (
    files,
    fine_tuning,
    internal,
    merged,
    ops,
    sample_requests,
    samples,
    tasks,
    ui,
    usage,
    webhooks,
)
from service.cluster import watch_service_health
from service.core.config import Settings, get_settings
from service.core.db import ReadPool, make_engine, make_sessionmaker
from service.core.errors import error_body, install_error_handlers
from service.core.registry import ModelRegistry
from service.core.storage import LocalStorage
from service.queue import configure as configure_queue
from service.webhooks.delivery import Deliverer

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
    uploads whose Content-Length is already over the limit (before the body is read). A body
    without Content-Length (chunked) is counted as it streams by the upload route itself."""

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
                    f"{self.settings.max_upload_bytes}", "file", 413))
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


def log_development_settings(settings: Settings) -> None:
    """Say so when webhooks or tracking may reach loopback and private addresses: the local
    stack's development settings (scripts/loraplex-up.sh), off in deploy/."""
    for name, on, what in (
            ("LORAPLEX_WEBHOOK_ALLOW_PRIVATE", settings.webhook_allow_private, "webhook receivers"),
            ("LORAPLEX_TRACKING_ALLOW_PRIVATE", settings.tracking_allow_private, "MLflow servers")):
        if on:
            log.warning("development setting %s=true: %s on loopback and private addresses are "
                        "allowed (keep it false in production)", name, what)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    log_development_settings(settings)
    engine = make_engine(settings.database_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Every process answers requests; the one that wins the leader election also replans,
        # re-publishes and runs the maintenance loop (service.api.background).
        if settings.maintenance_interval_s > 0:  # node silence counts from this start at most
            watch_service_health(settings)
        background = Background(app.state.sessionmaker, settings, app.state.storage,
                                app.state.registry).start()
        app.state.background = background
        app.state.replanner = background.replanner
        # Every process delivers webhooks (rows are claimed with SKIP LOCKED, not by the leader).
        if settings.webhook_poll_s > 0:
            app.state.deliverer = Deliverer(app.state.sessionmaker, settings).start()
        yield
        if app.state.deliverer is not None:
            app.state.deliverer.stop()
        background.stop()
        app.state.read_pool.discard_all()
        engine.dispose()

    app = FastAPI(title="loraplex", version=API_VERSION, lifespan=lifespan,
                  description="Multi-tenant LoRA fine-tuning service: many adapters per "
                              "backbone, loss-aware early exit, CP-SAT scheduling.")
    app.state.settings = settings
    app.state.sessionmaker = make_sessionmaker(engine)
    app.state.read_pool = ReadPool(settings.database_url)  # the async read routes' connections
    app.state.storage = LocalStorage(settings.storage_dir)
    app.state.registry = ModelRegistry(settings.models_file)
    app.state.prom = _prom()
    app.state.background = None  # this process's replanner and leader election, while it runs
    app.state.replanner = None  # the background replanner, while the lifespan runs
    app.state.deliverer = None  # this process's webhook deliverer, while the lifespan runs
    configure_queue(settings.redis_url)
    install_error_handlers(app)
    for module in (files, tasks, samples, sample_requests, merged, fine_tuning, internal, ops, ui, usage, webhooks):
        app.include_router(module.router)
    app.include_router(samples.internal)
    app.include_router(sample_requests.internal)
    document_errors(app)  # every route's error statuses, with the error schema
    app.add_middleware(Instrument, prom=app.state.prom, settings=settings)
    return app


_default_app: FastAPI | None = None


def __getattr__(name: str) -> FastAPI:
    # `uvicorn service.api.app:app` builds the app on first access, from the environment's
    # settings, so merely importing this module has no effects.
    global _default_app
    if name == "app":
        if _default_app is None:
            _default_app = create_app()
        return _default_app
    raise AttributeError(name)
