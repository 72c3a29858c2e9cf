"""Integration: co-location in service.scheduler.replan against the real Postgres and Redis. A node's
heartbeat reports its shared executors; a queued task of the same colocation key joins one (a
placement on its GPUs while another task's placement is live there), others do not; stale reports
are ignored; a warm idle executor's GPUs go to its key; tenants' caps count co-located shares."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from contract.protocol import colocation_key
from service.models import Node, Placement, Task, Tenant, utcnow
from service.scheduler.colocation import tenant_usage
from service.scheduler.loop import _live_placements, build_instance

pytestmark = pytest.mark.with_scheduler
ADMIN = {"Authorization": "Bearer test-admin-token"}


@pytest.fixture
def settings(settings):  # noqa: ANN001, ANN201 - conftest's, in sync mode
    return settings.model_copy(update={"scheduler_replan": "sync"})


def task(factory, tenant, batch: int = 4, **kw) -> str:  # noqa: ANN001
    space = {"learning_rate": [1e-4, 3e-4], "batch_size": [batch]}
    return factory.task(tenant, search_space=space, **kw)["id"]


def key_of(session, task_id: str) -> str:  # noqa: ANN001
    t = session.get(Task, task_id)
    return colocation_key(t.base_model, t.method, t.settings["max_seq_len"],
                          t.settings["target_modules"])


def live(session, task_id: str) -> Placement | None:  # noqa: ANN001
    session.expire_all()
    return session.scalar(select(Placement).where(
        Placement.task_id == task_id, Placement.state.in_(("published", "claimed", "running"))))


def claim(client, factory, session, task_id: str, node: str) -> str:  # noqa: ANN001
    p = live(session, task_id)
    assert p is not None and p.node_id == node
    r = client.post(f"/internal/v1/placements/{p.id}/claim", headers=factory.worker,
                    json={"node_id": node})
    assert r.status_code == 200, r.text
    return p.id


def report(client, factory, node: str, running: list[str], executors: list[dict]) -> None:  # noqa: ANN001
    r = client.post(f"/internal/v1/nodes/{node}/heartbeat", headers=factory.worker,
                    json={"running_placement_ids": running, "executors": executors})
    assert r.status_code == 200, r.text


def executor(key: str, gpus: list[int], hosted: list[str], free: int, total: int = 16) -> dict:
    return {"key": key, "gpu_indices": gpus, "placement_ids": hosted, "free_rows": free,
            "total_rows": total}


def hosting(client, factory, session, tenant, gpus: int = 1, free: int = 8  # noqa: ANN001
            ) -> tuple[str, str, str]:
    """A node whose GPU 0 runs a task (claimed) in a shared executor that reports ``free`` rows:
    (node, task, placement)."""
    node = factory.node("n0", gpus=gpus)
    first = task(factory, tenant)
    pid = claim(client, factory, session, first, node)
    report(client, factory, node, [pid], [executor(key_of(session, first), [0], [pid], free)])
    return node, first, pid


def test_same_key_joins_a_busy_executor_others_wait(client, factory, session) -> None:  # noqa: ANN001
    a, b = factory.tenant(), factory.tenant()
    node, first, pid = hosting(client, factory, session, a, free=8)
    other_key = task(factory, b, max_seq_len=256)  # waits for the GPU: planned, not published
    too_big = task(factory, b, batch=16)  # same key, but 16 rows > 8 free
    assert live(session, other_key) is None and live(session, too_big) is None
    stored = session.get(Node, node)
    session.refresh(stored)
    assert stored.executors[0]["free_rows"] == 8 and stored.executors_at is not None
    joiner = task(factory, b)  # 2 jobs x 4 rows: fits in 8 free rows
    p = live(session, joiner)
    assert p is not None and p.state == "published"
    assert p.node_id == node and p.gpu_indices == [0]
    assert live(session, first).id == pid  # the hosted task is untouched
    assert live(session, other_key) is None and live(session, too_big) is None
    view = client.get("/v1/cluster", headers=ADMIN).json()
    [gpu] = view["gpus"]
    assert {x["task_id"] for x in gpu["placements"] if x["state"] != "planned"} == {first, joiner}
    # the planner counts the shared GPU once: the waiting tasks are planned after both end
    both_end = max(live(session, t).planned_end for t in (first, joiner))
    planned = session.scalar(select(Placement).where(Placement.task_id == other_key,
                                                     Placement.state == "planned"))
    assert planned.planned_start >= both_end - timedelta(seconds=61)
    # each tenant's share of the one GPU, by rows (8 each): half and half
    inst, _, _ = build_instance(session, client.app.state.settings, utcnow())
    hosted, _, _ = _live_placements(session, inst)
    assert tenant_usage(hosted) == {a.id: 0.5, b.id: 0.5}


def test_a_stale_report_or_a_down_node_is_not_joined(client, factory, session) -> None:  # noqa: ANN001
    t = factory.tenant()
    node, _, _ = hosting(client, factory, session, t, free=8)
    row = session.get(Node, node)
    row.executors_at = utcnow() - timedelta(seconds=31)  # node_timeout_s is 30
    session.commit()
    late = task(factory, t)
    assert live(session, late) is None
    row = session.get(Node, node)
    row.executors_at, row.state = utcnow(), "down"
    session.commit()
    assert live(session, task(factory, t)) is None


def test_an_idle_warm_executor_goes_to_its_key(client, factory, session) -> None:  # noqa: ANN001
    node = factory.node("n0", gpus=2)
    t = factory.tenant()
    probe = task(factory, t)  # learn the key, then free the cluster again
    key = key_of(session, probe)
    assert client.post(f"/v1/tasks/{probe}/cancel", headers=t.headers).status_code == 200
    report(client, factory, node, [], [executor(key, [1], [], free=16)])
    same = task(factory, t)
    assert live(session, same).gpu_indices == [1], "the warm copy of its model, not GPU 0"
    other = task(factory, t, max_seq_len=256)  # another key takes the other GPU at once
    assert live(session, other).gpu_indices == [0]


def test_a_tenant_at_its_cap_does_not_join(client, factory, session) -> None:  # noqa: ANN001
    n0, n1 = factory.node("n0", gpus=1), factory.node("n1", gpus=1)
    a, capped = factory.tenant(), factory.tenant()
    host = task(factory, a)
    held = task(factory, capped)
    placed = {live(session, host).node_id: host, live(session, held).node_id: held}
    pids = {n: claim(client, factory, session, placed[n], n) for n in (n0, n1)}
    row = session.get(Tenant, capped.id)
    row.max_gpus = 1  # it holds one whole GPU already
    session.commit()
    host_node = live(session, host).node_id
    report(client, factory, host_node, [pids[host_node]],
           [executor(key_of(session, host), [0], [pids[host_node]], free=8)])
    blocked = task(factory, capped)
    assert live(session, blocked) is None, "1 GPU + a share of another is over its cap of 1"
    free = task(factory, a)
    assert live(session, free).node_id == host_node


def test_register_forgets_reports(client, factory, session) -> None:  # noqa: ANN001
    node = factory.node("n0", gpus=1)
    report(client, factory, node, [], [executor("m|sft|128|*", [0], [], free=16)])
    factory.node("n0", gpus=1)  # the daemon restarted: it reports its executors anew
    session.expire_all()
    row = session.get(Node, node)
    assert row.executors is None and row.executors_at is None


def test_reclaim_pauses_every_task_of_a_shared_executor(client, factory, session) -> None:  # noqa: ANN001
    a, b, owner = factory.tenant(), factory.tenant(), factory.tenant()
    row = session.get(Tenant, owner.id)
    row.guaranteed_gpus = 1
    session.commit()
    node, first, pid = hosting(client, factory, session, a, free=8)
    joiner = task(factory, b)
    pid2 = claim(client, factory, session, joiner, node)
    assert {live(session, t).stop_requested for t in (first, joiner)} == {None}
    waiting = task(factory, owner, max_seq_len=256)  # its guaranteed GPU is lent to a and b
    session.expire_all()
    assert {session.get(Placement, p).stop_requested for p in (pid, pid2)} == {"requeue"}
    assert live(session, waiting) is None  # it starts when they have stopped


def test_a_free_gpu_comes_before_joining(client, factory, session) -> None:  # noqa: ANN001
    t = factory.tenant()
    hosting(client, factory, session, t, gpus=2, free=16)
    second = task(factory, t)
    assert live(session, second).gpu_indices == [1], "a free GPU first"
    third = task(factory, t)  # no GPU free now: it joins the busy executor
    assert live(session, third).gpu_indices == [0]


def test_a_heartbeat_with_new_room_replans(client, factory, session) -> None:  # noqa: ANN001
    node = factory.node("n0", gpus=1)
    t = factory.tenant()
    first = task(factory, t)
    pid = claim(client, factory, session, first, node)
    waiting = task(factory, t)  # no executor reported yet: it waits for the GPU
    assert live(session, waiting) is None
    key = key_of(session, first)
    report(client, factory, node, [pid], [executor(key, [0], [pid], free=0)])
    assert live(session, waiting) is None  # no room
    report(client, factory, node, [pid], [executor(key, [0], [pid], free=8)])  # warmup pruned
    assert live(session, waiting).gpu_indices == [0], "the heartbeat itself replanned"
