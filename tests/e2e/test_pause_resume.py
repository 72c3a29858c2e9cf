"""Pause and resume on the real stack (service, PostgreSQL, Redis, a real daemon, the real executor
training a tiny Llama on CPU): a training task paused mid-training checkpoints at a step boundary
and frees its GPUs (`paused`, no live placement, the executor gone), resumes from that very
checkpoint, and ends `succeeded` with every job's train curve holding each step exactly once, no
failed attempt counted, and no step trained twice."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.conftest import Stack, upload_jsonl, wait_for
from tests.e2e.test_chaos import CHECKPOINT_EVERY, check_guarantees, checkpoints, rows
from tests.e2e.test_daemon_loop import events, executor_pid, pid_alive
from tests.e2e.test_train_e2e import models_yaml  # noqa: F401 - the tiny Llama as "tiny"

pytest.importorskip("torch")
# 960 records x 2 epochs / batch 4, per job: on an idle 2-core CPU a step of the tiny model
# takes about 30 ms, so the task is still training when the pause (a heartbeat after the first
# checkpoint reached the service) arrives
STEPS = 480


def start_task(http) -> str:  # noqa: ANN001
    r = http.post("/v1/tasks", json={
        "base_model": "tiny", "training_file": upload_jsonl(http, "train.jsonl", rows(2 * STEPS, 1)),
        "validation_file": upload_jsonl(http, "val.jsonl", rows(8, 2)), "epochs": 2,
        "max_seq_len": 48, "search_space": {"learning_rate": [1e-2, 3e-2], "batch_size": [4]},
        "early_exit": {"enabled": False}, "eval": {"eval_every_steps": 40, "eval_max_samples": 8}})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def trained_steps(stack: Stack, placement_id: str) -> list[int]:
    """The train steps one placement's executor wrote to its spool (every job, in order)."""
    spool = stack.root / "worker-node" / "placements" / placement_id / "spool.jsonl"
    steps = []
    for line in spool.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("type") == "metric" and rec["point"]["split"] == "train":
            steps.append(rec["point"]["step"])
    return steps


@pytest.mark.with_scheduler
def test_pause_frees_the_gpus_and_resume_continues_from_the_checkpoint(stack: Stack) -> None:
    stack.daemon("node", env={"LORAPLEX_CHECKPOINT_EVERY": str(CHECKPOINT_EVERY)})
    with stack.http() as http, stack.operator() as op:
        task_id = start_task(http)  # the scheduler places it
        wait_for(lambda: checkpoints(http, task_id), 120,
                 f"a first checkpoint\n{stack.daemon_log('node')}")
        pid = executor_pid(stack, "node")
        r = http.post(f"/v1/tasks/{task_id}/pause")
        assert r.status_code == 200 and r.json()["state"] in ("pausing", "paused"), r.text
        wait_for(lambda: http.get(f"/v1/tasks/{task_id}").json()["state"] == "paused", 60,
                 f"paused\n{stack.daemon_log('node')}")
        # its GPUs are free: no live placement, nothing on the node's GPUs, the executor gone
        (first,), = stack.sql("SELECT id FROM placements WHERE task_id = :t AND state <> "
                              "'superseded'", t=task_id)
        assert stack.sql("SELECT state, stop_requested FROM placements WHERE id = :p",
                         p=first) == [("stopped", "pause")]
        cluster = op.get("/v1/cluster").json()
        assert all(g["running_task_id"] is None for g in cluster["gpus"]), cluster["gpus"]
        assert not [p for p in cluster["plan"] if p["task_id"] == task_id]
        wait_for(lambda: not pid_alive(pid), 15, "the executor to exit")
        paused_at = checkpoints(http, task_id)[-1]  # the checkpoint the pause wrote
        before = trained_steps(stack, first)
        assert max(before) == paused_at, (max(before), paused_at)  # at a step boundary
        assert paused_at < STEPS, paused_at  # mid-training
        job = http.get(f"/v1/fine_tuning/jobs/{task_id}").json()
        assert job["status"] == "paused"
        time.sleep(2)  # replans (every second) leave a paused task alone
        assert stack.sql("SELECT count(*) FROM placements WHERE task_id = :t AND state IN "
                         "('planned', 'published', 'claimed', 'running')", t=task_id) == [(0,)]
        assert http.get(f"/v1/tasks/{task_id}").json()["state"] == "paused"

        r = http.post(f"/v1/fine_tuning/jobs/{task_id}/resume")
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        final = check_guarantees(stack, http, task_id, "succeeded")
        assert final["attempt"] == 1  # a pause is no failed attempt
        resumed = [e["data"]["global_step"] for e in events(http, task_id)
                   if e["type"] == "resumed"]
        assert resumed == [paused_at], resumed  # from the pause's checkpoint, nothing lost
        (second,), = stack.sql("SELECT id FROM placements WHERE task_id = :t AND id <> :p "
                               "AND state = 'finished'", t=task_id, p=first)
        after = trained_steps(stack, second)
        assert after and min(after) == paused_at + 1, after[:4]  # nothing trained twice
        kinds = [e["type"] for e in events(http, task_id)]
        assert kinds.index("task_pausing") < kinds.index("task_paused") < \
            kinds.index("task_resumed")
