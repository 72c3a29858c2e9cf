"""One product path: a task POSTed to the API reaches every capability it asks for. For each method
(sft, dpo) and GPU count (1, and 2 as two gloo ranks on CPU), the scheduler places the task on a
real daemon, the runner starts the executor the placement asks for (one process, or adapter
parallelism with one rank per GPU), and the task ends `succeeded` with an adapter PEFT loads."""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack, upload_jsonl, wait_for

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

WORDS = "one two three four five six seven eight nine ten".split()


@pytest.fixture
def models_yaml(tmp_path: Path) -> Path:
    from trainer.tiny import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "tiny-llama", seed=0)
    path = tmp_path / "models.yaml"
    # the same weights registered twice: "tiny-2" needs two GPUs, so it is planned on two
    path.write_text("models:\n" + "".join(
        f"  - name: tiny-{g}\n    path: {model_dir}\n    parameters: 100000\n    gpus: {g}\n"
        "    max_seq_len: 128\n    family: llama\n" for g in (1, 2)))
    return path


def records(method: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i = rng.randrange(0, 6)
        prompt, answer = " ".join(WORDS[i:i + 2]), " ".join(WORDS[i + 2:i + 4])
        if method == "dpo":
            out.append({"prompt": prompt, "chosen": answer, "rejected": " ".join(WORDS[i:i + 2])})
        else:
            out.append({"prompt": prompt, "completion": answer})
    return out


@pytest.mark.with_scheduler
def test_each_method_on_one_and_two_gpus_runs_the_executor_its_placement_asks_for(
        stack: Stack, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    stack.daemon("cpu-node", "--cpu-slots", "2")
    cases = [(method, gpus) for method in ("sft", "dpo") for gpus in (1, 2)]
    tasks: dict[tuple[str, int], str] = {}
    with stack.http() as http:
        for method, gpus in cases:
            train = upload_jsonl(http, f"{method}.jsonl", records(method, 24, seed=1))
            val = upload_jsonl(http, f"{method}-val.jsonl", records(method, 8, seed=2))
            space = {"learning_rate": [5e-3, 2e-2], "lora_rank": [4], "batch_size": [2]}
            if method == "dpo":
                space["beta"] = [0.1, 0.3]
            r = http.post("/v1/tasks", json={
                "base_model": f"tiny-{gpus}", "method": method, "training_file": train,
                "validation_file": val, "search_space": space, "max_seq_len": 48,
                "eval": {"eval_every_steps": 4, "eval_max_samples": 4},
                "early_exit": {"enabled": False}})
            assert r.status_code == 201, r.text
            tasks[(method, gpus)] = r.json()["id"]

        def ended() -> bool:
            states = [http.get(f"/v1/tasks/{t}").json()["state"] for t in tasks.values()]
            return all(s in ("succeeded", "failed", "cancelled") for s in states)

        wait_for(ended, 480, f"every task to end\n{stack.daemon_log('cpu-node')}")
        for (method, gpus), task_id in tasks.items():
            task = http.get(f"/v1/tasks/{task_id}").json()
            assert task["state"] == "succeeded", (method, gpus, task, stack.daemon_log("cpu-node"))
            placed = stack.sql("SELECT gpu_indices FROM placements WHERE task_id = :t AND "
                               "state = 'finished'", t=task_id)
            assert [len(row[0]) for row in placed] == [gpus], (method, gpus, placed)
            events = http.get(f"/v1/tasks/{task_id}/events?after=0&limit=500").json()["data"]
            loaded = [e["data"] for e in events if e["type"] == "executor_loaded"]
            assert loaded and loaded[-1]["ranks"] == gpus, (method, gpus, loaded)
            jobs = http.get(f"/v1/tasks/{task_id}/jobs").json()["data"]
            assert len(jobs) == (4 if method == "dpo" else 2)
            assert all(j["state"] == "completed" and j["best_val_loss"] is not None for j in jobs)
            if method == "dpo":
                assert sorted({j["hyperparameters"]["beta"] for j in jobs}) == [0.1, 0.3]
            r = http.get(f"/v1/tasks/{task_id}/adapter")
            assert r.status_code == 200, r.text
            out = tmp_path / f"adapter-{method}-{gpus}"
            with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tar:
                tar.extractall(out, filter="data")
            base = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama")
            tuned = PeftModel.from_pretrained(base, out)
            lora = [n for n, _ in tuned.named_parameters() if "lora_" in n]
            assert len(lora) == 2 * 2 * 7  # 2 layers x 7 projections x (A, B)
