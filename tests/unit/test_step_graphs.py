"""Unit: the graphed training step (trainer.step_graphs) on the CPU, where its stand-in replays
the same body on the same static buffers: it equals the engine's eager step, a change of the job
set reuses the capture of its shape, and a job with non-finite values is isolated as in eager
steps. The CUDA graph itself is checked on a device (tests/gpu/test_step_graphs_gpu.py)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.engine_ref import tiny_model_dir
from trainer import graph_ahead, graph_parts, graph_thread
from trainer.data import IGNORE, Example
from trainer.engine import MultiLoraEngine
from trainer.jobs import TrainJob
from trainer.step_graphs import CAPTURE_PADDING

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _captures_inline(monkeypatch) -> None:  # noqa: ANN001 - the step-start and capture_next rules alone
    """These rules' counts are of captures made inline; the capture on a thread (on by default) changes
    when and which keys are made, and is checked with the thread on in test_graph_thread.py."""
    monkeypatch.setattr(graph_thread, "ON", False)


def examples(n: int, length: int, seed: int = 0) -> list[Example]:
    """Examples of one length (a step's token count then follows its batch sizes alone), the
    first third of each a prompt (no target)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 250, (length,), generator=g).tolist()
        cut = length // 3
        out.append(Example(tuple(ids), tuple([IGNORE] * cut + ids[cut:])))
    return out


def engine(model_dir, graphs: bool, data: list[Example]) -> MultiLoraEngine:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return MultiLoraEngine(model, data, 0, gradient_checkpointing=True, attention="varlen",
                           step_graphs=graphs)


def job(name: str, rank: int, batch: int, seed: int, lr: float = 5e-3) -> TrainJob:
    return TrainJob(name, lora_rank=rank, lora_alpha=2.0 * rank, learning_rate=lr, batch_size=batch,
                    max_steps=100, warmup_steps=1, seed=seed, max_grad_norm=0.05)


def same_evaluations(eager: MultiLoraEngine, graphed: MultiLoraEngine, specs: list[TrainJob],
                     held_out: list[Example], rel: float, accuracy_abs: float) -> None:
    """Both engines get the jobs and one step, then evaluate twice (the second replays what the
    first captured): the same loss and token accuracy for every job."""
    for eng in (eager, graphed):
        for spec in specs:
            eng.attach(spec)
        eng.step()
    for _ in range(2):
        want = eager.evaluate_metrics(held_out, batch_size=4)
        got = graphed.evaluate_metrics(held_out, batch_size=4)
        for j, metrics in want.items():
            assert math.isclose(got[j]["loss"], metrics["loss"], rel_tol=rel), (j, got, want)
            assert abs(got[j]["token_accuracy"] - metrics["token_accuracy"]) <= accuracy_abs, (j, got, want)


def two_jobs(model_dir) -> tuple[MultiLoraEngine, MultiLoraEngine]:  # noqa: ANN001
    """An eager and a graphed engine, each with the same two jobs of 3 sequences a step (144 tokens)."""
    data = examples(48, 24)
    eager, graphed = engine(model_dir, False, data), engine(model_dir, True, data)
    for eng in (eager, graphed):
        for spec in (job("a", 4, 3, 1), job("b", 8, 3, 2)):
            eng.attach(spec)
    return eager, graphed


def same_steps(eager: MultiLoraEngine, graphed: MultiLoraEngine, n: int) -> None:
    """n steps of both engines: the same losses and gradient norms."""
    for _ in range(n):
        want, got = eager.step(), graphed.step()
        for j in want.losses:
            assert math.isclose(got.losses[j], want.losses[j], rel_tol=2e-5), j
            assert math.isclose(got.grad_norms[j], want.grad_norms[j], rel_tol=1e-4), j


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN201
    return tiny_model_dir("llama", tmp_path_factory.mktemp("graphs"))


def test_graphed_steps_equal_eager_steps_and_a_new_job_set_reuses_the_capture(model_dir) -> None:  # noqa: ANN001
    data = examples(48, 24)
    eager, graphed = engine(model_dir, False, data), engine(model_dir, True, data)
    assert eager.step_graphs is None and graphed.step_graphs is not None
    first = [job("a", 4, 2, 1), job("b", 8, 2, 2), job("c", 16, 2, 3)]
    for eng in (eager, graphed):
        for spec in first:
            eng.attach(spec)

    def both_steps(n: int) -> None:
        for _ in range(n):
            want, got = eager.step(), graphed.step()
            assert got.skipped == want.skipped
            for j in want.losses:
                assert math.isclose(got.losses[j], want.losses[j], rel_tol=2e-5), j
                assert math.isclose(got.grad_norms[j], want.grad_norms[j], rel_tol=1e-4), j

    both_steps(4)
    g = graphed.step_graphs
    # one shape: run eagerly once, captured at its second step, replayed after
    assert (g.eager_runs, g.captures, g.replays, len(g.entries)) == (1, 1, 3, 1)
    # a job leaves and another (another rank and learning rate) takes its slot: the same capture
    for eng in (eager, graphed):
        eng.detach("b")
        eng.attach(job("d", 2, 2, 4, lr=1e-2))
    both_steps(3)
    assert (g.captures, g.replays, len(g.entries)) == (1, 6, 1)
    # clipping was active (max_grad_norm 0.05) and every weight agrees after the updates
    for j in ("a", "c", "d"):
        torch.testing.assert_close(graphed.jobs[j].adapter.flat, eager.jobs[j].adapter.flat,
                                   rtol=1e-4, atol=1e-6)
    # a step of another token count (a job with a larger batch) is another key of the same class:
    # captured at its first step, no eager run
    for eng in (eager, graphed):
        eng.detach("d")
        eng.attach(job("e", 8, 3, 5))
    both_steps(2)
    assert (g.eager_runs, g.captures, g.replays, len(g.entries)) == (1, 2, 8, 2)
    # fewer tokens (120, a key of its own) replay the smallest capture that holds them padded
    # (160 tokens, within cover_ratio 1.4): no capture, the same losses, the padding trains nothing
    # (cover_tokens 0: the ratio alone; the absolute allowance has its own test below)
    g.cover_ratio, g.cover_tokens = 1.4, 0
    for eng in (eager, graphed):
        eng.detach("e")
        eng.attach(job("f", 4, 1, 6))
    both_steps(2)
    assert (g.eager_runs, g.captures, g.replays, g.covered, len(g.entries)) == (1, 2, 10, 2, 2)
    # ... but not beyond cover_ratio: a step of a third of the tokens gets its own capture
    for eng in (eager, graphed):
        for j in ("a", "c"):
            eng.detach(j)
    both_steps(1)
    assert (g.captures, g.covered) == (3, 2)


@pytest.mark.parametrize("free", [False, True])
def test_a_graphs_padding_tail_owned_by_no_job_trains_and_evaluates_as_eager_steps(model_dir, monkeypatch, free) -> None:  # noqa: ANN001
    """LORAPLEX_FREE_PADDING=1: the graph's device offsets end at the step's real tokens, so its
    padding tail belongs to no job (the LoRA passes skip its rows; the reference gives them the base
    output). Steps, updates and evaluations equal the eager engine's either way."""
    monkeypatch.setattr(graph_parts, "FREE_PADDING", free)
    data = [e for pair in zip(examples(24, 24), examples(24, 10, seed=1), strict=True) for e in pair]
    eager, graphed = engine(model_dir, False, data), engine(model_dir, True, data)
    for eng in (eager, graphed):
        for spec in (job("a", 4, 3, 1), job("b", 8, 3, 2)):
            eng.attach(spec)
    rows = []  # each step's real tokens, its row's and the job offsets its graph read
    fill = graphed.step_graphs._fill

    def filled(st, key, cpu, *a):  # noqa: ANN001, ANN002, ANN202
        counts = fill(st, key, cpu, *a)
        rows.append((cpu.real_tokens, key.tokens, st.offsets.tolist()))
        return counts

    monkeypatch.setattr(graphed.step_graphs, "_fill", filled)
    same_steps(eager, graphed, 4)
    assert any(n < t for n, t, _ in rows)  # padded rows
    for n, t, offsets in rows:  # the last job's end and the empty slots': the real tokens, or the row's
        assert offsets[2:] == [n if free else t] * (len(offsets) - 2)
    for j in graphed.jobs:
        torch.testing.assert_close(graphed.jobs[j].adapter.flat, eager.jobs[j].adapter.flat, rtol=1e-4, atol=1e-6)
    held_out = examples(7, 20, seed=9) + examples(3, 12, seed=10)
    for _ in range(2):  # the second evaluation replays the first one's captures
        want, got = eager.evaluate_metrics(held_out, batch_size=4), graphed.evaluate_metrics(held_out, batch_size=4)
        for j, metrics in want.items():
            assert math.isclose(got[j]["loss"], metrics["loss"], rel_tol=1e-5), (j, got, want)
    assert any(k.tokens > sum(len(e.input_ids) for e in held_out[:4]) for k in graphed.step_graphs.entries
               if not k.train)  # an evaluation row was padded too


@pytest.mark.parametrize("ahead", [False, True])
def test_small_steps_replay_a_capture_a_few_hundred_tokens_larger_until_their_key_keeps_coming(
        model_dir, monkeypatch, ahead: bool) -> None:  # noqa: ANN001
    """A step of a new key replays a captured one of up to cover_tokens more tokens (far beyond
    cover_ratio) with the eager step's numbers; once its key has been covered capture_after
    times, its next step captures it, and later ones replay that capture. With the next step's
    capture (graph_ahead.NEXT, the default) that capture runs during the last covered step instead."""
    monkeypatch.setattr(graph_ahead, "NEXT", ahead)
    eager, graphed = two_jobs(model_dir)

    def both_steps(n: int) -> None:
        same_steps(eager, graphed, n)

    g = graphed.step_graphs
    g.cover_ratio, g.cover_tokens, g.capture_after = 1.19, 200, 2
    both_steps(2)  # 144 tokens: one eager run, then its capture
    assert (g.eager_runs, g.captures, g.covered) == (1, 1, 0)
    for eng in (eager, graphed):
        eng.detach("b")
    # 72 tokens: half the capture's (over cover_ratio, within cover_tokens): covered twice ...
    both_steps(2)
    # (ahead: the second covered step captured the key its next step would capture)
    assert (g.captures, g.covered, len(g.entries), g.ahead["next_made"]) == (1 + ahead, 2, 1 + ahead, ahead)
    # ... then captured (the key keeps coming), and replayed from then on
    both_steps(2)
    assert (g.captures, g.covered, g.replays, len(g.entries)) == (2, 2, 5, 2)
    for j in graphed.jobs:
        torch.testing.assert_close(graphed.jobs[j].adapter.flat, eager.jobs[j].adapter.flat, rtol=1e-4, atol=1e-6)


def test_graphed_evaluation_equals_eager_evaluation(model_dir) -> None:  # noqa: ANN001
    data = examples(24, 20, seed=3)
    held_out = examples(7, 20, seed=9) + examples(3, 12, seed=10)
    eager, graphed = engine(model_dir, False, data), engine(model_dir, True, data)
    graphed.step_graphs.cover_tokens = 0  # every chunk's key its own capture (not the larger one's, padded)
    same_evaluations(eager, graphed, [job("a", 4, 2, 1), job("b", 16, 1, 2)], held_out, 1e-5, 1e-9)
    g = graphed.step_graphs
    # chunks of 4, 4 and 2 examples, the first two of one token bucket: the first chunk ran eagerly
    # (its class cold; the training step is the other eager run), the second captured its key, the
    # third its own; the second evaluation replays all three chunks
    eval_keys = [k for k in g.entries if not k.train]
    assert len(eval_keys) == 2 and g.eager_runs == 2 and g.captures == 2 and g.replays == 2 + 3


def test_evaluation_forwards_above_their_capture_limit_run_eagerly(model_dir) -> None:  # noqa: ANN001
    """Evaluation forwards of more tokens than max_eval_capture_tokens run eagerly every time (no
    capture, no pool) with the eager engine's numbers; the smaller chunk is still captured and
    replayed."""
    data = examples(24, 20, seed=3)
    held_out = examples(8, 20, seed=9) + examples(2, 12, seed=10)
    eager, graphed = engine(model_dir, False, data), engine(model_dir, True, data)
    g = graphed.step_graphs
    g.max_eval_capture_tokens = 100  # chunks of 4 x 20 tokens x 2 jobs: over; 2 x 12 x 2: under
    same_evaluations(eager, graphed, [job("a", 4, 2, 1), job("b", 16, 1, 2)], held_out, 1e-5, 1e-9)
    eval_keys = [k for k in g.entries if not k.train]
    # eager: the training step and the two large chunks of each evaluation; the small chunk (its
    # class warmed by the large ones) captured at the first and replayed at both
    assert [k.tokens > 100 for k in eval_keys] == [True, False]
    assert (g.eager_runs, g.captures, g.replays) == (1 + 4, 1, 2)


def test_a_non_finite_job_skips_alone_in_a_graphed_step(model_dir) -> None:  # noqa: ANN001
    data = examples(32, 20, seed=5)
    eager, graphed = engine(model_dir, False, data), engine(model_dir, True, data)
    for eng in (eager, graphed):
        eng.attach(job("ok", 8, 2, 1))
        eng.attach(job("bad", 8, 1, 2))
        with torch.no_grad():
            eng.jobs["bad"].adapter.flat[:100] = float("nan")
    for _ in range(3):
        want, got = eager.step(), graphed.step()
        assert got.skipped == want.skipped == {"ok": False, "bad": True}
        assert math.isclose(got.losses["ok"], want.losses["ok"], rel_tol=2e-5)
        assert not math.isfinite(got.losses["bad"])
    torch.testing.assert_close(graphed.jobs["ok"].adapter.flat, eager.jobs["ok"].adapter.flat,
                               rtol=1e-4, atol=1e-6)
    assert graphed.step_graphs.captures == 1


def test_the_arena_growing_drops_the_captures(model_dir) -> None:  # noqa: ANN001
    graphed = engine(model_dir, True, examples(16, 16, seed=7))
    graphed.attach(job("a", 4, 2, 1))
    graphed.step()
    graphed.step()
    g = graphed.step_graphs
    assert g.captures == 1 and len(g.entries) == 1
    graphed.attach(job("big", 64, 2, 2))  # grows the arena: a new storage
    graphed.step()
    assert len(g.entries) == 1 and g.eager_runs == 2  # the old capture dropped, the new key eager


def test_keys_above_the_capture_limit_run_eagerly_and_equal_eager_steps(model_dir) -> None:  # noqa: ANN001
    """A step of more tokens than max_capture_tokens (GPU-bound on a device: nothing to gain, its
    activations would stay in the graphs' pool) runs eagerly on the static buffers every time;
    a smaller one of the same class is still captured and replayed."""
    data = examples(48, 24)
    eager, graphed = engine(model_dir, False, data), engine(model_dir, True, data)
    g = graphed.step_graphs
    g.max_capture_tokens = 100  # a batch of 2 x 24 tokens: under; 6 x 24: over
    for eng in (eager, graphed):
        eng.attach(job("a", 4, 2, 1))
        eng.attach(job("b", 8, 4, 2))
    for _ in range(3):
        want, got = eager.step(), graphed.step()
        for j in want.losses:
            assert math.isclose(got.losses[j], want.losses[j], rel_tol=2e-5), j
    assert (g.eager_runs, g.captures, g.replays) == (3, 0, 0) and not g.last_replayed
    for eng in (eager, graphed):
        eng.detach("b")
    for _ in range(3):
        want, got = eager.step(), graphed.step()
        assert math.isclose(got.losses["a"], want.losses["a"], rel_tol=2e-5)
    assert (g.eager_runs, g.captures, g.replays) == (3, 1, 3) and g.last_replayed
    torch.testing.assert_close(graphed.jobs["a"].adapter.flat, eager.jobs["a"].adapter.flat, rtol=1e-4, atol=1e-6)


def test_a_graphed_step_decides_recompute_from_the_row_it_runs(model_dir) -> None:  # noqa: ANN001
    """The memory plan's hook is asked about the row the graphed step runs, with no padding
    allowance for an eager run (padding=1.0) and the policy's for a capture (its activations stay
    in the pool): a row that fits runs without recompute, one that does not with it;
    a step that a capture without recompute replays (a larger key's, padded) runs without it
    whatever the room (a replay allocates nothing: its memory is the pool's); a None answer (no
    policy) keeps the setting. Every step's numbers equal the eager engine's."""
    data = examples(48, 24)
    eager, graphed = engine(model_dir, False, data), engine(model_dir, True, data)
    g = graphed.step_graphs
    g.cover_ratio, g.cover_tokens = 1.4, 0
    asked: list[tuple[int, float]] = []
    room = {"tokens": 1000}

    def recompute_for(tokens: int, padding: float = 1.25) -> bool | None:
        asked.append((tokens, padding))
        return None if room["tokens"] is None else tokens > room["tokens"]

    graphed.recompute_for = recompute_for

    def steps(n: int) -> list[bool]:
        flags = []
        for _ in range(n):
            want, got = eager.step(), graphed.step()
            for j in want.losses:
                assert math.isclose(got.losses[j], want.losses[j], rel_tol=2e-5), j
                assert math.isclose(got.grad_norms[j], want.grad_norms[j], rel_tol=1e-4), j
            flags.append(graphed.gradient_checkpointing)
        return flags

    for eng in (eager, graphed):
        eng.attach(job("a", 4, 4, 1))
        eng.attach(job("b", 4, 2, 2))  # 144 tokens a step: a row of 144 (its sequences' cells)
    # the eager run, then its capture (asked with the allowance: a capture's memory stays): both fit
    assert steps(2) == [False, False]
    assert asked == [(144, 1.0), (144, CAPTURE_PADDING)] and g.captures == 1
    room["tokens"] = 20  # nothing new fits now
    for eng in (eager, graphed):
        eng.detach("a")  # 48 tokens: the 144-token capture is over cover_ratio
    # without recompute it would be a capture of its own (its class is warm): asked with the allowance
    assert steps(1) == [True] and asked[-1] == (48, CAPTURE_PADDING)
    for eng in (eager, graphed):
        eng.detach("b")
        eng.attach(job("c", 4, 5, 3))  # 120 tokens, which the 144-token capture covers
    replays = g.replays
    assert steps(2) == [False, False] and g.replays == replays + 2 and g.covered == 2
    room["tokens"] = None  # no policy: the setting stays
    graphed.set_recompute(True)
    assert steps(1) == [True]
    for j in graphed.jobs:
        torch.testing.assert_close(graphed.jobs[j].adapter.flat, eager.jobs[j].adapter.flat, rtol=1e-4, atol=1e-6)


def test_a_mostly_stale_pool_is_spare_and_its_release_drops_the_captures(model_dir) -> None:  # noqa: ANN001
    # the 200-step task's first steps (8 jobs, 5-7k tokens) captured without recompute; its 190 later
    # steps of 2 jobs, ~1.5k tokens, then recomputed beside that pool (126 of 200). On the CPU a
    # capture takes no pool: each capture's bytes are set as a GPU's would be.
    from trainer.device_room import release, spare_bytes
    from trainer.step_graphs import STALE_STEPS

    graphed = engine(model_dir, True, examples(32, 16, seed=3))
    g = graphed.step_graphs
    g.cover_ratio, g.cover_tokens = 1.0, 0  # no padded replays: each key its own capture
    graphed.attach(job("big", 4, 4, 1))
    graphed.attach(job("small", 4, 1, 2))
    for _ in range(3):  # the first warms the class, the second captures the big key
        graphed.step()
    (big,) = [e for e in g.entries.values() if e.graph is not None]
    graphed.detach("big")
    for _ in range(3):
        graphed.step()
    small = [e for e in g.entries.values() if e.graph is not None and e is not big]
    assert small and g.calls - big.last < STALE_STEPS
    big.pool, small[0].pool = 3 << 30, 1 << 30
    g.pool_bytes = 4 << 30
    assert g.stale_pool() == 0 and spare_bytes(graphed, []) == 0.0  # the big key ran lately
    for _ in range(STALE_STEPS):
        graphed.step()
    assert g.stale_pool() == 4 << 30 and spare_bytes(graphed, []) == float(4 << 30)
    small[0].pool = 5 << 30  # most of the pool is captures still in use: not spare
    g.pool_bytes = 8 << 30
    assert g.stale_pool() == 0
    small[0].pool, g.pool_bytes = 1 << 30, 4 << 30
    spilled: list[bool] = []
    assert release(graphed, lambda: spilled.append(True) or False)
    assert spilled == [True] and not g.entries and g.pool_bytes == 0 and g.stale_pool() == 0
    captures = g.captures
    graphed.step()
    graphed.step()
    assert g.captures == captures + 1  # later steps capture again (the class stays warm)


def test_a_capture_the_device_lacks_free_memory_for_waits_and_its_key_replays_a_larger_capture(
        model_dir, monkeypatch) -> None:  # noqa: ANN001
    # session 34's search (a) on an H100: three captures began with 0.2 GB free on the device (the
    # caching allocator held the rest for eager steps) and failed; their keys then ran eagerly for
    # good. Now a capture first asks whether its pool fits what the device has free: where not, the
    # step runs eagerly, the key waits CAPTURE_RETRY_STEPS steps, and meanwhile a larger capture may
    # replay it padded however often. On the CPU the device's answer is set. The rules at a step's
    # start: the next step's capture (graph_ahead.NEXT) is left out.
    import trainer.step_graphs as sg
    from trainer.graph_parts import CAPTURE_RETRY_STEPS

    monkeypatch.setattr(graph_ahead, "NEXT", False)

    short: list[bool] = [False]
    asked: list[tuple[int, bool]] = []
    monkeypatch.setattr(sg, "capture_short", lambda device, need, pool, sync=True: "no room" if short[0] else None)
    eager, graphed = two_jobs(model_dir)
    g = graphed.step_graphs
    g.capture_need = lambda tokens, recompute: asked.append((tokens, recompute)) or 1.0
    g.cover_ratio, g.cover_tokens, g.capture_after = 1.19, 200, 2

    def both_steps(n: int) -> None:
        same_steps(eager, graphed, n)

    both_steps(2)  # 144 tokens: an eager run, then its capture (the device had room)
    assert (g.eager_runs, g.captures, g.deferrals) == (1, 1, 0) and asked == [(144, True)]
    for eng in (eager, graphed):
        eng.detach("b")
    both_steps(2)  # 72 tokens: covered twice (capture_after) ...
    assert (g.captures, g.covered) == (1, 2)
    short[0] = True
    both_steps(1)  # ... then its capture finds no room: deferred, the step runs eagerly
    assert (g.captures, g.deferrals, g.eager_runs, g.failures) == (1, 1, 2, 0)
    both_steps(CAPTURE_RETRY_STEPS - 1)  # while it waits the larger capture replays it, padded
    assert (g.captures, g.deferrals, g.covered, g.eager_runs) == (1, 1, 2 + CAPTURE_RETRY_STEPS - 1, 2)
    short[0] = False
    graphed.step_graphs.cover_ratio = 1.0  # (no cover now) its wait over, the key is captured
    graphed.step_graphs.cover_tokens = 0
    both_steps(2)
    assert (g.captures, g.deferrals) == (2, 1) and g.entries[next(reversed(g.entries))].graph is not None
    for j in graphed.jobs:
        torch.testing.assert_close(graphed.jobs[j].adapter.flat, eager.jobs[j].adapter.flat, rtol=1e-4, atol=1e-6)


def test_a_capture_fits_what_the_device_has_free_and_the_pool_holds(monkeypatch) -> None:  # noqa: ANN001
    from trainer import graph_parts

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {
        "reserved_bytes.all.current": 70 * gib, "allocated_bytes.all.current": 45 * gib,
        "inactive_split_bytes.all.current": 20 * gib, "segment.all.current": 900})
    emptied = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    cuda = torch.device("cuda", 0)
    assert graph_parts.capture_short(cuda, None, 0) is None  # no need known: no check
    assert graph_parts.capture_short(torch.device("cpu"), 1e12, 0) is None
    assert graph_parts.capture_short(cuda, 5 * gib, 3 * gib) is None  # 2 free + 3 of the pool
    why = graph_parts.capture_short(cuda, 6 * gib, 3 * gib)
    assert why is not None and "needs 6.0 GiB" in why and "split free 20.00 in 900 segments" in why
    assert "outside PyTorch 8.00" in why  # 80 - 2 free - 70 reserved
    # the cached blocks went back before each capture on the device that lacked room (or no need known)
    assert len(emptied) == 3
    emptied.clear()
    assert graph_parts.capture_short(cuda, 1 * gib, 0) is None and not emptied  # 2 free: room twice over
    assert graph_parts.capture_short(cuda, 1.5 * gib, 0) is None and len(emptied) == 1  # under 2 x 1.5


def test_near_the_end_a_key_a_capture_can_replay_padded_is_not_captured(model_dir) -> None:  # noqa: ANN001
    # search (a)'s 2-job tail captured 3 keys in its last 18 steps (0.25 s each over a replay, a padded
    # replay ~0.03 s): with under CAPTURE_HORIZON steps left, a coverable key stays covered
    from types import SimpleNamespace

    from trainer.graph_parts import steps_left
    from trainer.step_graphs import CAPTURE_HORIZON

    eager, graphed = two_jobs(model_dir)
    g = graphed.step_graphs
    g.cover_ratio, g.cover_tokens, g.capture_after = 1.19, 200, 2
    same_steps(eager, graphed, 2)  # 144 tokens: an eager run, then its capture
    for eng in (eager, graphed):
        eng.detach("b")
    g.steps_left = lambda: CAPTURE_HORIZON - 1
    same_steps(eager, graphed, 4)  # 72 tokens: covered past capture_after, never captured
    assert (g.captures, g.covered, len(g.entries)) == (1, 4, 1)
    g.steps_left = lambda: None  # more steps will come (a queued job): the key is captured at its next step
    same_steps(eager, graphed, 1)
    assert (g.captures, g.covered) == (2, 4)
    # the executor's steps left: the attached jobs', unless a task has a job queued
    jobs = {"a": SimpleNamespace(total_steps=40, step=30), "b": SimpleNamespace(total_steps=90, step=12)}
    engine_ = SimpleNamespace(jobs=jobs)
    assert steps_left(engine_, [SimpleNamespace(queue=[]), SimpleNamespace(queue=[])]) == 78
    assert steps_left(engine_, [SimpleNamespace(queue=[]), SimpleNamespace(queue=["queued"])]) is None
    assert steps_left(SimpleNamespace(jobs={}), []) == 0


def test_a_large_key_of_a_short_lived_job_set_runs_eagerly(model_dir, monkeypatch) -> None:  # noqa: ANN001
    # search (a)'s 24-job set captured a 7.6k-token key at its last step (+0.46 s over its eager
    # run, never replayed, 42 GB of pool), the 200-step task's 10-step 8-job set two keys (~1 s over
    # eager): a key of TRANSIENT_MIN_TOKENS or more is not captured while the attached job set runs
    # under TRANSIENT_SET_STEPS more steps (set_lasts); a smaller one still is
    from types import SimpleNamespace

    from trainer import step_graphs
    from trainer.graph_parts import set_lasts
    from trainer.step_graphs import TRANSIENT_SET_STEPS

    eager, graphed = two_jobs(model_dir)
    g = graphed.step_graphs
    monkeypatch.setattr(step_graphs, "TRANSIENT_MIN_TOKENS", 100)  # the two jobs' key: 144 tokens
    g.set_lasts = lambda: TRANSIENT_SET_STEPS - 1
    same_steps(eager, graphed, 2)  # the class's first (eager), then a short-lived set's step: eager again
    assert (g.eager_runs, g.captures) == (2, 0)
    g.set_lasts = lambda: TRANSIENT_SET_STEPS
    same_steps(eager, graphed, 2)  # the set lasts: captured, then replayed
    assert (g.eager_runs, g.captures, g.replays) == (2, 1, 2)
    monkeypatch.setattr(step_graphs, "TRANSIENT_MIN_TOKENS", 4096)
    for eng in (eager, graphed):
        eng.detach("b")
    g.set_lasts, g.cover_tokens = (lambda: 1), 0  # 72 tokens, under the floor: captured at its set's last step
    same_steps(eager, graphed, 1)
    assert g.captures == 2
    # the executor's: the fewest steps of this rank's jobs to their end, or to their warmup's end
    # while their ranking waits (another rank's jobs do not count)
    slots = {"a": SimpleNamespace(total_steps=40, step=30), "b": SimpleNamespace(total_steps=90, step=2),
             "c": SimpleNamespace(total_steps=9, step=1)}
    task = SimpleNamespace(placed=slots, in_warmup=lambda j: j == "b", warmup_len=lambda s: 5)
    engine_ = SimpleNamespace(jobs={"a": 0, "b": 0})
    assert set_lasts(engine_, [task]) == 3
    assert set_lasts(SimpleNamespace(jobs={"a": 0}), [task]) == 10
    assert set_lasts(SimpleNamespace(jobs={}), [task]) is None


def test_a_large_key_of_a_short_lived_job_set_stays_covered_past_capture_after(model_dir, monkeypatch) -> None:  # noqa: ANN001
    # a key the short-lived-set rule keeps from capture is not run eagerly once covered capture_after times:
    # the larger capture keeps running it padded
    from trainer import step_graphs

    eager, graphed = two_jobs(model_dir)
    g = graphed.step_graphs
    g.cover_ratio, g.cover_tokens, g.capture_after = 1.19, 200, 2
    same_steps(eager, graphed, 2)  # 144 tokens: an eager run, then its capture (no set_lasts: the set lasts)
    for eng in (eager, graphed):
        eng.detach("b")
    monkeypatch.setattr(step_graphs, "TRANSIENT_MIN_TOKENS", 50)  # the 72-token key counts as large
    g.set_lasts = lambda: 2
    same_steps(eager, graphed, 4)  # covered past capture_after, never captured, never eager
    assert (g.captures, g.covered, g.eager_runs) == (1, 4, 1)
    g.set_lasts = lambda: None  # the set lasts: captured at its next step
    same_steps(eager, graphed, 1)
    assert (g.captures, g.covered, g.eager_runs) == (2, 4, 1)


def test_a_capture_skips_torchs_emptying_only_where_the_device_has_room_and_restores_the_stream(monkeypatch) -> None:  # noqa: ANN001
    from trainer import graph_parts

    gib = 1 << 30
    calls: list[str] = []
    streams = {"current": "default"}

    class Graph:  # torch.cuda.graph's shape: it empties both caches on entry, then makes its stream current;
        # its exit ends the capture before it leaves that stream, so an end that raises leaves it current
        def __init__(self, graph, pool=None, capture_error_mode="global") -> None:  # noqa: ANN001
            calls.append(f"mode {capture_error_mode}")

        def __enter__(self) -> None:
            torch.cuda.empty_cache()
            torch._C._host_emptyCache()
            streams["current"] = "capture"

        def __exit__(self, *exc) -> None:  # noqa: ANN002
            calls.append(f"exit {exc[0].__name__ if exc[0] else None}")
            if exc[0] is not None:
                raise RuntimeError("operation failed due to a previous error during capture")
            streams["current"] = "default"

    class Stream:
        def __init__(self, name: str) -> None:
            self.name, self.device = name, 0

    empty, host_empty = (lambda: calls.append("empty")), (lambda: calls.append("host empty"))
    monkeypatch.setattr(torch.cuda, "graph", Graph)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(streams["current"]))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: streams.update(current=stream.name))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "empty_cache", empty)
    monkeypatch.setattr(torch._C, "_host_emptyCache", host_empty, raising=False)
    with graph_parts.capturing(None, None, "relaxed", need=gib):  # 2 GiB free: room twice over
        calls.append("body")
        assert streams["current"] == "capture"
    assert calls == ["mode relaxed", "body", "exit None"] and streams["current"] == "default"
    assert torch.cuda.empty_cache is empty and torch._C._host_emptyCache is host_empty  # put back
    calls.clear()
    # a capture that fails inside: the end's error comes out, and the stream before it is current again
    with pytest.raises(RuntimeError, match="previous error"), \
            graph_parts.capturing(None, None, "relaxed", need=1.5 * gib):
        raise ValueError("a host read inside the capture")
    assert calls == ["mode relaxed", "empty", "host empty", "exit ValueError"]  # no room: as torch does
    assert streams["current"] == "default"
    calls.clear()
    with graph_parts.capturing(None):  # no need known: torch's own entry
        pass
    assert calls == ["mode thread_local", "empty", "host empty", "exit None"]
