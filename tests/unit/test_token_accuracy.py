"""Validation token accuracy of SFT jobs (CPU): the chunked head's hits equal the plain logits'
argmax, the engine's evaluation equals a hand computation from each job's full logits, and the
number reaches the spool's validation points through the executor subprocess entry."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from contract.protocol import (
    EarlyExitSettings,
    EvalSettings,
    JobHyperparameters,
    JobSpec,
    PlacementSpec,
    TaskSettings,
)
from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir, write_jsonl
from trainer.data import IGNORE, parse_record, tokenize_all
from trainer.engine import MultiLoraEngine
from trainer.head import token_losses, token_losses_and_hits
from trainer.jobs import TrainJob
from worker import runner
from worker.spool import SpoolWriter, read_complete_lines

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
def test_hits_are_the_argmax_of_the_same_logits(chunk: int) -> None:
    torch.manual_seed(chunk)
    head = nn.Linear(16, 12, bias=False).double().requires_grad_(False)
    h = torch.randn(23, 16, dtype=torch.float64)
    logits = head(h)
    t = logits.argmax(-1).clone()
    t[::3] = (t[::3] + 1) % 12  # every third token wrong, the rest right
    losses, hits = token_losses_and_hits(head, h, t, chunk)
    assert torch.equal(hits, (logits.argmax(-1) == t).double())
    assert hits.sum().item() == 23 - 8
    assert torch.allclose(losses, token_losses(head, h, t, chunk), rtol=1e-12, atol=0)
    empty = token_losses_and_hits(head, h[:0], t[:0], chunk)
    assert empty[0].shape == empty[1].shape == (0,)


def test_engine_token_accuracy_equals_the_hand_computation(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_model_dir("llama", tmp_path)
    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = tokenize_all(tok, [parse_record(r) for r in synthetic_rows(24, seed=5)], 48)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eng = MultiLoraEngine(model, examples[:16], tok.pad_token_id)
    eng.head_chunk = 5  # several chunks per forward
    for i, lr in enumerate((3e-2, 1e-3)):
        eng.attach(TrainJob(f"j{i}", lora_rank=4, lora_alpha=8.0, learning_rate=lr, batch_size=4, seed=i, max_steps=12))
    for _ in range(12):  # trained apart: the jobs' accuracies differ
        eng.step()
    held_out = examples[16:]
    got = eng.evaluate_metrics(held_out, batch_size=3)
    for job_id in eng.jobs:
        hits = total = 0
        for ex in held_out:
            logits = eng.evaluation.logits(job_id, torch.tensor([ex.input_ids]))[0]
            labels = torch.tensor(ex.labels[1:])
            mask = labels != IGNORE
            hits += int((logits[:-1].argmax(-1)[mask] == labels[mask]).sum())
            total += int(mask.sum())
        assert set(got[job_id]) == {"loss", "token_accuracy"}
        assert got[job_id]["token_accuracy"] == pytest.approx(hits / total, abs=1e-12)
    assert got["j0"]["token_accuracy"] > 0  # it learned something: not a trivial zero
    # evaluate (the loss alone, for early exit) is unchanged
    assert eng.evaluate(held_out, 3) == {j: m["loss"] for j, m in got.items()}


def test_sft_placement_reports_token_accuracy_on_validation_points(tmp_path: Path) -> None:
    model = tiny_model_dir("llama", tmp_path)
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train.jsonl", synthetic_rows(20, seed=3))
    hp = JobHyperparameters(learning_rate=1e-2, lora_rank=4, lora_alpha=8, batch_size=2)
    spec = PlacementSpec(
        task_id="t", placement_id="p", attempt=1, node_id="n", gpu_indices=[0], method="sft",
        base_model="tiny", base_model_path=str(model), training_file_id="f",
        training_file_url="/f", training_file_format="chat", settings=TaskSettings(validation_split=0.2,
        max_seq_len=48, epochs=1, seed=0, eval=EvalSettings(eval_every_steps=4),
        early_exit=EarlyExitSettings(enabled=False)),
        jobs=[JobSpec(job_id="j0", index=0, state="pending", hyperparameters=hp)])
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    result = runner.train(spec, tmp_path, runner.SpoolReporter(spool, tmp_path),
                          runner.StopFlag(tmp_path, 0))
    spool.close()
    assert result["summary"]["jobs"] == {"j0": "completed"}
    points = [json.loads(t)["point"] for _, _, t in read_complete_lines(tmp_path / "spool.jsonl", 0)
              if json.loads(t)["type"] == "metric"]
    val = [p for p in points if p["split"] == "val"]
    assert val and all(set(p["data"]) == {"token_accuracy"} for p in val)
    assert all(0.0 <= p["data"]["token_accuracy"] <= 1.0 and math.isfinite(p["loss"]) for p in val)
    assert all(not (p["data"] or {}).get("token_accuracy") for p in points if p["split"] == "train")
