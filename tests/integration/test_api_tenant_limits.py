"""Integration: a tenant's max_queued_tasks. POST /v1/tasks over it is a 429 that creates nothing
and claims no Idempotency-Key; concurrent creates at limit-1 admit exactly one; the admin CLI
sets and clears the limits; GET /v1/cluster shows usage against them."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import func, select

from service.core.config import get_settings
from service.models import IdempotencyKey, Task, Tenant
from service.scheduler.limits import admit_task

ADMIN = {"Authorization": "Bearer test-admin-token"}


def body(file_id: str) -> dict:
    return {"base_model": "tiny-llama", "training_file": file_id,
            "search_space": {"learning_rate": [1e-4], "lora_rank": [4]}, "max_seq_len": 128}


def set_limit(session, tenant_id: str, n: int | None) -> None:  # noqa: ANN001
    session.get(Tenant, tenant_id).max_queued_tasks = n
    session.commit()


def task_count(session, tenant_id: str) -> int:  # noqa: ANN001
    session.expire_all()
    return session.scalar(select(func.count()).select_from(Task).where(Task.tenant_id == tenant_id))


def test_over_the_limit_is_429_creates_nothing_and_keeps_the_key(client, factory, session):  # noqa: ANN001
    t = factory.tenant()
    f = factory.file(t)["id"]
    set_limit(session, t.id, 2)
    a = client.post("/v1/tasks", headers=t.headers, json=body(f)).json()["id"]
    b = client.post("/v1/tasks", headers=t.headers, json=body(f)).json()["id"]
    keyed = t.headers | {"Idempotency-Key": "k1"}
    r = client.post("/v1/tasks", headers=keyed, json=body(f))
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "queue_limit_exceeded" and err["param"] == "max_queued_tasks"
    assert "2 queued tasks" in err["message"] and "max_queued_tasks is 2" in err["message"]
    assert task_count(session, t.id) == 2
    assert session.get(IdempotencyKey, (t.id, "k1")) is None, "a rejected create claims no key"
    # Another tenant is not affected.
    other = factory.tenant()
    assert client.post("/v1/tasks", headers=other.headers,
                       json=body(factory.file(other)["id"])).status_code == 201
    # A cancel frees a slot: the retry with the same key now creates, and replays after that.
    assert client.post(f"/v1/tasks/{a}/cancel", headers=t.headers).status_code == 200
    r = client.post("/v1/tasks", headers=keyed, json=body(f))
    assert r.status_code == 201, r.text
    c = r.json()["id"]
    again = client.post("/v1/tasks", headers=keyed, json=body(f))
    assert again.status_code == 200 and again.json()["id"] == c
    assert client.post("/v1/tasks", headers=t.headers, json=body(f)).status_code == 429
    # A running task is not queued any more: its slot frees too.
    session.get(Task, b).state = "running"
    session.commit()
    assert client.post("/v1/tasks", headers=t.headers, json=body(f)).status_code == 201
    assert client.post("/v1/tasks", headers=t.headers, json=body(f)).status_code == 429
    usage = {u["tenant_id"]: u for u in client.get("/v1/cluster", headers=ADMIN).json()["tenants"]}
    assert usage[t.id]["queued_tasks"] == 2 and usage[t.id]["max_queued_tasks"] == 2
    assert usage[t.id]["running_tasks"] == 1 and usage[other.id]["queued_tasks"] == 1
    # No limit: no 429.
    set_limit(session, t.id, None)
    assert client.post("/v1/tasks", headers=t.headers, json=body(f)).status_code == 201


def test_a_create_waits_for_the_tenant_lock_and_then_counts(app, client, factory, session):  # noqa: ANN001
    t = factory.tenant()
    f = factory.file(t)["id"]
    set_limit(session, t.id, 2)
    assert client.post("/v1/tasks", headers=t.headers, json=body(f)).status_code == 201
    # Another transaction is admitting a create at limit-1 and holds the tenant's row lock.
    holder = app.state.sessionmaker()
    result: dict = {}
    try:
        admit_task(holder, holder.get(Tenant, t.id))

        def post() -> None:
            result["status"] = client.post("/v1/tasks", headers=t.headers, json=body(f)).status_code

        thread = threading.Thread(target=post)
        thread.start()
        thread.join(1.0)
        assert thread.is_alive(), "the second create must wait for the lock"
        first = session.scalar(select(Task).where(Task.tenant_id == t.id))
        holder.add(Task(tenant_id=t.id, base_model="tiny-llama", method="sft",
                        training_file_id=f, search_space=first.search_space,
                        settings=first.settings, state="queued"))
        holder.commit()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        holder.close()
    assert result["status"] == 429
    assert task_count(session, t.id) == 2


def test_racing_creates_at_limit_minus_one_admit_exactly_one(client, factory, session):  # noqa: ANN001
    t = factory.tenant()
    f = factory.file(t)["id"]
    set_limit(session, t.id, 3)
    for _ in range(2):
        assert client.post("/v1/tasks", headers=t.headers, json=body(f)).status_code == 201
    barrier = threading.Barrier(4)
    statuses: list[int] = []

    def post() -> None:
        barrier.wait()
        statuses.append(client.post("/v1/tasks", headers=t.headers, json=body(f)).status_code)

    threads = [threading.Thread(target=post) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert sorted(statuses) == [201, 429, 429, 429]
    assert task_count(session, t.id) == 3


def test_admin_cli_sets_and_clears_limits(settings, session, monkeypatch, capsys):  # noqa: ANN001
    from service.admin import main

    monkeypatch.setenv("LORAPLEX_DATABASE_URL", settings.database_url)
    get_settings.cache_clear()
    try:
        assert main(["create-tenant", "acme", "--max-queued-tasks", "5"]) == 0
        assert main(["set-limit", "acme", "--max-gpus", "4"]) == 0
        session.expire_all()
        row = session.scalar(select(Tenant).where(Tenant.name == "acme"))
        assert (row.max_gpus, row.max_queued_tasks) == (4, 5), "a flag left out is kept"
        assert main(["set-limit", "acme", "--max-queued-tasks", "2", "--max-gpus", "none"]) == 0
        session.expire_all()
        assert (row.max_gpus, row.max_queued_tasks) == (None, 2)
        assert main(["set-limit", "acme"]) == 2
        assert main(["set-limit", "nobody", "--max-queued-tasks", "1"]) == 1
        capsys.readouterr()
        assert main(["list-tenants"]) == 0
        assert "max_queued_tasks=2" in capsys.readouterr().out
    finally:
        get_settings.cache_clear()
    with pytest.raises(SystemExit):  # argparse refuses a negative limit
        main(["set-limit", "acme", "--max-queued-tasks", "-1"])
