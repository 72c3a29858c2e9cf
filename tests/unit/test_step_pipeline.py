"""Unit: the next graphed step launched before this one's numbers are read (trainer.step_pipeline) on the CPU, where a
capture is its stand-in (the body run on the same static buffers, at launch): the steps, their reports, the jobs'
weights, moments and data streams equal a graphed engine's without it (updates decided on the device in both,
bit for bit); a change of the job set, of a job's stream or of the arenas drops the step launched ahead (its
gradients never applied, the streams where they were); nothing is launched where the executor says the set
changes (graph_parts.holds_next), near a job's end or for a key no capture serves. An executor's whole task
(ranking, evaluations, exits) is checked against the same task without it in test_step_pipeline_executor.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.unit.test_graph_ahead import _mixed_lengths
from tests.unit.test_step_graphs import _captures_inline, engine, job, model_dir  # noqa: F401 - fixtures
from trainer import graph_parts, step_pipeline, step_update
from trainer.engine import MultiLoraEngine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _device_updates(monkeypatch) -> None:  # noqa: ANN001
    """The pipeline on (LORAPLEX_STEP_AHEAD=1); both engines decide their updates on the device (the pipeline's
    steps always do): bit for bit."""
    monkeypatch.setattr(step_update, "DEVICE_UPDATE", True)
    monkeypatch.setattr(step_pipeline, "ON", True)


def pair(model_dir, data=None, specs=None) -> tuple[MultiLoraEngine, MultiLoraEngine]:  # noqa: ANN001, F811
    """Two graphed engines with the same jobs, the second launching steps ahead (holds: always)."""
    data = data if data is not None else _mixed_lengths()
    plain, piped = engine(model_dir, True, data), engine(model_dir, True, data)
    piped.pipeline.holds = lambda: True
    for eng in (plain, piped):
        eng.step_graphs.capture_after = 0  # a key is captured at its first step (never covered)
        for spec in specs or (job("a", 8, 2, 1), job("b", 16, 3, 2)):
            eng.attach(spec)
    return plain, piped


def same_state(plain: MultiLoraEngine, piped: MultiLoraEngine, ids=None) -> None:  # noqa: ANN001
    """Every job's weights, moments, counts and data stream equal, bit for bit."""
    for j in ids or plain.jobs:
        want, got = plain.jobs[j], piped.jobs[j]
        assert torch.equal(got.adapter.flat, want.adapter.flat), j
        st_w, st_g = want.optimizer.state.get(want.adapter.flat, {}), got.optimizer.state.get(got.adapter.flat, {})
        assert st_w.keys() == st_g.keys(), j
        for k in st_w:
            assert torch.equal(torch.as_tensor(st_g[k]), torch.as_tensor(st_w[k])), (j, k)
        assert (got.step, got.skipped_steps, got.stream.state_dict()) == (want.step, want.skipped_steps,
                                                                          want.stream.state_dict()), j
        assert got.scheduler.get_last_lr() == want.scheduler.get_last_lr(), j


def same_reports(plain: MultiLoraEngine, piped: MultiLoraEngine, n: int) -> None:
    for _ in range(n):
        want, got = plain.step(), piped.step()
        # repr: every float to its last bit, a NaN equal to a NaN
        assert repr((got.losses, got.grad_norms, got.skipped, got.lrs, got.steps, got.job_tokens, got.tokens)) == repr(
            (want.losses, want.grad_norms, want.skipped, want.lrs, want.steps, want.job_tokens, want.tokens))


def test_steps_launched_ahead_equal_the_steps_without_and_each_is_adopted(model_dir) -> None:  # noqa: ANN001, F811
    plain, piped = pair(model_dir)
    same_reports(plain, piped, 14)
    # the 15th step is in flight; its batch came from a copy of each stream: the streams are at the 14th's end
    assert piped.pipeline.ahead is not None
    same_state(plain, piped)
    g = piped.step_graphs.ahead
    # a step replaying a capture is launched during the step before; each is adopted (the set held)
    assert g["step_launched"] >= 8 and g["step_adopted"] == g["step_launched"] - 1
    assert g["step_dropped"] == 0 and plain.step_graphs.ahead["step_launched"] == 0
    assert g["step_uncaptured"] >= 1  # the keys' first steps capture: launched in their own call


@pytest.mark.parametrize("change", ["detach", "stream", "arena"])
def test_a_change_under_the_step_launched_ahead_drops_it_and_the_steps_go_on_as_without(
        model_dir, change: str) -> None:  # noqa: ANN001, F811
    plain, piped = pair(model_dir, specs=[job("a", 8, 2, 1), job("b", 16, 3, 2), job("c", 8, 1, 3)])
    same_reports(plain, piped, 8)
    assert piped.pipeline.ahead is not None  # the 9th step is launched
    launched = piped.step_graphs.ahead["step_launched"]
    gone = {}
    for eng in (plain, piped):
        if change == "detach":  # a job exits between the steps: parked as the 8th step left it
            gone[eng] = eng.detach("b", park_device="cpu")
            gone[eng].settle()
        elif change == "stream":  # a job's data order moved (e.g. restored from a checkpoint)
            eng.jobs["c"].stream.next_indices(1)
        else:  # the arena grows: every capture dropped
            eng.attach(job("big", 64, 1, 9))
    if gone:  # the launched step's gradients were never applied to the job that left, nor its stream moved
        want, got = gone[plain], gone[piped]
        assert torch.equal(got.adapter.flat, want.adapter.flat)
        assert got.stream.state_dict() == want.stream.state_dict() and got.step == want.step == 8
    same_reports(plain, piped, 6)  # the arena's growth drops the captures: its keys are captured again first
    g = piped.step_graphs.ahead
    assert g["step_dropped"] == 1 and g["step_launched"] > launched
    same_state(plain, piped)


def test_nothing_is_launched_where_the_set_changes_next_or_a_job_ends(model_dir, monkeypatch) -> None:  # noqa: ANN001, F811
    with monkeypatch.context() as m:  # off (the default): nothing launched, whatever the executor says
        m.setattr(step_pipeline, "ON", False)
        plain, piped = pair(model_dir)
        same_reports(plain, piped, 4)
        assert piped.step_graphs.ahead["step_launched"] == 0 and piped.step_graphs.replays >= 1
    plain, piped = pair(model_dir)
    answers = iter([False, True] * 20)
    piped.pipeline.holds = lambda: next(answers)
    same_reports(plain, piped, 8)
    g = piped.step_graphs.ahead
    assert g["step_held"] >= 3 and g["step_launched"] >= 2 and g["step_dropped"] == 0
    piped.pipeline.holds = lambda: True
    same_reports(plain, piped, 1)  # a step launched ahead, adopted next
    for eng in (plain, piped):
        eng.jobs["a"].total_steps = eng.jobs["a"].step + 2  # the launched step and one more are its last
    launched, held = g["step_launched"], g["step_held"]
    same_reports(plain, piped, 1)  # its last step launched ahead
    assert g["step_launched"] == launched + 1
    same_reports(plain, piped, 1)  # "a" done after it: the next step is not launched
    assert g["step_launched"] == launched + 1 and g["step_held"] == held + 1 and piped.jobs["a"].done
    same_reports(plain, piped, 3)  # "b" alone
    same_state(plain, piped)
    assert g["step_dropped"] == 0


def test_a_non_finite_job_skips_alone_with_steps_launched_ahead(model_dir) -> None:  # noqa: ANN001, F811
    plain, piped = pair(model_dir, specs=[job("a", 8, 2, 1), job("b", 16, 3, 2, lr=1e25)])  # "b" blows up
    same_reports(plain, piped, 11)
    assert piped.jobs["b"].skipped_steps >= 5 and piped.jobs["a"].skipped_steps == 0
    assert piped.step_graphs.ahead["step_adopted"] >= 4
    same_state(plain, piped, ["a"])


@dataclass
class _Slot:
    job_id: str
    owner: int
    batch_size: int
    step: int
    total_steps: int


class _Task:
    def __init__(self, slots, every: int, warmup: int | None = None) -> None:  # noqa: ANN001
        self.placed = {s.job_id: s for s in slots}
        self.every, self.warmup = every, warmup

    def in_warmup(self, job_id: str) -> bool:
        return self.warmup is not None

    def warmup_len(self, s) -> int:  # noqa: ANN001
        return self.warmup

    def cadence_due(self, s) -> bool:  # noqa: ANN001
        return s.step % self.every == 0


def test_the_set_holds_without_a_last_step_a_warmup_end_or_an_evaluation_next() -> None:
    class Eng:
        jobs = {"a": 0, "b": 0}

    def holds(step: int, total: int = 50, every: int = 10, warmup: int | None = None) -> bool:
        slots = [_Slot("a", 0, 2, step, total), _Slot("b", 0, 1, step, total), _Slot("x", 0, 1, 0, 1)]
        return graph_parts.holds_next(Eng(), iter([_Task(slots, every, warmup)]))

    # `step`: the steps each job has done, the one now running not counted
    assert holds(3) and holds(8)  # at 8 the next step (which ends at 10) runs before the evaluation
    assert not holds(9) and not holds(19)  # an evaluation after the step now running (the cadence at 10, 20)
    assert holds(48) and not holds(49)  # the step now running is "a"'s and "b"'s last
    assert holds(4, warmup=6) and not holds(5, warmup=6)  # the warmup's end (a ranking) after the 6th step
