"""Unit: the bench's step tools (session 66): bench/step_profile.py profiles only the chosen steps and writes their
tables, and bench/task_steps.py sorts a task's steps into kinds as the step trace names them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import step_profile  # noqa: E402
import task_steps  # noqa: E402


def test_only_the_chosen_steps_are_profiled_and_each_writes_its_table(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setitem(step_profile.PROFILE, "steps", {1})
    monkeypatch.setitem(step_profile.PROFILE, "prefix", str(tmp_path / "run"))
    x = torch.randn(64, 64)
    outs = [step_profile.profiled(i, lambda: (x @ x).sum().item()) for i in range(3)]
    assert outs[0] == outs[1] == outs[2]  # the step's own result, profiled or not
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run_step1.txt"]
    text = (tmp_path / "run_step1.txt").read_text()
    assert text.startswith("# training step 1: host ") and "aten::mm" in text


def test_a_tasks_steps_are_sorted_by_kind_and_summed(tmp_path) -> None:  # noqa: ANN001
    assert task_steps.kind_of("eager_runs") == "eager"
    assert task_steps.kind_of("captures+replays") == "capture"
    assert task_steps.kind_of("captures+replays+ahead_thread_started") == "replay"  # the thread's capture
    assert task_steps.kind_of("captures+covered+replays+ahead_thread_started") == "covered"
    assert task_steps.kind_of("replays") == "replay"
    trace = [[5000, 8, 0, 0.5, 0, "eager_runs", []], [900, 2, 0, 0.4, 0, "captures+replays", []],
             [1200, 2, 0, 0.12, 0, "covered+replays", []], [1000, 2, 0, 0.08, 0, "replays", []],
             [1100, 2, 0, 0.09, 0, "replays+ahead_thread_started", []], [1300, 2, 0, 0.2, 0, "replays", []]]
    run = {"phases": {"train": 1.39, "eval": 0.837}, "train_tokens": 10500, "step_trace": trace, "timings": {},
           "graphs": {"captures": 2, "ahead_thread_made": 1, "graphs": 2}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"args": {"layers": 2}, "runs": {"cold": run}}))
    cells = [c.strip() for c in task_steps.row(str(path)).strip("|").split("|")]
    assert cells[0] == "t.json" and cells[1] == f"{10500 / 1.39 / 1e3:.2f}k"
    # the covered step (1,200 tokens: the 1,280 key at 4 sizes an octave) over that key's one replay, 0.09 s
    assert cells[4:9] == ["1, 0.50", "1, 0.40", "1, 0.12", "0.03", "3, 0.37"] and cells[9:] == ["2", "1", "2", "0.84"]
    run.update(first_calls_s=[0.2618], timings={"pool_quiet_pins": 7})
    path.write_text(json.dumps({"args": {"layers": 2}, "runs": {"cold": run}}))
    first = [c.strip() for c in task_steps.first_row(str(path), 2).strip("|").split("|")]
    assert first == ["t.json", "0.500", "0.400", "0.50", "0.26", "7"]  # two walls, the eager step, the warm-up
