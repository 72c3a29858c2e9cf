"""Unit: an executor's task with its graphed steps launched ahead (trainer.step_pipeline, wired by the executor's
graph_parts.holds_next) against the same task without: on the CPU, with the step graphs' stand-in and the varlen
packing, a task of six configurations (three at a time, a warmup ranking with rotation, evaluations every 4 steps,
a diverging job, checkpoints) reports the same train losses, evaluations, job states, statuses and ranking, bit
for bit (updates decided on the device in both runs), and steps were launched ahead and adopted."""

from __future__ import annotations

import functools

import pytest

from tests.unit.test_engine_executor import Recorder, config
from trainer import graph_thread, step_pipeline, step_update
from trainer.engine import MultiLoraEngine
from trainer.executor import Executor

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(tmp_path, monkeypatch, on: bool, out: str):  # noqa: ANN001, ANN202
    monkeypatch.setattr(step_pipeline, "ON", on)
    rec = Recorder()
    ex = Executor(config(tmp_path, out, attention="varlen"), rec.callbacks())
    status = ex.run()
    return rec, status, ex.engine.step_graphs


def test_a_task_with_steps_launched_ahead_reports_what_it_reports_without(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(step_update, "DEVICE_UPDATE", True)
    monkeypatch.setattr(graph_thread, "ON", False)  # captures inline: the same captures in both runs
    # the step graphs where CUDA graphs do not exist: their stand-in (what the CPU tests of step_graphs run)
    monkeypatch.setattr("trainer.sft.MultiLoraEngine", functools.partial(MultiLoraEngine, step_graphs=True))
    off, off_status, off_graphs = _run(tmp_path, monkeypatch, False, "off")  # the default
    on, on_status, graphs = _run(tmp_path, monkeypatch, True, "on")
    assert graphs is not None and graphs.replays > 0
    assert off_graphs.ahead["step_launched"] == 0
    assert graphs.ahead["step_adopted"] >= 5, dict(graphs.ahead)
    # the set changed under few of them (a divergence exit is known only after its step)
    assert graphs.ahead["step_dropped"] <= 2 and graphs.ahead["step_held"] >= 3, dict(graphs.ahead)
    assert repr(dict(on.train)) == repr(dict(off.train))
    assert repr(dict(on.evals)) == repr(dict(off.evals))
    assert on_status == off_status and on_status["job3"]["exit_reason"] == "diverging"
    assert [(j, s) for j, s, _ in on.states] == [(j, s) for j, s, _ in off.states]
    ranking = [[d for _, m, d in rec.events if m == "warmup_ranking"] for rec in (on, off)]
    assert len(ranking[0]) == 1 and repr(ranking[0]) == repr(ranking[1])
    assert sorted(on.adapters) == sorted(off.adapters)
