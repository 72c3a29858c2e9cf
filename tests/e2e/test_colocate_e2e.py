"""Co-location end to end (real service, PostgreSQL, Redis, a real daemon, the real executor training
a tiny Llama on CPU): tasks of two tenants on the same base model, placed on the same GPU of one
node (by hand, as the scheduler places a task that joins a warm executor), train on ONE shared
executor process; each ends with its own curves and adapters, and cancelling one mid-training
leaves the others training to success. Then with the scheduler: a task POSTed while the node's
only GPU trains another task of its model joins that executor (the daemon's heartbeat reports
it), and both succeed."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import Stack, upload_jsonl, wait_for
from tests.e2e.test_chaos import check_guarantees, rows
from tests.e2e.test_daemon_loop import events, state_of
from tests.e2e.test_train_e2e import models_yaml  # noqa: F401 - the tiny Llama as "tiny"

pytest.importorskip("torch")


def start_task(http, n: int, epochs: int, seed: int, queued: bool = True) -> str:  # noqa: ANN001
    r = http.post("/v1/tasks", json={
        "base_model": "tiny", "training_file": upload_jsonl(http, "train.jsonl", rows(n, seed)),
        "validation_file": upload_jsonl(http, "val.jsonl", rows(8, seed + 100)),
        "epochs": epochs, "max_seq_len": 48,
        "search_space": {"learning_rate": [1e-2, 3e-2], "batch_size": [4]},
        "early_exit": {"enabled": False}, "eval": {"eval_every_steps": 10, "eval_max_samples": 8}})
    assert r.status_code == 201, r.text
    task_id = r.json()["id"]
    if queued:  # placed by the test (the scheduler is off)
        wait_for(lambda: state_of(http, task_id) == "queued", 30, "queued")
    return task_id


def trained(http, task_id: str) -> bool:  # noqa: ANN001
    curves = http.get(f"/v1/tasks/{task_id}/metrics").json()["jobs"]
    return any(c["train"] for c in curves)


def last_step(http, task_id: str) -> int:  # noqa: ANN001
    curves = http.get(f"/v1/tasks/{task_id}/metrics").json()["jobs"]
    return max((p["step"] for c in curves for p in c["train"]), default=0)


def local_placements(stack: Stack) -> dict[str, dict]:
    """The daemon's record of each placement on the node, by task."""
    out = {}
    for state in (stack.root / "worker-node" / "placements").glob("*/daemon.json"):
        data = json.loads(state.read_text())
        out[data["task_id"]] = data
    return out


def hosts_started(stack: Stack) -> int:
    return (stack.root / "daemon-node.log").read_text().count("shared executor started")


def test_tasks_of_two_tenants_share_one_executor_and_a_cancel_leaves_the_others(
        stack: Stack) -> None:
    stack.daemon("node", env={"OMP_NUM_THREADS": "1", "LORAPLEX_CHECKPOINT_EVERY": "10"})
    with stack.http() as http, stack.client(stack.tenant("tenant-b")) as other:
        a = start_task(http, 200, epochs=4, seed=1)
        b = start_task(other, 120, epochs=3, seed=2)  # another tenant's task
        c = start_task(http, 200, epochs=8, seed=3)  # cancelled mid-training
        stack.place(a, "node")
        wait_for(lambda: trained(http, a), 120, f"A to train\n{stack.daemon_log('node')}")
        stack.place(b, "node")  # the same GPU: B and C join A's executor
        stack.place(c, "node")
        wait_for(lambda: trained(other, b) and trained(http, c), 120,
                 f"B and C to train\n{stack.daemon_log('node')}")
        placed = local_placements(stack)
        assert {placed[t]["host_id"] for t in (a, b, c)} == {placed[a]["host_id"]} != {None}
        assert {placed[t]["pid"] for t in (a, b, c)} == {placed[a]["pid"]}  # one process
        assert hosts_started(stack) == 1
        assert state_of(http, a) == state_of(other, b) == "running"

        assert http.post(f"/v1/tasks/{c}/cancel").status_code == 200
        wait_for(lambda: state_of(http, c) == "cancelled", 60, "C cancelled")
        at_cancel = {a: last_step(http, a), b: last_step(other, b)}
        assert state_of(http, a) == "running"  # A trains on
        check_guarantees(stack, http, c, "cancelled")
        check_guarantees(stack, http, a, "succeeded")
        check_guarantees(stack, other, b, "succeeded")
        assert last_step(http, a) > at_cancel[a] and last_step(other, b) >= at_cancel[b]
        adapters = []
        for client, task_id in ((http, a), (other, b)):
            r = client.get(f"/v1/tasks/{task_id}/adapter")
            assert r.status_code == 200, r.text
            adapters.append(r.content)
            loaded = [e for e in events(client, task_id) if e["type"] == "executor_loaded"]
            assert len(loaded) == 1  # its own data, read once, on the shared executor
        assert adapters[0] != adapters[1]
        assert other.get(f"/v1/tasks/{a}/adapter").status_code == 404  # tenants stay apart
        assert hosts_started(stack) == 1


@pytest.mark.with_scheduler
def test_the_scheduler_joins_a_task_to_the_running_executor_of_its_model(stack: Stack) -> None:
    stack.daemon("node", env={"OMP_NUM_THREADS": "1"})  # one CPU slot: GPU 0
    with stack.http() as http, stack.client(stack.tenant("tenant-b")) as other:
        a = start_task(http, 200, epochs=4, seed=1, queued=False)
        wait_for(lambda: trained(http, a), 120, f"A to train\n{stack.daemon_log('node')}")
        b = start_task(other, 120, epochs=2, seed=2, queued=False)  # no free GPU: it joins A
        wait_for(lambda: trained(other, b), 120,
                 f"B to train\n{stack.service_log()}\n{stack.daemon_log('node')}")
        assert state_of(http, a) == "running"  # B trained beside A, not after it
        placed = local_placements(stack)
        assert placed[a]["host_id"] == placed[b]["host_id"] is not None
        assert placed[a]["pid"] == placed[b]["pid"] and hosts_started(stack) == 1
        rows_ = stack.sql("SELECT task_id, node_id, gpu_indices FROM placements WHERE task_id IN "
                          "(:a, :b) AND claimed_at IS NOT NULL", a=a, b=b)
        assert len(rows_) == 2 and len({(r.node_id, tuple(r.gpu_indices)) for r in rows_}) == 1
        check_guarantees(stack, http, a, "succeeded")
        check_guarantees(stack, other, b, "succeeded")
