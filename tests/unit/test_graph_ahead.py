"""Unit: step graphs captured ahead of their steps (trainer.graph_ahead) on the CPU, where a capture is
its stand-in (the body replayed on the same static buffers): the keys a job set's next steps run come
from copies of its jobs' data streams (the jobs' own stay where they are), their captures serve those
steps (no capture at their first step, the same numbers as eager steps), and an evaluation calls its
`ahead` once, between its forwards' launch and their numbers, with the model in training mode."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

from tests.unit.test_step_graphs import (  # noqa: F401 - the fixtures
    _captures_inline,
    engine,
    examples,
    job,
    model_dir,
    same_steps,
)
from trainer import graph_ahead
from trainer.early_exit import keep_count
from trainer.step_graphs import TRANSIENT_SET_STEPS, StepGraphs

pytestmark = pytest.mark.usefixtures("one_thread")


def four_jobs(model_dir, d_rank: int = 8):  # noqa: ANN001, ANN201, F811
    """An eager and a graphed engine with the same four jobs (batches 1-3 of 24-token examples), one step each."""
    data = examples(64, 24)
    eager, graphed = engine(model_dir, False, data), engine(model_dir, True, data)
    for eng in (eager, graphed):
        for spec in (job("a", 4, 1, 1), job("b", 8, 2, 2), job("c", 4, 3, 3), job("d", d_rank, 1, 4)):
            eng.attach(spec)
        eng.step()  # the key class runs eagerly once (what a capture needs first)
    return eager, graphed


@pytest.mark.parametrize("d_rank", [8, 32])  # 32: the kept jobs' rank tile (16) is not the warm class's (32)
def test_the_next_steps_keys_come_from_copies_of_the_streams_and_their_captures_serve_those_steps(
        model_dir, d_rank: int) -> None:  # noqa: ANN001, F811
    eager, graphed = four_jobs(model_dir, d_rank)
    g = graphed.step_graphs
    kept = [graphed.jobs["b"], graphed.jobs["c"]]  # the set a ranking would keep
    positions = {j: dict(s.stream.state_dict()) for j, s in graphed.jobs.items()}
    keys = graph_ahead.coming_keys(g, [kept], steps=6)
    assert all((k.warm_class in g.warm) == (d_rank == 8) for k in keys)
    assert {j: s.stream.state_dict() for j, s in graphed.jobs.items()} == positions  # nothing moved
    assert sum(keys.values()) == 6 and all(k.tokens >= 5 * 24 for k in keys)  # b + c: 5 sequences a step
    captures, replays = g.captures, g.replays
    made = graph_ahead.capture_ahead(g, keys, busy=lambda: True)
    assert made == len(keys) >= 1 and g.ahead["made"] == made and g.captures == captures + made
    assert g.replays == replays  # captured, not run
    for eng in (eager, graphed):
        for j in ("a", "d"):
            eng.detach(j)
    same_steps(eager, graphed, 6)
    assert g.captures == captures + made and g.replays == replays + 6  # every step replayed a capture made ahead
    for j in ("b", "c"):
        torch.testing.assert_close(graphed.jobs[j].adapter.flat, eager.jobs[j].adapter.flat, rtol=1e-4, atol=1e-6)


def test_capture_ahead_stops_once_the_device_is_done_and_leaves_keys_of_a_cold_class(model_dir) -> None:  # noqa: ANN001, F811
    _, graphed = four_jobs(model_dir)
    g = graphed.step_graphs
    keys = graph_ahead.coming_keys(g, [[graphed.jobs["a"]], [graphed.jobs["c"]]], steps=4)
    assert len(keys) >= 2
    calls = []
    assert graph_ahead.capture_ahead(g, keys, busy=lambda: calls.append(1) is None and len(calls) <= 1) == 1
    assert g.ahead["late"] == 1 and g.ahead["keys"] == len(keys)
    cold = Counter({replace(k, max_len=2 * k.max_len): 1 for k in keys})  # a longest sequence no step ran yet
    assert graph_ahead.capture_ahead(g, cold, busy=lambda: True) == 0 and g.ahead["cold"] == len(cold)
    assert g.stats()["ahead"] == 1 and g.stats()["ahead_cold"] == len(cold)


def test_a_failed_capture_of_a_near_class_leaves_no_entry_and_stops_that_class(model_dir, monkeypatch) -> None:  # noqa: ANN001, F811
    _, graphed = four_jobs(model_dir, d_rank=32)
    g = graphed.step_graphs
    keys = graph_ahead.coming_keys(g, [[graphed.jobs["b"], graphed.jobs["c"]]], steps=6)
    near = Counter({replace(k, tokens=k.tokens + 16 * i): 1 for i, k in enumerate(list(keys) * 3)})
    assert len(near) >= 3 and all(k.warm_class not in g.warm for k in near)  # rank tile 16; warm: 32
    tried = []

    def failing(entry, key, sync=True):  # noqa: ANN001, ANN202 - as a capture that synced inside (a tuning form)
        tried.append(key)
        entry.failed = True
        return None

    monkeypatch.setattr(g, "_capture", failing)
    entries = dict(g.entries)
    assert graph_ahead.capture_ahead(g, near, busy=lambda: True) == 0
    assert len(tried) == 1 and g.ahead["unmade"] == 1 and g.ahead["cold"] == len(near) - 1
    assert dict(g.entries) == entries and tried[0].warm_class not in g.warm  # nothing left behind


def test_held_out_sequences_longer_than_every_training_one_leave_the_steps_keys_warm(model_dir) -> None:  # noqa: ANN001, F811
    """An evaluation grows its own longest length (engine.eval_cap), not the training steps' (seq_cap): on
    session 55's device runs every key a capture ahead counted had the held-out set's longest length, a class
    no step ran (all cold), and the first step after each ranking ran eagerly."""
    eager, graphed = four_jobs(model_dir)
    g, cap = graphed.step_graphs, graphed.seq_cap
    kept = [graphed.jobs["b"], graphed.jobs["c"]]
    warm = set(g.warm)
    for eng in (eager, graphed):
        numbers = eng.evaluate_metrics(examples(12, 2 * cap, seed=5), batch_size=4)  # eager and replayed
        assert eng.seq_cap == cap and eng.eval_cap == eng.cap_for(False) == 2 * cap
        assert all(math.isfinite(m["loss"]) for m in numbers.values())
    assert any(w[2] == 2 * cap and not w[5] for w in g.warm - warm)  # the evaluation's own class, its length
    keys = graph_ahead.coming_keys(g, [kept], steps=4)
    assert keys and all(k.max_len == cap and k.warm_class in g.warm for k in keys)
    assert graph_ahead.capture_ahead(g, keys, busy=lambda: True) == len(keys) and g.ahead["cold"] == 0
    graphed.evaluate_metrics(examples(12, 3 * cap, seed=6), batch_size=4)
    assert graphed.eval_cap == 3 * cap and graphed.cap_for(True) == cap  # training's is its own


def _mixed_lengths() -> list:
    """Examples of three lengths, interleaved: a job's steps then run keys of several token counts."""
    parts = [examples(24, n, seed=n) for n in (16, 40, 72)]
    return [e for trio in zip(*parts, strict=True) for e in trio]


def mixed_two_jobs(model_dir, steps: int):  # noqa: ANN001, ANN202, F811
    """An eager and a graphed engine with the same two jobs over examples of three lengths (a key per token count:
    capture_after 0, a key is captured at its first step, never covered), `steps` steps of both (the same numbers
    checked). The engine's capture limits: the tiny model's."""
    data = _mixed_lengths()
    eager, graphed = engine(model_dir, False, data), engine(model_dir, True, data)
    graphed.step_graphs.capture_after = 0
    for eng in (eager, graphed):
        for spec in (job("a", 8, 2, 1), job("b", 16, 3, 2)):
            eng.attach(spec)
    same_steps(eager, graphed, steps)
    return eager, graphed


def same_weights(eager, graphed) -> None:  # noqa: ANN001
    for j in graphed.jobs:
        torch.testing.assert_close(graphed.jobs[j].adapter.flat, eager.jobs[j].adapter.flat, rtol=1e-4, atol=1e-6)


def _steps_with_next(model_dir, monkeypatch, on: bool, n: int):  # noqa: ANN001, ANN202, F811
    """mixed_two_jobs with capture_next on or off, the weights checked: the graphed engine's step graphs."""
    monkeypatch.setattr(graph_ahead, "NEXT", on)
    eager, graphed = mixed_two_jobs(model_dir, n)
    same_weights(eager, graphed)
    return graphed.step_graphs


def test_the_next_steps_capture_runs_during_this_step_and_serves_that_step(model_dir, monkeypatch) -> None:  # noqa: ANN001, F811
    """LORAPLEX_CAPTURE_NEXT: a step's new key is captured during the step before it (between its queued
    backward and its sync), not at its own start; the same keys are captured in all, and the steps equal
    eager steps."""
    calls = []
    real_next = graph_ahead.capture_next
    monkeypatch.setattr(graph_ahead, "capture_next", lambda g, states: calls.append(g.last_replayed) or real_next(g, states))
    off = _steps_with_next(model_dir, monkeypatch, False, 12)
    assert calls == [] and off.ahead["next_made"] == 0
    at_start: list[bool] = []
    real_capture = StepGraphs._capture

    def capture(self, entry, key, sync=True):  # noqa: ANN001, ANN202 - which captures ran at a step's start
        at_start.append(sync)
        return real_capture(self, entry, key, sync)

    monkeypatch.setattr(StepGraphs, "_capture", capture)
    on = _steps_with_next(model_dir, monkeypatch, True, 12)
    made = on.ahead["next_made"]
    # offered at every graphed step; tried only after a replayed step (whose memory no step's peak observes)
    # and where the next step would capture
    assert len(calls) == 12 and made >= 2 and on.ahead["next_calls"] == made <= calls.count(True)
    assert at_start.count(False) == made and at_start.count(True) == on.captures - made
    # the same keys as without, and at most one more: the 13th step's, which these 12 steps did not reach
    assert set(off.entries) <= set(on.entries) and on.captures - off.captures == len(on.entries) - len(off.entries) <= 1
    assert on.captures - made < off.captures  # fewer captures at a step's start
    assert on.replays == off.replays == 11 and on.eager_runs == off.eager_runs == 1


def test_no_next_capture_where_the_set_changes_or_a_job_ends(model_dir, monkeypatch) -> None:  # noqa: ANN001, F811
    monkeypatch.setattr(graph_ahead, "NEXT", False)
    _, graphed = four_jobs(model_dir)
    g = graphed.step_graphs
    states = [graphed.jobs["b"], graphed.jobs["c"]]
    captures, step = g.captures, states[0].step
    g.capture_after = 0  # no cover: the next key would be captured
    g.last_replayed = False  # this step's memory is observed: no capture beside it
    assert graph_ahead.capture_next(g, states) == 0
    g.last_replayed = True
    g.set_lasts = lambda: 1  # the set changes after this step (a job's end, a ranking)
    assert graph_ahead.capture_next(g, states) == 0
    with monkeypatch.context() as m:  # a key the next step would find transient (its set's last steps)
        m.setattr("trainer.step_graphs.TRANSIENT_MIN_TOKENS", 0)
        g.set_lasts = lambda: TRANSIENT_SET_STEPS  # not transient at this step; at the next, one step fewer
        assert not g._transient(graph_ahead.coming_keys(g, [states], steps=1).most_common(1)[0][0])
        assert graph_ahead.capture_next(g, states) == 0
    g.set_lasts = lambda: 5
    states[0].step = states[0].total_steps - 1  # its last step
    assert graph_ahead.capture_next(g, states) == 0
    assert g.ahead["next_calls"] == 0 and g.captures == captures  # nothing tried
    states[0].step = step
    assert graph_ahead.capture_next(g, states) == 1 and g.captures == captures + 1  # the set goes on: captured
    assert graph_ahead.capture_next(g, states) == 0 and g.ahead["next_calls"] == 1  # and only once


def test_a_peek_reads_the_next_batches_without_moving_or_copying_the_order() -> None:
    """capture_next peeks every job's stream at every replayed step: the copy gives the job's next batches
    (across an epoch's end too), leaves the job's stream where it was and shares its order list, inside a
    co-located task's TaskStream as well."""
    from trainer.data import JobDataStream
    from trainer.task_parts import TaskStream

    stream = JobDataStream(n=10, seed=3)
    stream.next_indices(7)
    wrapped = TaskStream(JobDataStream(n=10, seed=3), base=100)
    wrapped.next_indices(7)
    for s, inner in ((stream, stream), (wrapped, wrapped.inner)):
        before = inner.state_dict()
        peek = graph_ahead._peek(s)
        got = [peek.next_indices(2), peek.next_indices(4)]  # the second crosses into the next epoch
        assert inner.state_dict() == before  # the job's stream did not move
        assert got == [s.next_indices(2), s.next_indices(4)]  # the job's next batches, as peeked
    fresh = JobDataStream(n=100_000, seed=1)
    fresh.next_indices(1)
    peek = graph_ahead._peek(TaskStream(fresh, base=0))
    assert peek.inner is not fresh and peek.inner._order is fresh._order  # no copy of the 100k-example order


def test_a_next_capture_short_of_room_leaves_the_key_to_its_step_uncounted(model_dir, monkeypatch) -> None:  # noqa: ANN001, F811
    """A next-step capture the device lacks room for is left (`next_unmade`): no deferral counted, no wait
    set, so the key's own step asks again and defers as it would have without the next-step capture."""
    import trainer.step_graphs as sg

    monkeypatch.setattr(graph_ahead, "NEXT", False)  # the calls below are made here
    monkeypatch.setattr(sg, "capture_short", lambda device, need, pool, sync=True: "no room")
    _, graphed = four_jobs(model_dir)
    g = graphed.step_graphs
    for j in ("a", "d"):
        graphed.detach(j)
    states = list(graphed.jobs.values())
    g.capture_after, g.last_replayed, g.set_lasts = 0, True, (lambda: 5)
    deferrals, captures = g.deferrals, g.captures
    assert graph_ahead.capture_next(g, states) == 0
    assert g.ahead["next_unmade"] == 1 and (g.deferrals, g.captures) == (deferrals, captures)
    assert all(e.deferred == -1 and not e.failed for e in g.entries.values())
    graphed.step()  # the key's own step: deferred there, and run eagerly
    assert (g.deferrals, g.captures) == (deferrals + 1, captures)


def test_a_class_near_a_warm_one_differs_only_in_the_lora_kernels_constants() -> None:
    from trainer.graph_parts import GraphKey

    key = GraphKey(tokens=1536, seq_slots=16, job_slots=8, rank=64, max_len=1024, aligned=True, recompute=False)
    warm = {key.warm_class}
    assert graph_ahead.near_warm(warm, replace(key, tokens=896, rank=32, aligned=False))
    for other in (replace(key, job_slots=16), replace(key, max_len=2048), replace(key, recompute=True),
                  replace(key, train=False)):
        assert not graph_ahead.near_warm(warm, other), other


def test_the_sets_a_ranking_may_keep(model_dir) -> None:  # noqa: ANN001, F811
    _, graphed = four_jobs(model_dir)
    sets = graph_ahead.ranking_sets(graphed, ["a", "b", "c"], [], 3, 0.5)  # d, outside the ranking, trains on
    assert keep_count(3, 0.5) == 2
    assert [sorted(s.job_id for s in one) for one in sets] == [["a", "b", "d"], ["a", "c", "d"], ["b", "c", "d"]]
    # one that reported before this evaluation is a choice too; a job of another task (attached) always trains
    sets = graph_ahead.ranking_sets(graphed, ["a", "b"], ["c"], 4, 0.25)
    assert [sorted(s.job_id for s in one) for one in sets] == [["a", "d"], ["b", "d"], ["c", "d"]]
    # stage 2 of a staged ranking: d, evicted on its lead count, is in no set; 2 of a, b, c are kept
    sets = graph_ahead.ranking_sets(graphed, ["a", "b", "c"], [], 4, 0.5, out=["d"])
    assert [sorted(s.job_id for s in one) for one in sets] == [["a", "b"], ["a", "c"], ["b", "c"]]


def test_a_steps_key_from_its_lengths_alone_is_the_packed_steps_key(model_dir) -> None:  # noqa: ANN001, F811
    import random

    from trainer.graph_parts import lengths_key, step_key

    _, graphed = four_jobs(model_dir)
    rng = random.Random(3)
    for trial in range(60):
        states = rng.sample(list(graphed.jobs.values()), rng.randint(1, 4))
        per_job = [examples(rng.randint(1, 4), rng.choice([3, 24, 40, 97]), seed=trial) for _ in states]
        cap = rng.choice([1, 24, 64, 200])
        key, cpu, ints = step_key(graphed, 16, states, per_job, True, cap)
        lengths = [len(e.input_ids) for seqs in per_job for e in seqs]
        assert lengths_key(graphed, 16, states, ints, lengths, True, cap) == key, (trial, key)
        assert key.seq_slots >= len(cpu.cu_seqlens) - 1 and key.tokens == cpu.input_ids.shape[1] >= sum(lengths)


def test_a_copied_stream_of_a_colocated_task_reads_at_its_base() -> None:
    from trainer.data import JobDataStream
    from trainer.task_parts import TaskStream

    stream = TaskStream(JobDataStream(10, 3), 100)
    stream.next_indices(4)
    copy = graph_ahead._peek(stream)
    assert copy.next_indices(6) == stream.next_indices(6) and min(copy.next_indices(3)) >= 100


def test_an_evaluation_calls_ahead_once_between_its_forwards_and_their_numbers(model_dir) -> None:  # noqa: ANN001, F811
    _, graphed = four_jobs(model_dir)
    held_out = examples(8, 24, seed=7)
    want = graphed.evaluate_metrics(held_out, batch_size=4)
    seen = []
    training = graphed.model.training
    graphed.evaluation.ahead = lambda busy: seen.append((graphed.model.training, torch.is_grad_enabled(), busy()))
    got = graphed.evaluate_metrics(held_out, batch_size=4, max_sequences=4)  # two groups of jobs
    assert seen == [(True, True, True)] and graphed.evaluation.ahead is None
    assert graphed.model.training == training
    for j, m in want.items():
        assert math.isclose(got[j]["loss"], m["loss"], rel_tol=1e-5), j


def test_a_ranking_evaluation_captures_what_the_sets_it_may_keep_will_run(model_dir, monkeypatch) -> None:  # noqa: ANN001, F811
    from types import SimpleNamespace

    from trainer import task_eval
    from trainer.early_exit import WarmupRanking

    _, graphed = four_jobs(model_dir)
    g = graphed.step_graphs
    held_out = examples(8, 24, seed=7)

    def fake(queue: list, ranked: list[str]) -> SimpleNamespace:
        return SimpleNamespace(executor=SimpleNamespace(engine=graphed, world=1), queue=queue, placed=dict.fromkeys("abcd"),
                               ranking=WarmupRanking(ranked, keep_fraction=0.5))

    monkeypatch.setattr(graph_ahead, "ON", False)
    task_eval.ahead(fake([], list("abcd")), list("abcd"))
    assert graphed.evaluation.ahead is None  # off unless LORAPLEX_CAPTURE_AHEAD=1
    monkeypatch.setattr(graph_ahead, "ON", True)
    task_eval.ahead(fake(["queued"], list("abcd")), list("abcd"))  # a queued configuration joins after it
    task_eval.ahead(fake([], list("abcd")), list("abc"))  # the ranking still waits for d
    assert graphed.evaluation.ahead is None
    task_eval.ahead(fake([], list("abcd")), list("abc"), out=["d"])  # stage 2: d evicted on its lead count
    assert graphed.evaluation.ahead is not None
    graphed.evaluation.ahead = None
    task_eval.ahead(fake([], list("abcd")), list("abcd"))
    assert graphed.evaluation.ahead is not None
    graphed.evaluate_metrics(held_out, batch_size=4)
    assert g.ahead["made"] >= 2 and graphed.evaluation.ahead is None  # the 6 pairs' keys (4-8 sequences a step)
    captures = g.captures
    for j in ("a", "d"):  # the ranking kept b and c
        graphed.detach(j)
    for _ in range(4):
        graphed.step()
    assert g.captures == captures  # their steps replayed captures made ahead


def test_ahead_is_offered_once_the_first_backbone_is_queued_before_its_head(model_dir, monkeypatch) -> None:  # noqa: ANN001, F811
    import trainer.engine as engine_module

    _, graphed = four_jobs(model_dir)
    held_out = examples(8, 24, seed=7)
    want = graphed.evaluate_metrics(held_out, batch_size=4)
    order: list[str] = []
    hidden, head = graphed.hidden, engine_module.token_losses_and_hits
    monkeypatch.setattr(graphed.step_graphs, "serves", lambda states: False)  # eager forwards (an arena copy's)
    monkeypatch.setattr(graphed, "hidden", lambda batch: order.append("backbone") or hidden(batch))
    monkeypatch.setattr(engine_module, "token_losses_and_hits", lambda *a: order.append("head") or head(*a))
    graphed.evaluation.ahead = lambda busy: order.append("ahead")
    got = graphed.evaluate_metrics(held_out, batch_size=4)  # 4 jobs x 2 chunks: 2 forwards
    assert order == ["backbone", "ahead", "head", "backbone", "head"] and graphed.evaluation.ahead is None
    for j, m in want.items():
        assert math.isclose(got[j]["loss"], m["loss"], rel_tol=1e-5), j


def test_a_failing_ahead_leaves_the_evaluation_and_its_numbers_alone(model_dir) -> None:  # noqa: ANN001, F811
    _, graphed = four_jobs(model_dir)
    held_out = examples(8, 24, seed=7)
    want = graphed.evaluate_metrics(held_out, batch_size=4)

    def broken(busy):  # noqa: ANN001, ANN202
        raise RuntimeError("no capture today")

    graphed.evaluation.ahead = broken
    got = graphed.evaluate_metrics(held_out, batch_size=4)
    assert got == want and graphed.evaluation.ahead is None


def test_a_large_ranking_lists_at_most_max_sets_sets(model_dir, monkeypatch) -> None:  # noqa: ANN001, F811
    _, graphed = four_jobs(model_dir)
    many = [f"x{k}" for k in range(40)]  # not attached (another rank's): only the attached are choices
    sets = graph_ahead.ranking_sets(graphed, list("abcd") + many, [], 48, 0.25)
    assert len(sets) == 1 and sorted(s.job_id for s in sets[0]) == list("abcd")  # 12 kept of 48: the 4 attached
    assert len(graph_ahead.ranking_sets(graphed, list("abcd"), [], 8, 0.25)) == 6  # 2 of the 4
    monkeypatch.setattr(graph_ahead, "MAX_SETS", 3)
    sets = graph_ahead.ranking_sets(graphed, list("cabd"), [], 8, 0.25)  # the likely kept first (lead order)
    assert [sorted(s.job_id for s in one) for one in sets] == [["a", "c"], ["b", "c"], ["c", "d"]]


def test_the_engine_loads_the_evaluations_kernels_when_built_and_a_failure_only_logs(model_dir, monkeypatch,  # noqa: ANN001, F811
                                                                                    caplog) -> None:  # noqa: ANN001
    """Evaluation._load_kernels (trainer.head.load_hits_kernel: a no-op off CUDA) runs at the engine's construction
    with its device and compute dtype; a kernel that cannot load leaves the engine built (the first evaluation
    loads its own)."""
    import logging

    from trainer import evaluation

    seen = []
    monkeypatch.setattr(evaluation, "load_hits_kernel", lambda device, dtype: seen.append((device.type, dtype)))
    eng = engine(model_dir, True, examples(8, 24))
    assert seen == [("cpu", eng.compute_dtype)]

    def broken(device, dtype):  # noqa: ANN001, ANN202
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(evaluation, "load_hits_kernel", broken)
    with caplog.at_level(logging.WARNING, logger=evaluation.log.name):
        eng = engine(model_dir, True, examples(8, 24))
    assert eng.evaluation is not None and "no kernel here" in caplog.text
