"""Jobs that end their warmup before the ranking, over HTTP only with a real daemon and executor
(CPU): by default they wait parked (event `parked_after_warmup`) and train nothing until the
ranking decides; with `early_exit.train_while_waiting` they train on meanwhile. The setting is
POSTed, echoed by the API and carried by the placement to the executor."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack, tiny_llama_models, wait_for
from tests.e2e.test_train_e2e import dataset

pytest.importorskip("torch")
pytest.importorskip("trainer.executor", reason="the training executor has not landed")

@pytest.fixture
def models_yaml(tmp_path: Path) -> Path:
    return tiny_llama_models(tmp_path)


def test_waiting_jobs_park_by_default_and_train_on_when_asked(stack: Stack) -> None:
    stack.daemon("cpu-node")
    with stack.http() as http:
        files = []
        for name, records in (("train.jsonl", dataset(48, 1)), ("val.jsonl", dataset(8, 2))):
            body = "".join(json.dumps(r) + "\n" for r in records).encode()
            r = http.post("/v1/files", files={"file": (name, io.BytesIO(body))})
            assert r.status_code == 201, r.text
            files.append(r.json()["id"])
        tasks = {}
        # batch 8: 6 steps, warmup 1; batch 2: 24 steps, warmup 3 (a tenth, rounded up): the
        # batch-8 jobs end theirs 2 steps before the ranking
        for train_on in (False, True):
            early_exit = {"warmup_fraction": 0.1, "keep_fraction": 0.5}
            if train_on:
                early_exit["train_while_waiting"] = True
            r = http.post("/v1/tasks", json={
                "base_model": "tiny", "training_file": files[0], "validation_file": files[1],
                "search_space": {"learning_rate": [1e-2, 3e-2], "lora_rank": [4], "batch_size": [2, 8]},
                "max_seq_len": 48, "eval": {"eval_every_steps": 4, "eval_max_samples": 8},
                "samples": {"enabled": False}, "early_exit": early_exit})
            assert r.status_code == 201, r.text
            assert r.json()["early_exit"]["train_while_waiting"] is train_on
            tasks[train_on] = r.json()["id"]
        for task_id in tasks.values():
            wait_for(lambda t=task_id: http.get(f"/v1/tasks/{t}").json()["state"] != "validating_files",
                     30, "file validation")
            stack.place(task_id, "cpu-node")
            final = wait_for(lambda t=task_id: (x := http.get(f"/v1/tasks/{t}").json())["state"] in (
                "succeeded", "failed", "cancelled") and x, 300, f"the task to end\n{stack.daemon_log('cpu-node')}")
            assert final["state"] == "succeeded", (final, stack.daemon_log("cpu-node"))
        seen = {}
        for train_on, task_id in tasks.items():
            assert http.get(f"/v1/tasks/{task_id}").json()["early_exit"]["train_while_waiting"] is train_on
            jobs = {j["id"]: j for j in http.get(f"/v1/tasks/{task_id}/jobs").json()["data"]}
            wide = {j for j, spec in jobs.items() if spec["hyperparameters"]["batch_size"] == 8}
            assert len(wide) == 2
            events = http.get(f"/v1/tasks/{task_id}/events?after=0&limit=500").json()["data"]
            parked = {e["job_id"]: e["data"] for e in events if e["type"] == "parked_after_warmup"}
            assert [e["type"] for e in events].count("warmup_ranking") == 1
            curves = http.get(f"/v1/tasks/{task_id}/metrics").json()["jobs"]
            last = {c["job_id"]: max(p["step"] for p in c["train"]) for c in curves}
            seen[train_on] = (wide, parked, last, jobs)
        wide, parked, last, jobs = seen[False]
        # parked at the end of their warmup (step 1): an evicted one never trained past it
        assert set(parked) == wide and all(d["step"] == 1 for d in parked.values())
        assert all(last[j] == 1 for j in wide if jobs[j]["state"] == "exited")
        assert all(last[j] == 6 for j in wide if jobs[j]["state"] == "completed")
        wide, parked, last, jobs = seen[True]
        # trained on until the ranking at step 3, nothing parked (nothing was queued)
        assert parked == {}
        assert all(last[j] >= 3 for j in wide)
