"""End to end, continuing from an uploaded adapter: a PEFT adapter made on the tiny Llama (with a
non-zero B, so it moves the loss) is uploaded with purpose `adapter`, a task of two learning
rates starts from it (init_adapter_file), a real daemon fetches the archive and trains, and each
job's first training loss equals PeftModel.from_pretrained's loss of the base with that adapter
on the job's own first batch (its data order: trainer.data.JobDataStream, seed = task seed +
job index), within float32 tolerance: the jobs really began where the adapter is."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack, tiny_llama_models, wait_for
from tests.e2e.test_train_e2e import dataset

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("trainer.executor", reason="the training executor has not landed")

TARGETS = ["q_proj", "v_proj"]
BATCH, SEED, MAX_LEN = 4, 7, 64


@pytest.fixture
def models_yaml(tmp_path: Path) -> Path:
    return tiny_llama_models(tmp_path)


def make_adapter(model_dir: Path, out: Path) -> bytes:
    """A PEFT LoRA adapter of the base (rank 4, alpha 8, q/v), every A and B random (a fresh B
    is zero: it would not change the loss), saved by PEFT; its .tar.gz archive."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                            lora_dropout=0.0))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(out)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tf.add(out / name, arcname=f"my-adapter/{name}")
    return buf.getvalue()


def first_batch_losses(model_dir: Path, adapter_dir: Path, train_file: Path, seed: int
                       ) -> tuple[float, float]:
    """(with the adapter, without it): the losses on the first batch of the job of this seed,
    as the executor draws it from the training file."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers.engine_ref import padded_batch
    from trainer.data import JobDataStream, read_jsonl, tokenize_all

    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = tokenize_all(tok, read_jsonl(train_file), MAX_LEN)
    first = JobDataStream(len(examples), seed).next_indices(BATCH)
    batch = padded_batch([examples[i] for i in first], tok.pad_token_id)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir),
                                      adapter_dir).eval()
    with torch.no_grad():
        want = float(model(**batch, use_cache=False).loss)
        with model.disable_adapter():
            plain = float(model(**batch, use_cache=False).loss)
    return want, plain


def test_task_continues_from_uploaded_adapter(stack: Stack, tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny-llama"
    archive = make_adapter(model_dir, tmp_path / "adapter")
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in dataset(24, seed=1)))
    val = "".join(json.dumps(r) + "\n" for r in dataset(8, seed=2)).encode()
    stack.daemon("cpu-node")
    with stack.http() as http:
        ids = {}
        for key, name, body, purpose in (
                ("train", "train.jsonl", train_file.read_bytes(), "fine-tune"),
                ("val", "val.jsonl", val, "fine-tune"),
                ("adapter", "adapter.tar.gz", archive, "adapter")):
            r = http.post("/v1/files", data={"purpose": purpose},
                          files={"file": (name, io.BytesIO(body))})
            assert r.status_code == 201, r.text
            ids[key] = r.json()["id"]
        r = http.post("/v1/tasks", json={
            "base_model": "tiny", "training_file": ids["train"], "validation_file": ids["val"],
            "init_adapter_file": ids["adapter"], "seed": SEED, "epochs": 1,
            "max_seq_len": MAX_LEN, "search_space": {"learning_rate": [1e-3, 1e-2],
                                                     "batch_size": [BATCH]},
            "early_exit": {"enabled": False}, "eval": {"eval_every_steps": 3}})
        assert r.status_code == 201, r.text
        task = r.json()
        assert task["init_adapter_file"] == ids["adapter"] and task["num_jobs"] == 2
        assert task["search_space"]["lora_rank"] == [4] and task["target_modules"] == TARGETS
        tid = task["id"]
        stack.place(tid, "cpu-node")
        final = wait_for(lambda: (t := http.get(f"/v1/tasks/{tid}").json())["state"] in (
            "succeeded", "failed", "cancelled") and t, 300,
            f"the task to end\n{stack.daemon_log('cpu-node')}")
        assert final["state"] == "succeeded", (final, stack.daemon_log("cpu-node"))
        curves = http.get(f"/v1/tasks/{tid}/metrics").json()["jobs"]
    assert len(curves) == 2
    for curve in curves:
        first = min(curve["train"], key=lambda p: p["step"])
        want, plain = first_batch_losses(model_dir, tmp_path / "adapter", train_file,
                                         SEED + curve["index"])
        assert abs(want - plain) > 1e-2, (want, plain)  # a fresh start would not match
        assert abs(first["loss"] - want) < 1e-4, (curve["index"], first, want, plain)
