"""Integration: /healthz, /readyz (and 503 when Redis is away), Prometheus /metrics,
/v1/cluster, and the operator command (migrate, create-tenant prints a working key)."""

from __future__ import annotations

import subprocess
import sys

from fastapi.testclient import TestClient

from service.app import create_app
from service.localstack import free_port


def test_health_and_ready(client):  # noqa: ANN001
    assert client.get("/healthz").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "checks": {"postgres": "ok", "redis": "ok"}}


def test_ready_fails_without_redis(settings):  # noqa: ANN001
    broken = settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0",
                                         "republish_on_startup": False})
    with TestClient(create_app(broken)) as c:
        r = c.get("/readyz")
        assert r.status_code == 503
        assert r.json()["checks"]["postgres"] == "ok"
        assert r.json()["checks"]["redis"].startswith("error")


def test_prometheus_metrics(client, factory):  # noqa: ANN001
    t = factory.tenant()
    factory.task(t)
    factory.node(gpus=4)
    client.get("/v1/tasks", headers=t.headers)
    text = client.get("/metrics").text
    assert 'loraplex_tasks{state="queued"} 1.0' in text
    assert "loraplex_gpus_up 4.0" in text
    assert 'loraplex_http_requests_total{method="GET",route="/v1/tasks",status="200"} 1.0' in text


def test_cluster_view(client, factory):  # noqa: ANN001
    t = factory.tenant()
    task = factory.task(t)
    node = factory.node("n1", gpus=8)
    pid = factory.placement(task["id"], node, gpus=(2, 3))
    for token in ("test-admin-token",):
        r = client.get("/v1/cluster", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200
    body = r.json()
    assert body["gpus_total"] == 8 and body["nodes"][0]["name"] == "n1"
    assert body["plan"][0]["id"] == pid and body["plan"][0]["gpu_indices"] == [2, 3]
    assert client.get("/v1/cluster", headers=factory.worker).status_code == 401  # admin set


def test_admin_cli_creates_working_key(client, settings):  # noqa: ANN001
    env = {"LORAPLEX_DATABASE_URL": settings.database_url, "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-m", "service.admin", "migrate"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    run = subprocess.run([sys.executable, "-m", "service.admin", "create-tenant", "acme"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    key = run.stdout.strip()
    assert key.startswith("lpx-")
    r = client.get("/v1/tasks", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200
    again = subprocess.run([sys.executable, "-m", "service.admin", "create-tenant", "acme",
                            "--if-missing"], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout == ""
