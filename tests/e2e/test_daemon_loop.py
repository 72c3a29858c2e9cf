"""End to end over HTTP with the real service and real daemon subprocesses, the executor played
by tests/e2e/fake_runner.py, placements published by hand: success, executor kill -9 (resume from
checkpoint), cancel, a daemon killed and restarted mid-task (adopts its executor, no lost or
duplicated reports), Redis flush and service restart, drain/stop. A daemon lost for good, with
the scheduler on, is in test_scheduled_e2e.py."""

from __future__ import annotations

import io
import json
import os
import signal
import tarfile
import time
from pathlib import Path

import httpx

from tests.e2e.conftest import Stack, wait_for

RUNNER = ("--runner-module", "tests.e2e.fake_runner")
LINES = [{"messages": [{"role": "user", "content": f"q{i}"},
                       {"role": "assistant", "content": f"a{i}"}]} for i in range(20)]


def create_task(http: httpx.Client, n_lr: int = 2) -> dict:
    body = "".join(json.dumps(r) + "\n" for r in LINES).encode()
    f = http.post("/v1/files", files={"file": ("train.jsonl", io.BytesIO(body))})
    assert f.status_code in (200, 201), f.text  # 200: the tenant's file of the same bytes
    lrs = [1e-4 * (i + 1) for i in range(n_lr)]
    t = http.post("/v1/tasks", json={"base_model": "tiny", "training_file": f.json()["id"],
                                     "search_space": {"learning_rate": lrs, "lora_rank": [4, 8]},
                                     "max_seq_len": 64})
    assert t.status_code == 201, t.text
    task = t.json()
    wait_for(lambda: http.get(f"/v1/tasks/{task['id']}").json()["state"] == "queued", 20,
             "task queued")
    return task


def state_of(http: httpx.Client, task_id: str) -> str:
    return http.get(f"/v1/tasks/{task_id}").json()["state"]


def events(http: httpx.Client, task_id: str) -> list[dict]:
    return http.get(f"/v1/tasks/{task_id}/events", params={"limit": 1000}).json()["data"]


def executor_pid(stack: Stack, node: str) -> int:
    def find() -> int | None:
        for state in (stack.root / f"worker-{node}" / "placements").glob("*/daemon.json"):
            data = json.loads(state.read_text())
            if data["status"] == "running" and data["pid"]:
                return int(data["pid"])
        return None
    return wait_for(find, 30, "an executor to start")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # the process may be reaped between the signal and the read (ProcessLookupError, FileNotFoundError)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def test_daemon_runs_a_placement_to_success(stack: Stack) -> None:
    stack.daemon("node-a", *RUNNER)
    with stack.http() as http:
        task = create_task(http)
        stack.place(task["id"], "node-a")
        wait_for(lambda: state_of(http, task["id"]) == "succeeded", 60,
                 f"task succeeded\n{stack.daemon_log('node-a')}")
        got = http.get(f"/v1/tasks/{task['id']}").json()
        assert got["job_counts"] == {"completed": 2, "exited": 2}
        jobs = http.get(f"/v1/tasks/{task['id']}/jobs").json()["data"]
        exited = [j for j in jobs if j["state"] == "exited"]
        assert all(j["exit_reason"] == "underperforming" for j in exited)
        assert got["best_job_id"] in {j["id"] for j in jobs if j["has_adapter"]}
        curves = http.get(f"/v1/tasks/{task['id']}/metrics").json()["jobs"]
        assert all([p["step"] for p in c["train"]] == [1, 2, 3, 4, 5, 6] for c in curves)
        ev = events(http, task["id"])
        started = [e for e in ev if e["type"] == "executor_started"]
        assert len(started) == 1 and started[0]["data"]["train_lines"] == 20
        assert started[0]["data"]["cuda_visible_devices"] == ""  # a CPU node hides GPUs
        tgz = http.get(f"/v1/tasks/{task['id']}/adapter")
        assert tgz.status_code == 200
        with tarfile.open(fileobj=io.BytesIO(tgz.content), mode="r:gz") as tf:
            assert sorted(tf.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
    wait_for(lambda: "placement done" in stack.daemon_log("node-a"), 10, "placement done")
    assert "from=idle to=busy" in stack.daemon_log("node-a")


def test_executor_kill9_is_retried_from_checkpoint(stack: Stack) -> None:
    stack.daemon("node-a", *RUNNER, env={"LORAPLEX_FAKE_MODE": "hang_first"})
    with stack.http() as http:
        task = create_task(http)
        stack.place(task["id"], "node-a")
        pid = executor_pid(stack, "node-a")
        wait_for(lambda: any(e["type"] == "checkpoint_uploaded" for e in events(
            http, task["id"])), 30, "the checkpoint upload")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: any(e["type"] == "task_requeued" for e in events(http, task["id"])),
                 30, f"task requeued\n{stack.daemon_log('node-a')}")
        failed = [e for e in events(http, task["id"]) if e["type"] == "executor_failed"]
        assert failed and "SIGKILL" in failed[0]["message"]
        stack.place(task["id"], "node-a")
        wait_for(lambda: state_of(http, task["id"]) == "succeeded", 60,
                 f"task succeeded\n{stack.daemon_log('node-a')}")
        started = [e["data"] for e in events(http, task["id"]) if e["type"] == "executor_started"]
        assert [(s["attempt"], s["resumed_from_step"]) for s in started] == [(1, 0), (2, 2)]


def test_cancel_stops_the_executor_within_seconds(stack: Stack) -> None:
    stack.daemon("node-a", *RUNNER, env={"LORAPLEX_FAKE_MODE": "hang"})
    with stack.http() as http:
        task = create_task(http)
        stack.place(task["id"], "node-a")
        pid = executor_pid(stack, "node-a")
        wait_for(lambda: any(e["type"] == "executor_started" for e in events(
            http, task["id"])), 30, "the executor to report in")  # its SIGTERM handler is set
        t0 = time.monotonic()
        assert http.post(f"/v1/tasks/{task['id']}/cancel").json()["state"] == "cancelled"
        wait_for(lambda: not pid_alive(pid), 10, "the executor to stop")
        assert time.monotonic() - t0 < 10
        wait_for(lambda: "placement done" in stack.daemon_log("node-a"), 10, "placement done")
        # The service takes no report of a cancelled task (fencing): what the executor said on
        # its way out (executor_sigterm, a failure) is refused, so task_cancelled stays last.
        types = [e["type"] for e in events(http, task["id"])]
        assert types[-1] == "task_cancelled" and "executor_sigterm" not in types, types
        assert state_of(http, task["id"]) == "cancelled"


def test_daemon_killed_and_restarted_adopts_its_executor(stack: Stack) -> None:
    first = stack.daemon("node-a", *RUNNER, env={"LORAPLEX_FAKE_MODE": "hang_first"})
    with stack.http() as http:
        task = create_task(http, n_lr=1)
        stack.place(task["id"], "node-a")
        pid = executor_pid(stack, "node-a")
        wait_for(lambda: any(e["type"] == "checkpoint_uploaded" for e in events(
            http, task["id"])), 30, "the checkpoint upload")
        first.kill()
        first.wait()
        assert pid_alive(pid)  # the executor lives in its own session
        # The executor writes more while no daemon listens; then the executor dies too.
        spool = next((stack.root / "worker-node-a" / "placements").glob("*/spool.jsonl"))
        with open(spool, "ab") as fh:
            fh.write(json.dumps({"type": "event", "event": {
                "type": "log", "message": "written while the daemon was down"}}).encode() + b"\n")
        os.kill(pid, signal.SIGKILL)
        stack.daemon("node-a", *RUNNER)
        wait_for(lambda: any(e["type"] == "task_requeued" for e in events(http, task["id"])),
                 30, f"task requeued\n{stack.daemon_log('node-a')}")
        ev = events(http, task["id"])
        logs = [e for e in ev if e["type"] == "log"]
        assert [e["message"] for e in logs] == ["written while the daemon was down"]
        assert sum(e["type"] == "executor_started" for e in ev) == 1  # nothing resent twice
        stack.place(task["id"], "node-a")
        wait_for(lambda: state_of(http, task["id"]) == "succeeded", 60,
                 f"task succeeded\n{stack.daemon_log('node-a')}")
    assert "placement recovered" in stack.daemon_log("node-a")


def test_redis_flush_and_service_restart_lose_nothing(stack: Stack) -> None:
    import redis

    with stack.http() as http:
        task = create_task(http)
        stack.daemon("node-a", *RUNNER, env={"LORAPLEX_FAKE_MODE": "slow"})
        node_id = stack.node_id("node-a")
        # Published while Redis is then wiped: the service republishes from Postgres on start.
        stack.daemons[-1].send_signal(signal.SIGSTOP)
        try:
            stack.place(task["id"], "node-a")
            redis.Redis.from_url(stack.redis_url).flushall()
            stack.stop_service()
            stack.start_service()
            queue = f"rq:queue:loraplex:node:{node_id}"
            wait_for(lambda: redis.Redis.from_url(stack.redis_url).llen(queue) == 1, 10,
                     "the placement republished")
        finally:
            stack.daemons[-1].send_signal(signal.SIGCONT)
        wait_for(lambda: any(e["type"] == "executor_started" for e in events(
            http, task["id"])), 30, "the executor to start")
        redis.Redis.from_url(stack.redis_url).flushall()  # mid-task: nothing depends on it
        stack.stop_service()  # the executor finishes while the service is down
        time.sleep(4)
        stack.start_service()
        wait_for(lambda: state_of(http, task["id"]) == "succeeded", 60,
                 f"task succeeded\n{stack.daemon_log('node-a')}")
        curves = http.get(f"/v1/tasks/{task['id']}/metrics").json()["jobs"]
        assert all([p["step"] for p in c["train"]] == [1, 2, 3, 4, 5, 6] for c in curves)
    assert "forward deferred" in stack.daemon_log("node-a")


def test_sigterm_drains_and_stubborn_executors_get_sigkill(stack: Stack) -> None:
    import redis

    daemon = stack.daemon("node-a", *RUNNER, env={"LORAPLEX_FAKE_MODE": "slow"})
    with stack.http() as http:
        task = create_task(http)
        stack.place(task["id"], "node-a")
        wait_for(lambda: any(e["type"] == "executor_started" for e in events(
            http, task["id"])), 30, "the executor to start")
        daemon.send_signal(signal.SIGTERM)
        wait_for(lambda: "to=draining" in stack.daemon_log("node-a"), 10, "draining")
        later = create_task(http)
        stack.place(later["id"], "node-a")  # a draining node takes no new placement
        node_id = stack.node_id("node-a")
        assert daemon.wait(timeout=60) == 0
        assert state_of(http, task["id"]) == "succeeded"
        assert state_of(http, later["id"]) == "queued"
        # Drained, the daemon deregistered: its node is down and its waiting placement gone.
        queue = f"rq:queue:loraplex:node:{node_id}"
        assert redis.Redis.from_url(stack.redis_url).llen(queue) == 0
        rows = stack.sql("SELECT state FROM placements WHERE task_id = :t", t=later["id"])
        assert [r.state for r in rows] == ["superseded"]
        with stack.operator() as op:
            assert [n["state"] for n in op.get("/v1/cluster").json()["nodes"]] == ["down"]

        stack.daemon("node-b", *RUNNER, env={"LORAPLEX_FAKE_MODE": "stubborn"})
        third = create_task(http)
        stack.place(third["id"], "node-b")
        pid = executor_pid(stack, "node-b")
        wait_for(lambda: any(e["type"] == "executor_started" for e in events(
            http, third["id"])), 30, "the executor to start")
        t0 = time.monotonic()
        http.post(f"/v1/tasks/{third['id']}/cancel")
        wait_for(lambda: not pid_alive(pid), 15, "SIGKILL after the grace period")
        assert 2.5 <= time.monotonic() - t0 < 15  # --cancel-grace-s 3 in the fixture
    assert "executor killed" in stack.daemon_log("node-b")
