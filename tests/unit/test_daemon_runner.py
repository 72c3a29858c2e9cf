"""Unit: the executor entry (worker/runner.py) with the training call replaced: what it writes
to the spool on success, on an exception (retryable or not), on SIGTERM, on a stale lease."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from contract.protocol import (
    EarlyExitSettings,
    EvalSettings,
    JobHyperparameters,
    JobSpec,
    PlacementSpec,
    TaskSettings,
)
from worker import runner
from worker.spool import read_complete_lines


def spec(**kw: object) -> PlacementSpec:
    base = dict(task_id="task_1", placement_id="pl_1", attempt=1, node_id="n", gpu_indices=[0],
                method="sft", base_model="tiny", base_model_path="/m", training_file_id="f1",
                training_file_url="/internal/v1/files/f1/content", training_file_format="chat",
                settings=TaskSettings(validation_split=0.1, max_seq_len=64, epochs=1, seed=0,
                                      eval=EvalSettings(), early_exit=EarlyExitSettings()),
                jobs=[JobSpec(job_id="j0", index=0, state="pending", hyperparameters=
                              JobHyperparameters(learning_rate=1e-3, lora_rank=4,
                                                 lora_alpha=8, batch_size=2))])
    return PlacementSpec.model_validate(base | kw)


def records(directory: Path) -> list[dict]:
    return [json.loads(t) for _, _, t in read_complete_lines(directory / "spool.jsonl", 0)]


@pytest.fixture
def placement(tmp_path: Path) -> Path:
    (tmp_path / "spec.json").write_text(spec().model_dump_json())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    return tmp_path


def test_success_reports_through_the_spool(placement: Path, monkeypatch) -> None:  # noqa: ANN001
    def fake_train(s, directory, reporter, should_stop):  # noqa: ANN001, ANN202
        assert runner.inputs(directory, s) == {"train": directory / "data" / "train.jsonl",
                                               "validation": None, "resume": None}
        reporter.job_state("j0", "running")
        reporter.train_loss("j0", 1, 2.5, lr=1e-3)
        reporter.val_loss("j0", 1, 2.4)
        out = reporter.adapter_dir("j0")
        (out / "adapter_config.json").write_text("{}")
        reporter.adapter("j0", out)
        reporter.job_state("j0", "completed", best_val_loss=2.4, best_step=1)
        assert not should_stop()
        return {"best_job_id": "j0", "summary": {"steps": 1}}

    monkeypatch.setattr(runner, "train", fake_train)
    assert runner.main(["--placement-dir", str(placement)]) == 0
    recs = records(placement)
    assert [r["type"] for r in recs] == ["job_state", "metric", "metric", "artifact",
                                         "job_state", "finished"]
    assert recs[1]["point"] == {"job_id": "j0", "step": 1, "split": "train", "loss": 2.5,
                                "data": {"lr": 1e-3}}
    assert recs[3]["meta"]["kind"] == "adapter" and recs[3]["dir"].startswith("artifacts/")
    assert (placement / recs[3]["dir"] / "adapter_config.json").exists()
    assert recs[4]["update"] == {"state": "completed", "best_val_loss": 2.4, "best_step": 1}
    assert recs[5] == {"type": "finished", "report": {"best_job_id": "j0", "summary": {"steps": 1}}}


@pytest.mark.parametrize(("exc", "retryable"), [(RuntimeError("CUDA OOM"), True),
                                                (ValueError("no trainable record"), False)])
def test_exceptions_become_failed_records(placement: Path, monkeypatch, exc: Exception,  # noqa: ANN001
                                          retryable: bool) -> None:
    def boom(*a):  # noqa: ANN002, ANN202
        raise exc

    monkeypatch.setattr(runner, "train", boom)
    assert runner.main(["--placement-dir", str(placement)]) == 1
    last = records(placement)[-1]
    assert last["type"] == "failed" and last["report"]["retryable"] is retryable
    assert str(exc) in last["report"]["error"]


def test_sigterm_and_stale_lease_stop_with_a_retryable_failure(placement: Path,
                                                               monkeypatch) -> None:  # noqa: ANN001
    def until_stopped(s, directory, reporter, should_stop):  # noqa: ANN001, ANN202
        os.kill(os.getpid(), 15)
        deadline = time.monotonic() + 5
        while not should_stop() and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"stopped": True}

    monkeypatch.setattr(runner, "train", until_stopped)
    import signal

    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert runner.main(["--placement-dir", str(placement)]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    recs = records(placement)
    assert recs[-1] == {"type": "failed", "report": {
        "error": "executor stopped: SIGTERM", "retryable": True, "detail": None}}

    lease = placement / "lease"
    lease.touch()
    flag = runner.StopFlag(placement, lease_timeout_s=30)
    assert not flag()
    old = time.time() - 60
    os.utime(lease, (old, old))
    assert flag() and "lease stale" in flag.reason
