"""Unit: step graphs captured on a thread a few steps ahead (trainer.graph_thread) on the CPU, where a capture
is its stand-in (the body replayed on the same static buffers): the key found is the one the coming step would
capture, the thread's captures serve their steps with the eager steps' numbers, everything that changes what a
capture reads waits for it, and a capture that makes nothing leaves its key to its own step.
The CUDA graph captured on a thread is checked on a device (tests/gpu/test_step_graphs_gpu.py)."""

from __future__ import annotations

import contextlib
import sys
import threading

import pytest
import torch

from tests.unit.test_graph_ahead import mixed_two_jobs, same_weights
from tests.unit.test_step_graphs import examples, job, model_dir  # noqa: F401 - the fixture
from trainer import admission, graph_ahead, graph_thread
from trainer.admission import RecomputePolicy
from trainer.config import ExecutorConfig
from trainer.memory_model import MemoryModel
from trainer.memory_plan import MemoryPlan
from trainer.sft import Sft
from trainer.step_graphs import StepGraphs
from trainer.strategy import OneGpu

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _as_it_was():  # noqa: ANN202 - a test that fails with a capture under way leaves no wrapper for the next
    switch, sync, empty = sys.getswitchinterval(), torch.cuda.synchronize, torch.cuda.empty_cache
    yield
    sys.setswitchinterval(switch)
    torch.cuda.synchronize, torch.cuda.empty_cache = sync, empty


def _upcoming(g: StepGraphs, states: list) -> tuple | None:  # noqa: ANN001
    return graph_thread.upcoming(g, states, graph_ahead._peek, graph_ahead._step_key)


def test_the_key_found_is_the_one_the_coming_step_captures_and_the_streams_stay(model_dir, monkeypatch) -> None:  # noqa: ANN001, F811
    monkeypatch.setattr(graph_ahead, "NEXT", False)
    _, graphed = mixed_two_jobs(model_dir, 1)
    g, states = graphed.step_graphs, list(graphed.jobs.values())
    positions = [dict(s.stream.state_dict()) for s in states]
    found = _upcoming(g, states)
    assert found is not None
    key, on = found
    assert [s.stream.state_dict() for s in states] == positions and not g.cover_uses  # nothing moved or kept
    assert 1 <= on <= graph_thread.LOOKAHEAD and key not in g.entries
    for n in range(1, on + 1):
        captures = g.captures
        graphed.step()
        assert (g.captures == captures + 1) == (n == on)  # the steps before it replay what they have
    assert g.entries[key].graph is not None
    # a set that changes after this step (a job's end, a ranking) has no coming step to look at
    g.set_lasts = lambda: 1
    assert _upcoming(g, states) is None


def test_a_capture_on_a_thread_serves_its_step_with_the_eager_steps_numbers(model_dir, monkeypatch) -> None:  # noqa: ANN001, F811
    """With LORAPLEX_CAPTURE_THREAD, the graphed engine's steps equal the eager engine's, every key is captured
    as without it, and fewer captures run at their own step's start (the thread captured them ahead)."""
    monkeypatch.setattr(graph_ahead, "NEXT", True)
    threads: list[str] = []
    real = StepGraphs._capture

    def capture(self, entry, key, sync=True):  # noqa: ANN001, ANN202 - on which thread each capture ran
        threads.append(threading.current_thread().name)
        return real(self, entry, key, sync)

    monkeypatch.setattr(StepGraphs, "_capture", capture)
    counts = {}
    for on in (False, True):
        monkeypatch.setattr(graph_thread, "ON", on)
        threads.clear()
        eager, graphed = mixed_two_jobs(model_dir, 14)
        g = graphed.step_graphs
        graph_thread.settle(g)
        same_weights(eager, graphed)
        counts[on] = (set(g.entries), g.captures, threads.count("step-capture"), g.ahead["thread_made"], g.replays)
    keys_off, captures_off, thread_off, made_off, replays_off = counts[False]
    keys_on, captures_on, thread_on, made_on, replays_on = counts[True]
    assert thread_off == made_off == 0 and made_on == thread_on >= 2
    assert keys_off <= keys_on and captures_on - captures_off == len(keys_on) - len(keys_off) <= 1
    assert replays_on == replays_off == 13  # every step after the first replayed a capture
    assert sys.getswitchinterval() > graph_thread.SWITCH_S  # put back


def _held(monkeypatch, release: threading.Event) -> list[str]:  # noqa: ANN001
    """A capture on the thread that lasts until `release` (a device's ~0.3 s of host), once it has made its graph."""
    real = StepGraphs._capture
    order: list[str] = []

    def capture(self, entry, key, sync=True):  # noqa: ANN001, ANN202
        graph = real(self, entry, key, sync)
        if threading.current_thread().name == "step-capture":
            release.wait(5)
            order.append("captured")
        return graph

    monkeypatch.setattr(StepGraphs, "_capture", capture)
    return order


CHANGES = {
    "detach": lambda eng: eng.detach("a"),
    "recompute": lambda eng: eng.set_recompute(not eng.gradient_checkpointing),
    "evaluation": lambda eng: eng.evaluate(examples(4, 12, seed=4), batch_size=2),
    "forward": lambda eng: eng.idle_forward(),
    "attach": lambda eng: eng.attach(job("c", 4, 1, 3)),
    "graphs reset": lambda eng: eng.step_graphs.reset(),
    "empty_cache": lambda eng: torch.cuda.empty_cache(),
    "layout": lambda eng: (eng.slots.set_layout(list(eng.jobs.values()), [0, 1, 2]), eng.slots.clear_layout()),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_what_a_capture_reads_changes_only_once_it_ended(model_dir, monkeypatch, change: str) -> None:  # noqa: ANN001, F811
    monkeypatch.setattr(graph_ahead, "NEXT", False)
    _, graphed = mixed_two_jobs(model_dir, 1)
    g = graphed.step_graphs
    release, empty = threading.Event(), torch.cuda.empty_cache
    order = _held(monkeypatch, release)
    assert graph_thread.begin(g, list(graphed.jobs.values()), graph_ahead._peek, graph_ahead._step_key) == 1
    flight = g.flight
    assert flight is not None and sys.getswitchinterval() == graph_thread.SWITCH_S
    assert torch.cuda.empty_cache is not empty and graphed.model.base_model._forward_pre_hooks
    timer = threading.Timer(0.2, lambda: (order.append("released"), release.set()))
    timer.start()
    try:
        CHANGES[change](graphed)
        order.append("changed")
    finally:
        release.set()
        timer.join()
    assert order == ["released", "captured", "changed"]  # the change waited for the capture's end
    assert g.flight is None and g.ahead["thread_made"] == 1 and sys.getswitchinterval() > graph_thread.SWITCH_S
    assert graphed.slots.guard is None and flight.entry.graph is not None
    assert torch.cuda.empty_cache is empty and not graphed.model.base_model._forward_pre_hooks  # put back


def test_only_the_thread_that_began_a_capture_waits_for_it(model_dir, monkeypatch) -> None:  # noqa: ANN001, F811
    monkeypatch.setattr(graph_ahead, "NEXT", False)
    _, graphed = mixed_two_jobs(model_dir, 1)
    g = graphed.step_graphs
    release = threading.Event()
    _held(monkeypatch, release)
    assert graph_thread.begin(g, list(graphed.jobs.values()), graph_ahead._peek, graph_ahead._step_key) == 1
    passed = []
    other = threading.Thread(target=lambda: (graph_thread.settle(g), passed.append(g.flight is not None)))
    other.start()
    other.join(2)
    assert passed == [True]  # another thread (the capture's own calls, autograd's) does not wait
    release.set()
    graph_thread.settle(g)
    assert g.flight is None


@pytest.mark.parametrize("how", ["raises", "no room"])
def test_a_capture_that_makes_nothing_leaves_its_key_to_its_step(model_dir, monkeypatch, how: str) -> None:  # noqa: ANN001, F811
    import trainer.step_graphs as sg

    monkeypatch.setattr(graph_ahead, "NEXT", False)
    _, graphed = mixed_two_jobs(model_dir, 1)
    g, states = graphed.step_graphs, list(graphed.jobs.values())
    key, on = _upcoming(g, states)
    failures, deferrals, captures = g.failures, g.deferrals, g.captures
    with monkeypatch.context() as m:
        if how == "raises":
            m.setattr(StepGraphs, "_run", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
            m.setattr(StepGraphs, "use_cuda_graphs", staticmethod(lambda device: False))
            m.setattr(sg, "_Replay", lambda body: body())  # the stand-in runs its body at capture: it raises
        else:
            m.setattr(sg, "capture_short", lambda device, need, pool, sync=True: "no room")
        assert graph_thread.begin(g, states, graph_ahead._peek, graph_ahead._step_key) == 1
        g.flight.done.wait(5)  # (the stand-in's failure is immediate)
    graphed.step()  # the next step files the finished capture first: nothing is left of it
    assert g.flight is None and g.ahead["thread_unmade"] == 1 and g.ahead["thread_made"] == 0
    assert (g.failures, g.deferrals) == (failures, deferrals)  # the thread's failure is not the step's
    assert (key in g.entries) == (on == 1)  # its entry went; the key's own step (this one if on == 1) makes another
    for _ in range(on - 1):
        graphed.step()
    # captured at its own step as before: once more (the thread's raised capture counted one, a deferral none)
    assert g.entries[key].graph is not None and g.captures == captures + (2 if how == "raises" else 1)


def test_a_capture_thread_that_cannot_start_leaves_nothing_waiting(model_dir, monkeypatch) -> None:  # noqa: ANN001, F811
    from contract.background import BackgroundWorker

    monkeypatch.setattr(graph_ahead, "NEXT", False)
    _, graphed = mixed_two_jobs(model_dir, 1)
    g, states = graphed.step_graphs, list(graphed.jobs.values())
    key, _ = _upcoming(g, states)
    switch, sync = sys.getswitchinterval(), torch.cuda.synchronize

    def refuse(self):  # noqa: ANN001, ANN202 - as threading does when no thread can be had
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(BackgroundWorker, "start", refuse)
    assert graph_thread.begin(g, states, graph_ahead._peek, graph_ahead._step_key) == 0
    assert g.flight is None and graphed.slots.guard is None and key not in g.entries
    assert sys.getswitchinterval() == switch and torch.cuda.synchronize is sync and g.ahead["thread_unmade"] == 1
    graphed.step()  # the steps go on as without it


def test_the_covers_the_steps_before_the_key_take_are_counted_then_given_back(model_dir, monkeypatch) -> None:  # noqa: ANN001, F811
    """With covers (capture_after 2), the key found several steps on is the one whose step captures it: the steps
    before it run covered, their covers counted as taken in the prediction (a key covered capture_after times is
    captured at its next step) and given back after it."""
    monkeypatch.setattr(graph_ahead, "NEXT", False)
    _, graphed = mixed_two_jobs(model_dir, 1)
    g = graphed.step_graphs
    g.capture_after = 2
    found = None
    for _ in range(6):  # until a key is found beyond the next step, behind covered steps
        graphed.step()
        before = dict(g.cover_uses)
        found = _upcoming(g, list(graphed.jobs.values()))
        assert dict(g.cover_uses) == before  # given back
        if found is not None and found[1] > 1:
            break
    assert found is not None and found[1] > 1, found
    key, on = found
    covered = g.covered
    for n in range(1, on + 1):
        captures = g.captures
        graphed.step()
        assert (g.captures == captures + 1) == (n == on), (n, on)  # only the key's own step captures
    assert g.entries[key].graph is not None and g.covered > covered  # steps before it ran covered


def test_no_prediction_releases_parked_states_whatever_hook_asks(model_dir, monkeypatch, tmp_path) -> None:  # noqa: ANN001, F811
    """The keys every predictor looks at (the thread's `upcoming`, the inline capture_next's and the capture ahead's
    `graph_ahead._step_key`) go through the memory plan's recompute and split rules, whose policy would send the
    parked states to the host for a step that then fits: a prediction releases nothing, through the plan's bound
    hooks or wrapped ones, and the step's own rule still does (session 60's first call: session 59's way of
    keeping the release out, an assignment to the frozen policy, failed every begin on the thread)."""
    monkeypatch.setattr(graph_thread, "ON", False)
    _, graphed = mixed_two_jobs(model_dir, 1)
    g, states = graphed.step_graphs, list(graphed.jobs.values())
    cfg = ExecutorConfig(model_dir=str(tmp_path), train_file="", output_dir=str(tmp_path), jobs=[])
    plan = MemoryPlan(cfg, graphed, torch.device("cpu"), Sft(), OneGpu(), lambda _n: contextlib.nullcontext(),
                      lambda _j: None)
    released: list[int] = []
    # no room for any step unless the (huge) spare bytes leave; releasing them makes room
    policy = RecomputePolicy(MemoryModel(0.0, 1.0), limit_bytes=1.0, seq_len=64, resident=lambda: 0.0,
                             spare=lambda: 1e12, release=lambda: released.append(1) is None)
    plan.recompute_policy = policy
    monkeypatch.setattr(admission, "MIN_PASS_TOKENS", 0)
    peek = graph_ahead._peek
    for hooks in ((plan.recompute_for, plan.split_for),
                  (lambda *a, **k: plan.recompute_for(*a, **k), lambda t: plan.split_for(t))):  # wrapped: no __self__
        monkeypatch.setattr(graphed, "recompute_for", hooks[0])
        monkeypatch.setattr(graphed, "split_for", hooks[1])
        released.clear()
        assert hooks[0](10, 1.0) is False and released == [1]  # a step's own rule releases them
        released.clear()
        _upcoming(g, states)
        per_job = [[graphed.train_examples[i] for i in peek(s.stream).next_indices(s.spec.batch_size)] for s in states]
        step = graph_ahead._step_key(g, states, graphed.slots.layout_offsets(states), per_job, graphed.cap_for(True))
        assert released == [] and plan.recompute_policy is policy
        assert step is None or step[0].recompute  # predicted to recompute (or split): it fits only after a release


def _main_captures(model_dir, monkeypatch, **knobs) -> tuple[list[int], dict, int]:  # noqa: ANN001, F811
    """mixed_two_jobs over 10 steps with the thread and capture_next on (graph_ahead's `knobs` set), the weights
    checked against the eager engine: the tokens of the keys captured on the main thread (at their step's start),
    the graphs' ahead counts and replays."""
    monkeypatch.setattr(graph_ahead, "NEXT", True)
    monkeypatch.setattr(graph_thread, "ON", True)
    for name, value in knobs.items():
        monkeypatch.setattr(graph_ahead, name, value)
    main: list[int] = []
    real = StepGraphs._capture

    def capture(self, entry, key, sync=True):  # noqa: ANN001, ANN202
        if threading.current_thread() is threading.main_thread():
            main.append(key.tokens)
        return real(self, entry, key, sync)

    monkeypatch.setattr(StepGraphs, "_capture", capture)
    eager, graphed = mixed_two_jobs(model_dir, 10)
    g = graphed.step_graphs
    graph_thread.settle(g)
    same_weights(eager, graphed)
    return list(main), dict(g.ahead), g.replays  # a copy: a later call wraps this wrapper


def test_a_capture_at_a_steps_start_takes_the_next_steps_key_and_the_thread_takes_over(model_dir, monkeypatch) -> None:  # noqa: ANN001, F811
    """graph_ahead.widen: where a step and the next would each capture their own key at their start (a set's first
    steps: no replay to hide a thread's capture behind), the first captures the next one's key (larger, within
    WIDEN_RATIO) and runs padded on it; the next replays it, and from there the thread captures ahead. The steps
    equal the eager engine's either way."""
    off, ahead_off, replays_off = _main_captures(model_dir, monkeypatch, WIDEN=False)
    on, ahead_on, replays_on = _main_captures(model_dir, monkeypatch, WIDEN=True)
    assert "widened" not in ahead_off and ahead_on["widened"] == 1
    assert len(off) >= 2 and off[1] > off[0]  # without it, the first two graphed steps captured at their start
    assert on == [off[1]]  # with it, one capture at a step's start: the second step's key
    assert replays_on == replays_off  # every graphed step replayed a capture
    assert ahead_on["thread_made"] > ahead_off["thread_made"]
    # the next step's key over WIDEN_RATIO times this one's tokens: each captures its own, as without
    capped, ahead_capped, _ = _main_captures(model_dir, monkeypatch, WIDEN=True, WIDEN_RATIO=1.0)
    assert capped == off and "widened" not in ahead_capped
