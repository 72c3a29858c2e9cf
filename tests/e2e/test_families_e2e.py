"""Model families through the API with a real daemon and the real executor on CPU: one task per
tiny family of each layout the family table knows (E2E_FAMILIES; tests/unit/test_families.py
checks every family of contract.families on the engine and export alone) trains to `succeeded`; each job's adapter downloads, loads whole into PEFT, adapts every targeted
projection of every layer, and PEFT's validation loss of it is the service's best_val_loss."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack, upload_jsonl, wait_for

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("trainer.executor", reason="the training executor has not landed")

from contract.families import family_of  # noqa: E402
from tests.helpers.engine_ref import synthetic_rows  # noqa: E402
from tests.unit.test_families import base_model, load_whole, lora_keys, own_loss  # noqa: E402
from trainer.export import load_peft_weights  # noqa: E402
from trainer.tiny import FAMILIES as TINY  # noqa: E402

# One family per layout: Llama's linears, fused projections (Phi-3), final soft-cap and sliding
# windows (Gemma-2, Gemma-3), logit scale / divisor (Cohere, Granite), other linear names and
# layer paths (StarCoder2; GPT-NeoX at gpt_neox.layers; GPT-J at transformer.h).
FAMILIES = ("llama", "phi3", "gemma2", "gemma3_text", "cohere", "granite", "starcoder2",
            "gpt_neox", "gptj")
assert set(FAMILIES) <= set(TINY)

MAX_SEQ_LEN = 64
REL = 1e-4  # the service's number went through JSON and Postgres; the runs agree to ~1e-7
# Phi-3 names its fused projections itself: the task picks two of them (the others adapt all)
TARGETS = {"phi3": ["qkv_proj", "gate_up_proj"]}


@pytest.fixture
def models_yaml(tmp_path: Path) -> Path:
    from trainer.tiny import make_tiny_model

    lines = ["models:"]
    for family in FAMILIES:
        model_dir = make_tiny_model(family, tmp_path / f"tiny-{family}", seed=0)
        lines += [f"  - name: tiny-{family}", f"    path: {model_dir}", "    parameters: 100000",
                  "    gpus: 1", "    max_seq_len: 128", f"    family: {family}"]
    path = tmp_path / "models.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def download(http, url: str, out: Path) -> Path:  # noqa: ANN001
    r = http.get(url, params={"format": "zip"})
    assert r.status_code == 200, r.text
    zipfile.ZipFile(io.BytesIO(r.content)).extractall(out)
    return out


def check_adapter(family: str, model_dir: Path, adapter_dir: Path, val_path: Path,
                  best_val_loss: float) -> None:
    """The downloaded adapter adapts every targeted projection of every layer, loads whole into
    PEFT, and PEFT's token-mean loss on the validation file is the reported best_val_loss."""
    from transformers import AutoTokenizer

    from trainer.data import read_jsonl, tokenize_all

    fam = family_of(family)
    targets = TARGETS.get(family) or list(fam.default_targets)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert cfg["target_modules"] == sorted(targets) and cfg["r"] == 4, (family, cfg)
    saved = load_peft_weights(adapter_dir)
    assert set(saved) == lora_keys(base_model(model_dir), fam, targets), family
    assert all(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k), family
    val = tokenize_all(AutoTokenizer.from_pretrained(model_dir), read_jsonl(val_path), MAX_SEQ_LEN)
    loss = own_loss(load_whole(model_dir, adapter_dir), val)
    assert loss == pytest.approx(best_val_loss, rel=REL), (family, loss, best_val_loss)
    # the trained adapter is far from no adapter at this tolerance: the comparison sees it
    base = own_loss(base_model(model_dir), val)
    assert abs(loss - base) > 10 * REL * base, (family, loss, base)


def test_each_family_layout_trains_through_the_api(stack: Stack, tmp_path: Path) -> None:
    stack.daemon("cpu-node")
    train_rows, val_rows = synthetic_rows(24, seed=1), synthetic_rows(8, seed=2)
    val_path = tmp_path / "val.jsonl"
    val_path.write_text("".join(json.dumps(r) + "\n" for r in val_rows))
    tasks: dict[str, dict] = {}
    with stack.http() as http:
        base = {"training_file": upload_jsonl(http, "train.jsonl", train_rows),
                "validation_file": upload_jsonl(http, "val.jsonl", val_rows), "epochs": 1,
                "max_seq_len": MAX_SEQ_LEN,
                "search_space": {"learning_rate": [3e-2, 1e-2], "lora_rank": [4],
                                 "lora_alpha": [8.0], "batch_size": [4]},
                # every 2 of the 6 steps, on the whole validation file: the adapter exported is
                # the best-val one, and its loss the best_val_loss reported
                "eval": {"eval_every_steps": 2, "eval_max_samples": None},
                "early_exit": {"enabled": False}}
        # a projection the family lacks is a 422 at create, naming it (never a failed run)
        r = http.post("/v1/tasks", json={**base, "base_model": "tiny-phi3",
                                         "target_modules": ["q_proj"]})
        assert r.status_code == 422 and "q_proj" in r.json()["error"]["message"], r.text
        for family in FAMILIES:
            r = http.post("/v1/tasks", json={**base, "base_model": f"tiny-{family}",
                                             "target_modules": TARGETS.get(family)})
            assert r.status_code == 201, r.text
            tasks[family] = r.json()
            assert tasks[family]["num_jobs"] == 2
        for family, task in tasks.items():
            wait_for(lambda t=task: http.get(f"/v1/tasks/{t['id']}").json()["state"]
                     != "validating_files", 30, f"file validation of {family}")
            stack.place(task["id"], "cpu-node")  # one slot: the daemon runs them one by one

        for family, task in tasks.items():
            final = wait_for(lambda t=task: (got := http.get(f"/v1/tasks/{t['id']}").json())[
                "state"] in ("succeeded", "failed", "cancelled") and got, 150,
                f"the {family} task to end\n{stack.daemon_log('cpu-node')}")
            assert final["state"] == "succeeded", (family, final, stack.daemon_log("cpu-node"))
            jobs = http.get(f"/v1/tasks/{task['id']}/jobs").json()["data"]
            assert len(jobs) == 2
            for job in jobs:
                assert job["state"] == "completed" and job["has_adapter"], (family, job)
                out = download(http, f"/v1/jobs/{job['id']}/adapter", tmp_path / job["id"])
                check_adapter(family, tmp_path / f"tiny-{family}", out, val_path,
                              job["best_val_loss"])
            # the task's adapter is its best job's
            best = min(jobs, key=lambda j: j["best_val_loss"])
            assert final["best_job_id"] == best["id"]
            task_out = download(http, f"/v1/tasks/{task['id']}/adapter", tmp_path / task["id"])
            assert (task_out / "adapter_model.safetensors").read_bytes() == (
                tmp_path / best["id"] / "adapter_model.safetensors").read_bytes()
