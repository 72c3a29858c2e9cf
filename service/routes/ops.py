"""Operator routes: /healthz, /readyz (Postgres and Redis reachable), Prometheus /metrics and
GET /v1/cluster (nodes, GPUs and the current plan; operator token)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import func, select, text

from service.cluster import cluster_view
from service.deps import SessionDep, SettingsDep, require_operator
from service.models import TASK_STATES, Node, Task
from service.queue import get_redis
from service.schemas import ClusterOut

router = APIRouter(tags=["operations"])


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Postgres or Redis unreachable"}})
def readyz(session: SessionDep, settings: SettingsDep) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        session.execute(text("SELECT 1"))
        checks["postgres"] = "ok"
    except Exception as exc:  # any driver error means not ready
        checks["postgres"] = f"error: {type(exc).__name__}"
    try:
        get_redis(settings).ping()
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"error: {type(exc).__name__}"
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ok" if ok else "unavailable", "checks": checks},
                        status_code=200 if ok else 503)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}})
def metrics(request: Request, session: SessionDep) -> Response:
    m = request.app.state.prom
    counts = dict(session.execute(select(Task.state, func.count()).group_by(Task.state)).all())
    for state in TASK_STATES:
        m.tasks.labels(state=state).set(counts.get(state, 0))
    up = session.execute(select(func.count(), func.coalesce(func.sum(Node.gpu_count), 0)).where(
        Node.state == "up")).one()
    m.nodes_up.set(up[0])
    m.gpus_up.set(up[1])
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/cluster", response_model=ClusterOut, dependencies=[Depends(require_operator)])
def cluster(session: SessionDep) -> ClusterOut:
    return cluster_view(session)
