"""The async read routes (service.api.read_path: GET /v1/tasks and GET /v1/tasks/{id}/metrics on the
ReadPool): the same bytes as the models gave, the same auth and tenant isolation, revocation at
once despite the key cache, and a pool that survives dropped connections and reports outages
as the other routes do."""

from __future__ import annotations

import asyncio
import math
from datetime import timedelta

import pytest
from pydantic_core import to_json
from sqlalchemy import delete, select, text
from sqlalchemy.exc import OperationalError

from service import task_views
from service.core.db import READ_POOL_NAME, ReadPool
from service.core.localstack import free_port
from service.core.pagination import page_query
from service.models import Job, MetricPoint, Placement, Task, Tenant, utcnow
from service.schemas import JobCurves, LossPoint, MetricsOut, Page, TaskOut, ValPoint
from service.tenants import revoke_api_key


def _model_page(session, tenant_id: str, limit: int, after: str | None = None,  # noqa: ANN001
                state: str | None = None, price: float | None = None) -> bytes:
    """The JSON the ORM path gave (the page query the route ran before service.api.read_path, then
    service.task_views.task_outs and Page[TaskOut])."""
    session.expire_all()
    scope = select(Task).where(Task.tenant_id == tenant_id)
    query = scope if state is None else scope.where(Task.state == state)
    rows, more = page_query(session, Task, query, limit, after, scope=scope)
    return Page[TaskOut](data=task_views.task_outs(session, rows, price), has_more=more,
                         last_id=rows[-1].id if rows else None).model_dump_json().encode()


def test_task_pages_are_the_models_bytes(client, factory, session):  # noqa: ANN001
    t = factory.tenant()
    f = factory.file(t)["id"]
    ids = [factory.task(t, f, suffix="s" if i == 1 else None,
                        metadata={"team": "é\"x"} if i == 2 else None)["id"] for i in range(5)]
    client.post(f"/v1/tasks/{ids[0]}/cancel", headers=t.headers)
    node = factory.node()
    factory.placement(ids[1], node)  # a live placement: attempt and planned times
    failed = session.get(Placement, factory.placement(ids[3], node, publish=False))
    failed.state = "failed"  # a failed attempt and nothing live: attempt 2
    failed.estimated_s = 120  # the scheduler's estimate: the usage's estimated GPU-seconds
    job = session.scalars(select(Job).where(Job.task_id == ids[3])).first()
    session.add_all([MetricPoint(task_id=ids[3], job_id=job.id, step=s, split="train", loss=1.0,
                                 tokens=100 + s, gpu_seconds=0.25 * s) for s in (1, 2)])
    task = session.get(Task, ids[3])
    task.error = {"code": "x", "message": "boom \u2603"}
    task.settings = {**task.settings, "target_modules": ["q_proj", "v_proj"],
                     "validation_split": 1e-05}
    task.started_at = utcnow() - timedelta(microseconds=5)
    session.commit()
    for params in ({}, {"limit": 2}, {"limit": 2, "after": ids[3]}, {"limit": 1000},
                   {"state": "queued"}, {"state": "cancelled", "after": ids[4]},
                   {"state": "succeeded"}, {"after": ids[0]}):
        r = client.get("/v1/tasks", headers=t.headers, params=params)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json"
        expected = _model_page(session, t.id, min(params.get("limit", 20), 100),
                               params.get("after"), params.get("state"),
                               factory.settings.price_per_gpu_hour)
        assert r.content == expected, params
    assert [x["id"] for x in client.get("/v1/tasks", headers=t.headers).json()["data"]] \
        == ids[::-1]


def test_curves_are_the_models_bytes(client, factory, session):  # noqa: ANN001
    t = factory.tenant()
    tid = factory.task(t)["id"]
    jobs = session.scalars(select(Job).where(Job.task_id == tid).order_by(Job.index)).all()
    losses = [3.0, 1e-05, float("nan"), 2.5e22, 0.1 + 0.2, float("inf"), 7.0, 1.0 / 3]
    for k, job in enumerate(jobs[:3]):  # jobs[3] has no points
        for step, loss in enumerate(losses[k:], start=1):
            session.add(MetricPoint(task_id=tid, job_id=job.id, step=step, split="train",
                                    loss=loss))
        if k != 1:  # job 0's without token accuracy (DPO, or reported before it existed)
            session.add(MetricPoint(task_id=tid, job_id=job.id, step=4, split="val", loss=2.0,
                                    data={"token_accuracy": 1.0 / 3} if k == 2 else None))
    session.add(MetricPoint(task_id=tid, job_id=jobs[2].id, step=5, split="val", loss=1.5,
                            data={"token_accuracy": 0.25, "other": 1}))
    session.commit()
    url = f"/v1/tasks/{tid}/metrics"
    r = client.get(url, headers=t.headers)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"

    def points(job_id: str, split: str, after: int = -2) -> list[LossPoint]:
        rows = session.execute(select(MetricPoint.step, MetricPoint.loss, MetricPoint.data).where(
            MetricPoint.job_id == job_id, MetricPoint.split == split, MetricPoint.step > after)
            .order_by(MetricPoint.step)).all()
        kind = ValPoint if split == "val" else LossPoint
        return [kind(step=s, loss=x if math.isfinite(x) else None,
                     **({"token_accuracy": d["token_accuracy"]} if d and split == "val" else {}))
                for s, x, d in rows]

    def model(selected: list[Job], after: int = -2) -> bytes:
        body = MetricsOut(task_id=tid, jobs=[
            JobCurves(job_id=j.id, index=j.index, state=j.state, train=points(j.id, "train", after),
                      val=points(j.id, "val", after)) for j in selected]).model_dump(mode="json")
        for job in body["jobs"]:  # a validation point without token accuracy leaves the key out
            for p in job["val"]:
                if p["token_accuracy"] is None:
                    del p["token_accuracy"]
        return to_json(body)

    assert r.content == model(jobs)
    assert client.get(url, headers=t.headers, params={"job_id": jobs[2].id, "after_step": 2}
                      ).content == model([jobs[2]], after=2)
    assert client.get(url, headers=t.headers, params={"after_step": 99}).content \
        == model(jobs, after=99)
    # Downsampled curves: the same as the synchronous path (the dashboard's live view).
    from service.events import task_metrics_json

    short = client.get(url, headers=t.headers, params={"max_points": 4})
    assert short.content == task_metrics_json(session, session.get(Task, tid), max_points=4)
    assert len(short.json()["jobs"][0]["train"]) == 4
    missing = client.get(url, headers=t.headers, params={"job_id": "job_" + "0" * 24})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "job_id"
    malformed = client.get(url, headers=t.headers, params={"job_id": "job_x"})
    assert malformed.status_code == 422 and malformed.json()["error"]["param"] == "job_id"


def test_auth_isolation_and_revocation_at_once(client, factory, session):  # noqa: ANN001
    a, b = factory.tenant(), factory.tenant()
    ta = factory.task(a)["id"]
    tb = factory.task(b)["id"]
    for url in ("/v1/tasks", f"/v1/tasks/{ta}/metrics"):
        assert client.get(url).json()["error"]["code"] == "missing_api_key"
        assert client.get(url, headers={"Authorization": "Bearer lpx-0123456789nothing"}
                          ).status_code == 401
        assert client.get(url, headers={"Authorization": "Basic x"}).status_code == 401
        assert client.get(url, headers=a.headers).status_code == 200  # now in the key cache
    # Another tenant's task and cursor do not exist for b.
    assert client.get(f"/v1/tasks/{ta}/metrics", headers=b.headers).status_code == 404
    r = client.get("/v1/tasks", headers=b.headers, params={"after": ta})  # well-formed: a 404
    assert r.status_code == 404 and r.json()["error"]["param"] == "after"
    assert [x["id"] for x in client.get("/v1/tasks", headers=b.headers).json()["data"]] == [tb]
    # A bad key and a bad parameter: the 401 first, as on every route.
    assert client.get("/v1/tasks", params={"limit": 0}).status_code == 401
    assert client.get("/v1/tasks", headers=a.headers, params={"limit": 0}).status_code == 422
    # Revoked: the very next request is refused, although the key is in the cache.
    assert revoke_api_key(session, a.key)
    session.commit()
    for url in ("/v1/tasks", f"/v1/tasks/{ta}/metrics", "/v1/tasks?state=queued",
                "/v1/tasks?state=succeeded"):
        r = client.get(url, headers=a.headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", url
    # A deleted tenant's key (cached a moment ago) is refused at once too.
    assert client.get(f"/v1/tasks/{tb}/metrics", headers=b.headers).status_code == 200
    session.execute(delete(Task).where(Task.tenant_id == b.id))
    session.execute(text("DELETE FROM files WHERE tenant_id = :t"), {"t": b.id})
    session.execute(delete(Tenant).where(Tenant.id == b.id))
    session.commit()
    assert client.get("/v1/tasks", headers=b.headers).status_code == 401
    assert client.get(f"/v1/tasks/{tb}/metrics", headers=b.headers).status_code == 401
    # Input PostgreSQL cannot store is a 422, as before (not a crash).
    c = factory.tenant()
    assert client.get("/v1/tasks", headers=c.headers, params={"after": "a\x00b"}
                      ).status_code == 422


def test_read_pool_retries_dropped_connections_and_reports_outages(client, factory, session,
                                                                  settings):  # noqa: ANN001
    t = factory.tenant()
    tid = factory.task(t)["id"]
    assert client.get(f"/v1/tasks/{tid}/metrics", headers=t.headers).status_code == 200
    # PostgreSQL restarted (here: the pool's connections killed): the next read reconnects.
    killed = session.execute(text(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE application_name = :n AND datname = current_database()"),
        {"n": READ_POOL_NAME}).scalar()
    session.commit()
    assert killed >= 1
    for url in ("/v1/tasks", f"/v1/tasks/{tid}/metrics"):
        assert client.get(url, headers=t.headers).status_code == 200

    async def unreachable() -> None:
        pool = ReadPool(f"postgresql+psycopg://loraplex@127.0.0.1:{free_port()}/x")
        await pool.fetch("SELECT 1")

    with pytest.raises(OperationalError):  # the app answers it 503, as for the other routes
        asyncio.run(unreachable())

    async def bounded() -> set[int]:
        pool = ReadPool(settings.database_url, size=2)
        rows = await asyncio.gather(*(pool.fetch("SELECT pg_backend_pid(), pg_sleep(0.05)")
                                      for _ in range(6)))
        pool.discard_all()
        return {r[0][0] for r in rows}

    assert len(asyncio.run(bounded())) <= 2  # six reads shared two connections
    assert len(asyncio.run(bounded())) <= 2  # a new event loop: new connections, still works

    async def restarted() -> list:
        # Several idle connections, all dropped at once (as by a restart): one read still
        # succeeds, on a new connection.
        pool = ReadPool(settings.database_url, size=4)
        await asyncio.gather(*(pool.fetch("SELECT pg_sleep(0.05)") for _ in range(4)))
        killer = ReadPool(settings.database_url, size=1)
        await killer.fetch("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                           "application_name = %s AND pid <> pg_backend_pid()", (READ_POOL_NAME,))
        rows = await pool.fetch("SELECT 1")
        pool.discard_all()
        killer.discard_all()
        return rows

    assert asyncio.run(restarted()) == [(1,)]


def test_json_loads_reads_as_json_does() -> None:
    import json

    from service.core.db import json_loads

    for raw in (b'{"a": 123456789012345678901234567890, "b": 1.5}', b"[1e-05, 1E400, -0.0]",
                b'[18446744073709551615, -9223372036854775809, 0.30000000000000004]',
                '{"s": "caf\u00e9 \\u2603", "n": null, "t": [true, false]}'.encode(), b"{}"):
        got, want = json_loads(raw), json.loads(raw)
        assert got == want and repr(got) == repr(want), raw
    with pytest.raises(ValueError):
        json_loads(b"{nope")


def test_deployed_server_serves_the_read_routes(client, factory, settings,  # noqa: ANN001
                                                monkeypatch, app) -> None:  # noqa: ANN001
    """python -m service.api.serve with two processes, as deployed: both read routes answer with
    the in-process app's bytes; each process froze its startup objects out of the collector."""
    import gc
    import os
    import subprocess
    import sys
    import time

    import httpx

    from service.api import app as app_module
    from service.api import serve

    monkeypatch.setattr(app_module, "_default_app", app)
    assert serve.loaded_app() is app and gc.get_freeze_count() > 0
    gc.unfreeze()
    t = factory.tenant()
    tid = factory.task(t)["id"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")} | {
        "LORAPLEX_DATABASE_URL": settings.database_url, "LORAPLEX_REDIS_URL": settings.redis_url,
        "LORAPLEX_STORAGE_DIR": str(settings.storage_dir),
        "LORAPLEX_MODELS_FILE": str(settings.models_file), "LORAPLEX_WORKER_TOKEN": "w",
        "LORAPLEX_MAINTENANCE_INTERVAL_S": "0", "LORAPLEX_SCHEDULER_ENABLED": "false"}
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "service.api.serve", "--port", str(port),
                             "--workers", "2", "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        for url in ("/v1/tasks", f"/v1/tasks/{tid}/metrics"):
            got = [httpx.get(base + url, headers=t.headers, timeout=10) for _ in range(4)]
            assert {r.status_code for r in got} == {200}
            assert {r.content for r in got} == {client.get(url, headers=t.headers).content}
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, proc.stdout.read().decode()[-2000:]
