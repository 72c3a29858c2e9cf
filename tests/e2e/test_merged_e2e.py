"""End to end on the product path: a task POSTed over HTTP trains on a real daemon (CPU, a tiny
bf16 Llama), then its best adapter is merged by the service's own background merger and the
merged model downloads in two Range requests, loads with transformers as a plain bf16 model and
answers as the base with the downloaded adapter (PEFT) does, within bf16 tolerance."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack, wait_for
from tests.e2e.test_train_e2e import dataset

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("trainer.executor", reason="the training executor has not landed")


@pytest.fixture
def models_yaml(tmp_path: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from trainer.tiny import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "tiny-llama", seed=0)
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(
        model_dir)
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n  - name: tiny\n    path: {model_dir}\n    parameters: 100000\n"
                    "    gpus: 1\n    max_seq_len: 128\n    family: llama\n")
    return path


def test_best_adapter_merged_and_downloaded(stack: Stack, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    stack.daemon("cpu-node")
    with stack.http() as http:
        body = "".join(json.dumps(r) + "\n" for r in dataset(32, seed=1)).encode()
        r = http.post("/v1/files", files={"file": ("train.jsonl", io.BytesIO(body))})
        assert r.status_code == 201, r.text
        r = http.post("/v1/tasks", json={
            "base_model": "tiny", "training_file": r.json()["id"],
            "search_space": {"learning_rate": [1e-2, 3e-2], "lora_rank": [4],
                             "batch_size": [4]}, "epochs": 1, "max_seq_len": 64})
        assert r.status_code == 201, r.text
        tid = r.json()["id"]
        wait_for(lambda: http.get(f"/v1/tasks/{tid}").json()["state"] != "validating_files",
                 30, "file validation")
        stack.place(tid, "cpu-node")
        final = wait_for(lambda: (t := http.get(f"/v1/tasks/{tid}").json())["state"] in (
            "succeeded", "failed", "cancelled") and t, 300,
            f"the task to end\n{stack.daemon_log('cpu-node')}")
        assert final["state"] == "succeeded", (final, stack.daemon_log("cpu-node"))

        r = http.post(f"/v1/tasks/{tid}/merged")
        assert r.status_code == 202 and r.json()["job_id"] == final["best_job_id"], r.text
        done = wait_for(lambda: (m := http.get(f"/v1/tasks/{tid}/merged").json())["state"] in (
            "succeeded", "failed") and m, 120, "the merge")
        assert done["state"] == "succeeded" and done["dtype"] == "bfloat16", done
        half = done["bytes"] // 2
        first = http.get(f"/v1/tasks/{tid}/merged/content", headers={"Range": f"bytes=0-{half}"})
        rest = http.get(f"/v1/tasks/{tid}/merged/content",
                        headers={"Range": f"bytes={half + 1}-", "If-Range": first.headers["etag"]})
        assert (first.status_code, rest.status_code) == (206, 206)
        archive = first.content + rest.content
        assert len(archive) == done["bytes"]
        adapter = http.get(f"/v1/tasks/{tid}/adapter")
        assert adapter.status_code == 200
    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tf:
        tf.extractall(merged_dir, filter="data")
    with tarfile.open(fileobj=io.BytesIO(adapter.content), mode="r:gz") as tf:
        tf.extractall(adapter_dir, filter="data")
    ids = torch.randint(8, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(merged_dir)
        assert merged.dtype == torch.bfloat16 and not hasattr(merged, "peft_config")
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama", dtype="auto")
        plain = base(input_ids=ids).logits.float()
        ref = PeftModel.from_pretrained(base, adapter_dir)(input_ids=ids).logits.float()
        got = merged(input_ids=ids).logits.float()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 4e-2, rel
    assert ((plain - ref).norm() / ref.norm()).item() > rel  # training moved the model
