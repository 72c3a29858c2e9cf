"""Operator routes: /healthz, /readyz (Postgres and Redis reachable), Prometheus /metrics (the
per-state task counts only for the operator token) and GET /v1/cluster (nodes, GPUs and the
current plan; operator token)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response, Security
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy import func, select, text

from service.api.auth import check_token
from service.api.deps import SessionDep, SettingsDep, require_operator
from service.cluster import cluster_view
from service.models import TASK_STATES, Node, NodeState, Task
from service.queue import get_redis
from service.schemas import ClusterOut

router = APIRouter(tags=["operations"])
_operator_bearer = HTTPBearer(auto_error=False, scheme_name="OperatorToken",
                              description="Operator token (optional on /metrics)")


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


class _Without:
    """A registry view that leaves some metric families out of the exposition."""

    def __init__(self, registry: CollectorRegistry, hidden: set[str]) -> None:
        self.registry, self.hidden = registry, hidden

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        return (f for f in self.registry.collect() if f.name not in self.hidden)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus "
                             "exposition; task counts by state only with the operator token"}})
def metrics(request: Request, session: SessionDep, settings: SettingsDep,
            creds: HTTPAuthorizationCredentials | None = Security(_operator_bearer)) -> Response:
    """HTTP request counts and latency and the nodes/GPUs up for anyone; the per-state task
    gauges (every tenant's tasks together) only for the operator token."""
    m = request.app.state.prom
    operator = creds is not None
    if operator:  # a token that is given must be the right one: a 401 otherwise
        check_token(f"{creds.scheme} {creds.credentials}", settings.operator_token)
        counts = dict(session.execute(select(Task.state, func.count()).group_by(Task.state)).all())
        for state in TASK_STATES:
            m.tasks.labels(state=state).set(counts.get(state, 0))
    up = session.execute(select(func.count(), func.coalesce(func.sum(Node.gpu_count), 0)).where(
        Node.state == NodeState.UP)).one()
    m.nodes_up.set(up[0])
    m.gpus_up.set(up[1])
    registry = m.registry if operator else _Without(m.registry, {"loraplex_tasks"})
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/cluster", response_model=ClusterOut, dependencies=[Depends(require_operator)])
def cluster(session: SessionDep, settings: SettingsDep) -> ClusterOut:
    return cluster_view(session, settings)
