"""Integration: /healthz, /readyz (and 503 when Redis is away), Prometheus /metrics,
/v1/cluster, and the operator command (migrate, create-tenant prints a working key)."""

from __future__ import annotations

import subprocess
import sys

from fastapi.testclient import TestClient
from sqlalchemy import select

from service.api.app import create_app
from service.core.config import get_settings
from service.core.localstack import free_port
from service.models import Tenant


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


def test_database_down_is_503(settings):  # noqa: ANN001
    gone = settings.model_copy(update={
        "database_url": f"postgresql+psycopg://loraplex@127.0.0.1:{free_port()}/x",
        "republish_on_startup": False})
    with TestClient(create_app(gone)) as c:
        r = c.get("/v1/tasks", headers={"Authorization": "Bearer lpx-0123456789abcdefghijkl"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        assert r.headers["Retry-After"] == "5"
        ready = c.get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["redis"] == "ok"


def test_a_deadlock_answers_a_retryable_concurrent_change(db_url):  # noqa: ANN001
    """A real deadlock (PostgreSQL picks a victim and rolls it back) is a 503 'retry now' that
    says nothing changed, not 'the database is unavailable' with a 5 s wait."""
    import threading

    from fastapi import FastAPI
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    from service.core.errors import install_error_handlers

    engine = create_engine(db_url)
    with engine.begin() as c:
        c.execute(text("CREATE TABLE lock_pair (id int PRIMARY KEY)"))
        c.execute(text("INSERT INTO lock_pair VALUES (1), (2)"))
    failures: list[OperationalError] = []
    both_hold = threading.Barrier(2)

    def cross(first: int, second: int) -> None:
        try:
            with engine.begin() as c:
                c.execute(text("SELECT 1 FROM lock_pair WHERE id = :i FOR UPDATE"), {"i": first})
                both_hold.wait()
                c.execute(text("SELECT 1 FROM lock_pair WHERE id = :i FOR UPDATE"), {"i": second})
        except OperationalError as exc:
            failures.append(exc)

    threads = [threading.Thread(target=cross, args=pair) for pair in ((1, 2), (2, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    engine.dispose()
    assert len(failures) == 1 and failures[0].orig.sqlstate == "40P01"

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    def boom() -> None:
        raise failures[0]

    r = TestClient(app).get("/boom")
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["code"] == "concurrent_change"
    assert "changed nothing" in r.json()["error"]["message"]


def test_prometheus_metrics(client, factory):  # noqa: ANN001
    t = factory.tenant()
    factory.task(t)
    factory.node(gpus=4)
    client.get("/v1/tasks", headers=t.headers)
    op = {"Authorization": "Bearer test-admin-token"}
    text = client.get("/metrics", headers=op).text
    assert 'loraplex_tasks{state="queued"} 1.0' in text
    assert "loraplex_gpus_up 4.0" in text
    assert 'loraplex_http_requests_total{method="GET",route="/v1/tasks",status="200"} 1.0' in text
    # the public exposition has no task counts (every tenant's tasks together), even after an
    # operator scrape set them
    public = client.get("/metrics")
    assert public.status_code == 200 and "loraplex_gpus_up 4.0" in public.text
    assert "loraplex_tasks" not in public.text and "loraplex_http_requests_total" in public.text
    for bad in (factory.worker, t.headers, {"Authorization": "Bearer nope"}):
        r = client.get("/metrics", headers=bad)
        assert r.status_code == 401 and "loraplex_tasks" not in r.text


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


def test_admin_cli_creates_working_key(client, settings, session, monkeypatch):  # noqa: ANN001
    from service.admin import main

    env = {"LORAPLEX_DATABASE_URL": settings.database_url, "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-m", "service.admin", "create-tenant", "acme"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    key = run.stdout.strip()
    assert key.startswith("lpx-")
    r = client.get("/v1/tasks", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", settings.database_url)
    get_settings.cache_clear()
    try:
        assert main(["migrate"]) == 0  # already at head: a no-op
        assert main(["create-tenant", "acme", "--if-missing"]) == 0
        assert main(["create-tenant", "acme"]) == 1
        assert main(["set-limit", "acme", "--max-gpus", "4"]) == 0
        assert main(["set-limit", "nobody", "--max-gpus", "4"]) == 1
        assert main(["revoke-key", key]) == 0
        assert main(["revoke-key", key + "x"]) == 1
    finally:
        get_settings.cache_clear()
    assert client.get("/v1/tasks", headers={"Authorization": f"Bearer {key}"}).status_code == 401
    session.expire_all()
    assert session.scalar(select(Tenant.max_gpus).where(Tenant.name == "acme")) == 4


def test_maintenance_thread_marks_nodes_down_and_republishes(settings, session):  # noqa: ANN001
    import time

    import redis
    from rq import Queue

    from contract.protocol import node_queue_name
    from tests.integration.factories import Factory

    fast = settings.model_copy(update={"maintenance_interval_s": 0.2, "node_timeout_s": 1.5})
    with TestClient(create_app(fast)) as c:
        f = Factory(session=session, client=c, settings=fast)
        t = f.tenant()
        waiting, running = f.task(t)["id"], f.task(t)["id"]
        silent, alive = f.node(), f.node()
        queued = f.placement(waiting, alive)
        pid = f.placement(running, silent)
        c.post(f"/internal/v1/placements/{pid}/claim", headers=f.worker,
               json={"node_id": silent})
        conn = redis.Redis.from_url(fast.redis_url)
        conn.flushall()
        queue = Queue(node_queue_name(alive), connection=conn)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            c.post(f"/internal/v1/nodes/{alive}/heartbeat", headers=f.worker, json={})
            state = c.get(f"/v1/tasks/{running}", headers=t.headers).json()["state"]
            if state == "queued" and queue.get_job_ids():
                break
            time.sleep(0.2)
        assert c.get(f"/v1/tasks/{running}", headers=t.headers).json()["state"] == "queued"
        assert [j.args for j in queue.get_jobs()] == [(queued,)]
        nodes = c.get("/v1/cluster", headers={"Authorization": "Bearer test-admin-token"})
        states = {n["id"]: n["state"] for n in nodes.json()["nodes"]}
        assert states == {silent: "down", alive: "up"}
