"""End to end on the product path (issue 44): a task POSTed over HTTP trains on a real daemon
(CPU, a tiny Llama); then the tenant's own prompts, POSTed to /v1/tasks/{id}/samples, are claimed
by that daemon and answered by the task's best adapter and the base model, on the shared executor
that lingers warm after the task (or, with co-location off, in a fresh sampler process)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack, wait_for
from tests.e2e.test_train_e2e import dataset

pytest.importorskip("torch")
pytest.importorskip("trainer.executor", reason="the training executor has not landed")


@pytest.fixture
def models_yaml(tmp_path: Path) -> Path:
    from trainer.tiny import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "tiny-llama", seed=0)
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n  - name: tiny\n    path: {model_dir}\n    parameters: 100000\n"
                    "    gpus: 1\n    max_seq_len: 128\n    family: llama\n")
    return path


@pytest.mark.parametrize("colocate", [True, False], ids=["warm-executor", "fresh-process"])
def test_samples_on_demand_through_a_real_daemon(stack: Stack, colocate: bool) -> None:
    stack.daemon("cpu-node", *([] if colocate else ["--no-colocate"]),
                 env={"LORAPLEX_EXECUTOR_LINGER_S": "120", "LORAPLEX_SAMPLE_POLL_S": "0.5"})
    with stack.http() as http:
        body = "".join(json.dumps(r) + "\n" for r in dataset(32, seed=1)).encode()
        r = http.post("/v1/files", files={"file": ("train.jsonl", io.BytesIO(body))})
        assert r.status_code == 201, r.text
        r = http.post("/v1/tasks", json={
            "base_model": "tiny", "training_file": r.json()["id"],
            "search_space": {"learning_rate": [1e-2, 3e-2], "lora_rank": [4], "batch_size": [4]},
            "epochs": 1, "max_seq_len": 64, "samples": {"enabled": False}})
        assert r.status_code == 201, r.text
        tid = r.json()["id"]
        r = http.post(f"/v1/tasks/{tid}/samples", json={"prompts": ["hello"]})
        assert r.status_code == 422 and r.json()["error"]["param"] == "task_id", r.text
        wait_for(lambda: http.get(f"/v1/tasks/{tid}").json()["state"] != "validating_files",
                 30, "file validation")
        stack.place(tid, "cpu-node")
        final = wait_for(lambda: (t := http.get(f"/v1/tasks/{tid}").json())["state"] in (
            "succeeded", "failed", "cancelled") and t, 300,
            f"the task to end\n{stack.daemon_log('cpu-node')}")
        assert final["state"] == "succeeded", (final, stack.daemon_log("cpu-node"))

        r = http.post(f"/v1/tasks/{tid}/samples", json={
            "prompts": ["hello", "the cat"], "top_k": 2, "max_new_tokens": 5})
        assert r.status_code == 202, r.text
        req = r.json()
        assert req["job_ids"][0] == final["best_job_id"] and len(req["job_ids"]) == 2
        done = wait_for(lambda: (g := http.get(f"/v1/tasks/{tid}/samples/{req['id']}").json())[
            "state"] in ("succeeded", "failed") and g, 180,
            f"the samples\n{stack.daemon_log('cpu-node')}")
        assert done["state"] == "succeeded", (done, stack.daemon_log("cpu-node"))
        assert [(s["prompt"], s["job_id"]) for s in done["data"]] == [
            (p, j) for p in ("hello", "the cat") for j in (None, *req["job_ids"])]
        assert all(0 < s["tokens"] <= 5 for s in done["data"])
        log = stack.daemon_log("cpu-node")
        assert f"request={req['id']}" in log
        assert ("on=host-" in log) == colocate, log
