"""The executor subprocess entry (worker/runner.py) on a DPO placement, for real on a tiny Llama:
method and beta reach the executor, reward accuracy/margin reach the spool's metric points."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from contract.protocol import (
    EarlyExitSettings,
    EvalSettings,
    JobHyperparameters,
    JobSpec,
    PlacementSpec,
    TaskSettings,
)
from tests.helpers.engine_ref import tiny_model_dir, write_jsonl
from tests.unit.test_dpo import preference_rows
from worker import runner
from worker.spool import SpoolWriter, read_complete_lines

pytestmark = pytest.mark.usefixtures("one_thread")


def test_dpo_placement_trains_with_each_jobs_beta_and_reports_rewards(tmp_path: Path) -> None:
    model = tiny_model_dir("llama", tmp_path)
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train.jsonl", preference_rows(18, seed=2))
    hp = [JobHyperparameters(learning_rate=1e-2, lora_rank=4, lora_alpha=8, batch_size=2, beta=b)
          for b in (0.1, 0.7)]
    spec = PlacementSpec(
        task_id="t", placement_id="p", attempt=1, node_id="n", gpu_indices=[0], method="dpo",
        base_model="tiny", base_model_path=str(model), training_file_id="f",
        training_file_url="/f", training_file_format="preference", settings=TaskSettings(validation_split=0.2,
        max_seq_len=40, epochs=1, seed=0, eval=EvalSettings(eval_every_steps=3),
        early_exit=EarlyExitSettings(enabled=False)),
        jobs=[JobSpec(job_id=f"j{i}", index=i, state="pending", hyperparameters=h) for i, h in enumerate(hp)])
    cfg = runner.executor_config(spec, tmp_path)
    assert cfg.method == "dpo" and [j.beta for j in cfg.jobs] == [0.1, 0.7] and cfg.world_size == 1
    # a node checkpoints by time alone unless its operator names a step count
    assert (cfg.checkpoint_every, cfg.checkpoint_every_s) == (None, 300.0)
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    result = runner.train(spec, tmp_path, runner.SpoolReporter(spool, tmp_path),
                          runner.StopFlag(tmp_path, 0))
    spool.close()
    assert result["summary"]["jobs"] == {"j0": "completed", "j1": "completed"}
    recs = [json.loads(t) for _, _, t in read_complete_lines(tmp_path / "spool.jsonl", 0)]
    points = [r["point"] for r in recs if r["type"] == "metric"]
    for split in ("train", "val"):
        mine = [p for p in points if p["split"] == split]
        assert {p["job_id"] for p in mine} == {"j0", "j1"}
        for p in mine:
            assert set(p["data"]) == {"reward_accuracy", "reward_margin"}
            assert 0.0 <= p["data"]["reward_accuracy"] <= 1.0 and math.isfinite(p["loss"])
    # usage on each train point: both jobs trained every pair once (batch 2 divides the 14
    # training pairs, one epoch), so each trained the same tokens; validation points carry none
    used: dict[str, int] = {}
    for p in points:
        if p["split"] == "train":
            assert p["tokens"] > 0 and p["gpu_seconds"] >= 0
            used[p["job_id"]] = used.get(p["job_id"], 0) + p["tokens"]
        else:
            assert "tokens" not in p
    assert used["j0"] == used["j1"] > 0
    assert result["best_job_id"] in ("j0", "j1")
    # The last record before the end is a checkpoint of the last step, after every job ended: a
    # retry on this node resumes from it with nothing left to train (worker.local_resume).
    kinds = [r["type"] if r["type"] != "artifact" else r["meta"]["kind"] for r in recs]
    assert kinds[-1] == "checkpoint", kinds[-5:]
    last = torch.load(tmp_path / recs[-1]["dir"] / "state.pt", weights_only=False)
    assert last["global_step"] == max(p["step"] for p in points) and last["active"] == []
    assert max(i for i, k in enumerate(kinds) if k == "job_state") < len(kinds) - 1


def test_bridge_attaches_extras_to_their_point_and_nulls_non_finite(tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    (tmp_path / "out").mkdir()
    bridge = runner._Bridge(runner.SpoolReporter(spool, tmp_path), tmp_path / "out")
    bridge.on_metrics("j0", 1, "train", {"reward_accuracy": 0.5, "reward_margin": float("nan")})
    bridge.on_metrics("j0", 2, "val", {"reward_accuracy": 1.0, "reward_margin": 0.25})
    bridge.on_usage("j0", 1, 120, 0.25)
    bridge.on_train_loss("j0", 1, 0.69)
    bridge.on_train_loss("j1", 1, 0.70)  # a point without extras keeps data null
    bridge.on_eval("j0", 2, 0.6)
    spool.close()
    points = [json.loads(t)["point"] for _, _, t in read_complete_lines(tmp_path / "spool.jsonl", 0)]
    assert [p["data"] for p in points] == [{"reward_accuracy": 0.5, "reward_margin": None}, None,
                                           {"reward_accuracy": 1.0, "reward_margin": 0.25}]
    assert bridge.extra == {} and bridge.usage == {}
    assert (points[0]["tokens"], points[0]["gpu_seconds"]) == (120, 0.25)
    assert "tokens" not in points[1] and "tokens" not in points[2]
