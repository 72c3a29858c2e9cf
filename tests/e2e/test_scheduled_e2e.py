"""End to end with the real scheduler (CP-SAT, background replanner) placing tasks of two tenants
on two daemons: plan respected, no GPU slot shared, tenant limits and isolation held; a daemon
killed mid-task fails over to the other node from its checkpoint; a drained daemon deregisters."""

from __future__ import annotations

import io
import json
import os
import signal
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import redis

from tests.e2e.conftest import Stack, wait_for
from tests.e2e.test_daemon_loop import LINES, RUNNER, events, executor_pid, state_of

pytestmark = pytest.mark.with_scheduler
TERMINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture
def models_yaml(tmp_path: Path) -> Path:
    """Two fake models: 'tiny' needs one GPU slot, 'tiny-wide' two (only a 2-slot node fits)."""
    path = tmp_path / "models.yaml"
    entries = []
    for name, gpus in (("tiny", 1), ("tiny-wide", 2)):
        model_dir = tmp_path / f"fake-{name}"
        model_dir.mkdir()
        entries.append(f"  - name: {name}\n    path: {model_dir}\n    parameters: 1000000\n"
                       f"    gpus: {gpus}\n    max_seq_len: 256\n    family: llama\n")
    path.write_text("models:\n" + "".join(entries))
    return path


def submit(http: httpx.Client, model: str = "tiny", priority: int = 0, lines: int = 20) -> str:
    body = "".join(json.dumps(r) + "\n" for r in LINES[:lines]).encode()
    f = http.post("/v1/files", files={"file": ("train.jsonl", io.BytesIO(body))})
    assert f.status_code in (200, 201), f.text  # 200: the tenant's file of the same bytes
    t = http.post("/v1/tasks", json={"base_model": model, "training_file": f.json()["id"],
                                     "search_space": {"learning_rate": [1e-4, 2e-4]},
                                     "max_seq_len": 64, "priority": priority})
    assert t.status_code == 201, t.text
    return t.json()["id"]


def overlaps(intervals: list[tuple[float, float, str]]) -> list[tuple[str, str]]:
    """Pairs of intervals (start, end, label) that overlap, after sorting by start."""
    ordered = sorted(intervals)
    return [(a[2], b[2]) for a, b in zip(ordered, ordered[1:], strict=False) if b[0] < a[1]]


def peak(intervals: list[tuple[float, float, int]]) -> int:
    """The largest total weight of intervals (start, end, weight) open at one instant."""
    edges = sorted([(s, w) for s, _, w in intervals] + [(e, -w) for _, e, w in intervals],
                   key=lambda x: (x[0], x[1]))  # an end before a start at the same instant
    level = best = 0
    for _, w in edges:
        level += w
        best = max(best, level)
    return best


def ts(value: datetime) -> float:
    return value.timestamp()


def test_scheduler_places_two_tenants_on_two_nodes(stack: Stack) -> None:
    """Six tasks of two tenants (B limited to 1 GPU, one task of A needs 2 slots, priorities
    0-7) on a 2-slot and a 1-slot daemon: all succeed; each ran where its placement said;
    no slot held by two placements at once (executor clocks and claim/finish rows); B never
    over its limit and served by priority; neither tenant sees the other's tasks."""
    key_b = stack.tenant("tenant-b", max_gpus=1)
    owner: dict[str, str] = {}
    priority: dict[str, int] = {}
    with stack.http() as a, stack.client(key_b) as b, stack.operator() as op:
        clients = {"A": a, "B": b}
        # All queued before any node exists, so the first plans see every task.
        for http, tenant, model, prio in (
                (a, "A", "tiny", 0), (b, "B", "tiny", 3), (a, "A", "tiny-wide", 5),
                (b, "B", "tiny", 0), (a, "A", "tiny", 0), (b, "B", "tiny", 7)):
            task = submit(http, model, prio)
            owner[task], priority[task] = tenant, prio
        wait_for(lambda: all(state_of(clients[t], task) == "queued"
                             for task, t in owner.items()), 30, "all tasks queued")
        fake = {"LORAPLEX_FAKE_STEP_S": "0.25"}  # ~1.5 s per task: runs overlap
        stack.daemon("node-a", *RUNNER, "--cpu-slots", "2", env=fake)
        stack.daemon("node-b", *RUNNER, "--cpu-slots", "1", env=fake)
        names = {stack.node_id("node-a"): "node-a", stack.node_id("node-b"): "node-b"}

        # While they run: the operator's view never shows a slot held twice or B over its limit.
        def all_ended() -> bool:
            view = op.get("/v1/cluster").json()
            for gpu in view["gpus"]:
                active = [p for p in gpu["placements"]
                          if p["state"] in ("published", "claimed", "running")]
                assert len(active) <= 1, gpu
            for usage in view["tenants"]:
                if usage["max_gpus"] is not None:
                    assert usage["gpus_in_use"] <= usage["max_gpus"], usage
            return all(state_of(clients[t], task) in TERMINAL for task, t in owner.items())
        wait_for(all_ended, 120, "all tasks to end\n" + stack.service_log()[-3000:], 0.3)
        assert {task: state_of(clients[t], task) for task, t in owner.items()} == {
            task: "succeeded" for task in owner}

        # Each task ran once, where its placement (the plan's row) said, per the executor.
        rows = stack.sql("SELECT p.id, p.task_id, p.node_id, p.gpu_indices, p.state, "
                         "p.claimed_at, p.finished_at, t.tenant_id FROM placements p "
                         "JOIN tasks t ON t.id = p.task_id")
        ran = [r for r in rows if r.claimed_at is not None]
        assert sorted(r.task_id for r in ran) == sorted(owner)
        assert all(r.state == "finished" for r in ran)
        assert {r.state for r in rows} <= {"finished", "superseded"}
        slot_runs: dict[tuple[str, int], list] = defaultdict(list)
        slot_claims: dict[tuple[str, int], list] = defaultdict(list)
        per_tenant: dict[str, list] = defaultdict(list)
        executors = []
        for r in ran:
            ev = events(clients[owner[r.task_id]], r.task_id)
            [started] = [e["data"] for e in ev if e["type"] == "executor_started"]
            [done] = [e["data"] for e in ev if e["type"] == "executor_done"]
            [claim] = [e["data"] for e in ev if e["type"] == "task_running"]
            assert started["work_dir"] == f"worker-{names[r.node_id]}", (r, started)
            assert started["slots"] == ",".join(map(str, r.gpu_indices)), (r, started)
            assert claim["gpu_indices"] == list(r.gpu_indices) and "node_id" not in claim
            for g in r.gpu_indices:
                slot_runs[(r.node_id, g)].append((started["t"], done["t"], r.task_id))
                slot_claims[(r.node_id, g)].append((ts(r.claimed_at), ts(r.finished_at),
                                                    r.task_id))
            per_tenant[owner[r.task_id]].append((ts(r.claimed_at), ts(r.finished_at),
                                                 len(r.gpu_indices)))
            executors.append((started["t"], done["t"], 1))
        wide = [r for r in ran if len(r.gpu_indices) == 2]
        assert len(wide) == 1 and names[wide[0].node_id] == "node-a"
        assert sorted(wide[0].gpu_indices) == [0, 1]
        assert len(slot_runs) == 3 and {names[n] for n, _ in slot_runs} == {"node-a", "node-b"}
        for slot in slot_runs:
            assert overlaps(slot_runs[slot]) == [], (slot, sorted(slot_runs[slot]))
            assert overlaps(slot_claims[slot]) == [], (slot, sorted(slot_claims[slot]))
        assert peak(per_tenant["B"]) == 1  # max_gpus=1 held over its whole run
        # B runs one task at a time, so its order is the scheduler's: highest priority first.
        b_order = [r.task_id for r in sorted(ran, key=lambda r: r.claimed_at)
                   if owner[r.task_id] == "B"]
        assert [priority[t] for t in b_order] == [7, 3, 0]
        assert peak(executors) >= 2  # the non-overlap checks above were not vacuous

        # Tenants see only their own tasks.
        for me, other in (("A", "B"), ("B", "A")):
            http = clients[me]
            mine = {t["id"] for t in http.get("/v1/tasks", params={"limit": 100}).json()["data"]}
            assert mine == {task for task, t in owner.items() if t == me}
            theirs = next(task for task, t in owner.items() if t == other)
            for path in ("", "/jobs", "/events", "/metrics", "/adapter"):
                r = http.get(f"/v1/tasks/{theirs}{path}")
                assert r.status_code == 404 and r.json()["error"]["code"], (path, r.text)
            assert http.post(f"/v1/tasks/{theirs}/cancel").status_code == 404
            job = clients[other].get(f"/v1/tasks/{theirs}/jobs").json()["data"][0]["id"]
            assert http.get(f"/v1/jobs/{job}/adapter").status_code == 404


def test_lost_daemon_task_resumes_on_the_other_node_from_its_checkpoint(stack: Stack) -> None:
    """Two 1-slot daemons, two tasks, one on each. The daemon of the 7-line task is SIGKILLed
    with its executor after the step-2 checkpoint, while the other runs its task. No goodbye:
    the service notices the silence, marks the node down, replans, and the other daemon
    resumes the task from step 2 once its own task is done."""
    fake = {"LORAPLEX_FAKE_MODE": "hang_first", "LORAPLEX_FAKE_MODE_LINES": "7",
            "LORAPLEX_FAKE_STEP_S": "1"}  # the 7-line task hangs after its checkpoint
    daemons = {name: stack.daemon(name, *RUNNER, env=fake) for name in ("node-a", "node-b")}
    ids = {name: stack.node_id(name) for name in daemons}
    with stack.http() as http, stack.operator() as op:
        task, other = submit(http, lines=7), submit(http)
        wait_for(lambda: any(e["type"] == "checkpoint_uploaded" for e in events(http, task)),
                 30, "the checkpoint upload\n" + stack.service_log()[-3000:])
        [first] = stack.sql("SELECT node_id FROM placements WHERE task_id = :t AND "
                            "state IN ('claimed', 'running')", t=task)
        victim = next(n for n, i in ids.items() if i == first.node_id)
        survivor = next(n for n in ids if n != victim)
        pid = executor_pid(stack, victim)
        assert state_of(http, other) == "running"  # on the survivor: one slot per node
        daemons[victim].kill()  # the whole node goes: daemon and executor, no goodbye
        os.killpg(pid, signal.SIGKILL)
        daemons[victim].wait()
        wait_for(lambda: state_of(http, task) == "succeeded", 60,
                 f"task succeeded\n{stack.daemon_log(survivor)}\n{stack.service_log()[-3000:]}")
        assert state_of(http, other) == "succeeded"
        nodes = {n["name"]: n["state"] for n in op.get("/v1/cluster").json()["nodes"]}
        assert nodes == {victim: "down", survivor: "up"}
        ev = events(http, task)
        started = [e["data"] for e in ev if e["type"] == "executor_started"]
        assert [(s["attempt"], s["resumed_from_step"]) for s in started] == [(1, 0), (2, 2)]
        assert [s["work_dir"] for s in started] == [f"worker-{victim}", f"worker-{survivor}"]
        assert [e["data"]["attempt"] for e in ev if e["type"] == "task_running"] == [1, 2]
        running = [r.node_id for r in stack.sql(  # tenants' events name no node
            "SELECT node_id FROM placements WHERE task_id = :t AND claimed_at IS NOT NULL "
            "ORDER BY claimed_at", t=task)]
        assert running == [ids[victim], ids[survivor]]
        assert any(e["type"] == "task_requeued" and "went down" in e["message"] for e in ev)
        curves = http.get(f"/v1/tasks/{task}/metrics").json()["jobs"]
        assert all([p["step"] for p in c["train"]] == [1, 2, 3, 4, 5, 6] for c in curves)
        rows = stack.sql("SELECT task_id, node_id, state, attempt, claimed_at, finished_at "
                         "FROM placements WHERE claimed_at IS NOT NULL ORDER BY attempt")
        assert [(r.node_id, r.state, r.attempt) for r in rows if r.task_id == task] == [
            (ids[victim], "failed", 1), (ids[survivor], "finished", 2)]
        assert [(r.node_id, r.state) for r in rows if r.task_id == other] == [
            (ids[survivor], "finished")]
        on_survivor = [(ts(r.claimed_at), ts(r.finished_at), r.task_id) for r in rows
                       if r.node_id == ids[survivor]]
        assert overlaps(on_survivor) == []  # its one slot: the failover waited for it


def test_drained_daemon_deregisters_and_its_queue_moves(stack: Stack) -> None:
    """SIGTERM drains node-a: the task it runs finishes, the next one the scheduler queued
    on its free slot is never taken; once drained the daemon deregisters, at once (no heartbeat
    timeout): node-a is down, its queue is empty, and the scheduler moves the task to node-b."""
    node_a = stack.daemon("node-a", *RUNNER, "--cpu-slots", "2",
                          env={"LORAPLEX_FAKE_STEP_S": "1"})
    a_id = stack.node_id("node-a")
    queue = f"rq:queue:loraplex:node:{a_id}"
    conn = redis.Redis.from_url(stack.redis_url)
    with stack.http() as http, stack.operator() as op:
        first = submit(http)
        wait_for(lambda: any(e["type"] == "executor_started" for e in events(http, first)),
                 30, "the executor to start\n" + stack.service_log()[-3000:])
        node_a.send_signal(signal.SIGTERM)
        wait_for(lambda: "to=draining" in stack.daemon_log("node-a"), 10, "draining")
        second = submit(http)  # published on node-a's free slot at once
        wait_for(lambda: conn.llen(queue) == 1, 10, "the second task queued for node-a")
        assert state_of(http, first) == "running"  # still draining
        assert node_a.wait(timeout=30) == 0
        assert state_of(http, first) == "succeeded"
        assert state_of(http, second) == "queued"
        assert "node deregistered" in stack.daemon_log("node-a")
        nodes = {n["name"]: n["state"] for n in op.get("/v1/cluster").json()["nodes"]}
        assert nodes == {"node-a": "down"}  # at once: the heartbeat timeout is 10 s
        assert conn.llen(queue) == 0
        rows = stack.sql("SELECT node_id, state, published_at FROM placements "
                         "WHERE task_id = :t", t=second)
        assert [(r.node_id, r.state) for r in rows] == [(a_id, "superseded")]
        assert rows[0].published_at is not None

        stack.daemon("node-b", *RUNNER)
        wait_for(lambda: state_of(http, second) == "succeeded", 30,
                 f"the second task on node-b\n{stack.daemon_log('node-b')}")
        started = [e["data"] for e in events(http, second) if e["type"] == "executor_started"]
        assert [s["work_dir"] for s in started] == ["worker-node-b"]
