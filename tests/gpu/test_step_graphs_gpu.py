"""The graphed training step on CUDA (trainer.step_graphs): real CUDA graphs of the forward and
backward equal the eager step in bf16 with the varlen attention, a new job set replays the same
capture, and a replay makes no host sync. Skipped without CUDA."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from tests.helpers.engine_ref import tiny_model_dir  # noqa: E402
from tests.unit.test_step_graphs import examples, job, same_evaluations  # noqa: E402
from trainer.engine import MultiLoraEngine  # noqa: E402


def _engine(model_dir, graphs: bool, data, recompute: bool, adapter_dtype=None):  # noqa: ANN001, ANN202
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    return MultiLoraEngine(model, data, 0, gradient_checkpointing=recompute, attention="varlen",
                           step_graphs=graphs, adapter_dtype=adapter_dtype or torch.float32)


@pytest.mark.parametrize("recompute", [True, False])
def test_cuda_graphs_equal_eager_and_reuse_captures(tmp_path, recompute: bool) -> None:  # noqa: ANN001
    d = tiny_model_dir("llama", tmp_path)
    data = examples(48, 40)
    eager, graphed = _engine(d, False, data, recompute), _engine(d, True, data, recompute)
    for eng in (eager, graphed):
        for spec in (job("a", 8, 2, 1), job("b", 16, 2, 2), job("c", 32, 2, 3)):
            eng.attach(spec)

    def both(n: int) -> None:
        for _ in range(n):
            want, got = eager.step(), graphed.step()
            assert got.skipped == want.skipped
            for j in want.losses:
                assert math.isclose(got.losses[j], want.losses[j], rel_tol=2e-2), (j, got.losses, want.losses)

    both(4)
    g = graphed.step_graphs
    assert g.captures == 1 and g.replays == 3
    assert g.stats()["capture_host_ms"] > 0 and g.stats()["capture_end_ms"] >= 0  # the capture's parts timed
    assert isinstance(next(iter(g.entries.values())).graph, torch.cuda.CUDAGraph)
    for eng in (eager, graphed):
        eng.detach("b")
        eng.attach(job("d", 4, 2, 4, lr=1e-2))
    both(3)
    assert g.captures == 1 and g.replays == 6
    for j in ("a", "c", "d"):
        # AdamW normalises each element's step: an element whose bf16 gradient is near zero may
        # move by up to the learning rate either way, so the weights agree in norm, not elementwise
        got, want = graphed.jobs[j].adapter.flat.double(), eager.jobs[j].adapter.flat.double()
        assert ((got - want).norm() / want.norm()).item() < 1e-2, j
    # a replay (with its inputs' copy) never waits for the device
    states = list(graphed.jobs.values())
    per_job = [[data[i] for i in range(2)] for _ in states]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graphed.step_graphs.forward_backward(states, per_job)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert g.replays == 7


def test_cuda_graph_evaluation_equals_eager(tmp_path) -> None:  # noqa: ANN001
    """Adapters in the compute dtype (bf16): evaluation forwards replay graphs. (Float32 adapters
    evaluate eagerly on a bf16 copy of the group's adapters: the test below.)"""
    d = tiny_model_dir("llama", tmp_path)
    data = examples(24, 40, seed=3)
    held_out = examples(9, 40, seed=9) + examples(3, 24, seed=10)
    eager = _engine(d, False, data, True, torch.bfloat16)
    graphed = _engine(d, True, data, True, torch.bfloat16)
    same_evaluations(eager, graphed, [job("a", 8, 2, 1), job("b", 32, 1, 2)], held_out, 1e-2, 2e-2)
    g = graphed.step_graphs
    assert g.captures >= 1 and g.replays >= 3 and g.failures == 0
    assert any(isinstance(e.graph, torch.cuda.CUDAGraph) for k, e in g.entries.items() if not k.train)


def test_an_evaluation_on_its_arena_copy_equals_the_whole_arena(tmp_path) -> None:  # noqa: ANN001
    """The fused kernels (bf16, aligned offsets) reading an evaluation's copy of its jobs alone
    (AdapterArena.compute_copy, eager) give the sums of the whole arena copied in a graph."""
    d = tiny_model_dir("llama", tmp_path)
    data = examples(24, 40, seed=3)
    held_out = examples(9, 40, seed=9)
    eng = _engine(d, True, data, True)
    for spec in (job("a", 8, 2, 1), job("b", 32, 1, 2), job("c", 16, 1, 3)):
        eng.attach(spec)
    eng.step()
    states = [eng.jobs["c"], eng.jobs["a"]]
    eng.model.eval()
    with torch.no_grad():
        want, counts = eng.evaluation.token_sums(states, held_out)  # a graph over the whole arena
        want = want.double().cpu()
        replays = eng.step_graphs.replays
        with eng.slots.compute_copy(states):
            assert eng.slots.copied
            got, got_counts = eng.evaluation.token_sums(states, held_out)
        assert eng.step_graphs.replays == replays  # the copy's forward ran eagerly
    assert torch.equal(counts, got_counts)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("staged", [True, False])
def test_a_keys_inputs_arrive_whole_while_the_stream_is_busy(monkeypatch, staged: bool) -> None:  # noqa: ANN001
    """Static.load's pinned mirror is rewritten only once the copy out of it ran: three loads
    queued behind a sleeping stream each land as loaded (without the wait, an earlier copy
    would read a later step's values)."""
    from trainer import graph_parts
    from trainer.graph_parts import GraphKey, Static

    monkeypatch.setattr(graph_parts, "PINNED_STAGING", staged)
    key = GraphKey(tokens=64, seq_slots=16, job_slots=8, rank=16, max_len=64, aligned=True, recompute=False)
    st = Static(key, 3, torch.device("cuda"))
    assert (st._host is not None) == staged
    seen, wanted = [], []
    for i in range(3):
        torch.cuda._sleep(20_000_000)  # the copies wait behind this on the current stream
        ints = [torch.full((size,), 1000 * i + j, dtype=torch.int64) for j, size in enumerate(st.sizes)]
        floats = [torch.full((8,), float(i)), torch.full((8,), i + 0.5)]
        st.load(ints, floats)
        seen.append((st.ints.clone(), st.floats.clone()))  # queued after the copies, before the next load
        wanted.append((torch.cat(ints), torch.cat(floats)))
    torch.cuda.synchronize()
    for (got_i, got_f), (want_i, want_f) in zip(seen, wanted, strict=True):
        assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_f.cpu(), want_f)


def test_graphs_captured_ahead_beside_a_queued_evaluation_serve_the_kept_sets_steps(tmp_path) -> None:  # noqa: ANN001
    """trainer.graph_ahead on CUDA: an evaluation's `ahead` captures the keys of a set's next steps before
    the evaluation's numbers are read, without a device sync (its forwards may still run); the set's
    steps then replay them, capture nothing, and equal the eager steps."""
    from trainer import graph_ahead

    d = tiny_model_dir("llama", tmp_path)
    data = examples(64, 40)
    eager, graphed = _engine(d, False, data, False), _engine(d, True, data, False)
    for eng in (eager, graphed):
        for spec in (job("a", 8, 1, 1), job("b", 16, 2, 2), job("c", 8, 3, 3), job("d", 16, 1, 4)):
            eng.attach(spec)
        eng.step()
    g = graphed.step_graphs
    kept = [graphed.jobs["b"], graphed.jobs["c"]]
    syncs = []

    def ahead(busy):  # noqa: ANN001, ANN202
        real = torch.cuda.synchronize
        torch.cuda.synchronize = lambda *a, **k: syncs.append(1) or real(*a, **k)
        try:
            return graph_ahead.capture_ahead(g, graph_ahead.coming_keys(g, [kept], steps=5), busy=lambda: True)
        finally:
            torch.cuda.synchronize = real

    held_out = examples(256, 56, seed=9)  # longer than every training example: the steps' class stays warm
    plain = graphed.evaluate_metrics(held_out, batch_size=64)
    g.capture_need = lambda tokens, recompute: 0.0  # the executor's memory plan gives it (a capture ahead needs one)
    graphed.evaluation.ahead = ahead
    # the tiny model's forwards alone end before the host's first offer: queued work keeps the device busy
    # through it, as an 8B model's forwards do (the offer runs `ahead` only while the device is busy)
    torch.cuda._sleep(200_000_000)
    numbers = graphed.evaluate_metrics(held_out, batch_size=64)  # the captures between a backbone and its head
    assert syncs == [] and g.ahead["made"] >= 1 and graphed.evaluation.ahead is None, dict(g.ahead)
    for j, m in plain.items():
        assert math.isclose(numbers[j]["loss"], m["loss"], rel_tol=5e-3), (j, numbers[j], m)
    captures, replays = g.captures, g.replays
    for eng in (eager, graphed):
        for j in ("a", "d"):
            eng.detach(j)
    for _ in range(5):
        want, got = eager.step(), graphed.step()
        for j in want.losses:
            assert math.isclose(got.losses[j], want.losses[j], rel_tol=2e-2), (j, got.losses, want.losses)
    assert g.captures == captures and g.replays == replays + 5


def _mixed_two_jobs(tmp_path):  # noqa: ANN001, ANN202
    """An eager and a graphed engine (no recompute) with the same two jobs over examples of three lengths: a key
    per token count, never covered (capture_after 0), and a pool need as the executor's plan gives one."""
    d = tiny_model_dir("llama", tmp_path)
    data = [e for trio in zip(examples(24, 16, seed=16), examples(24, 40, seed=40), examples(24, 72, seed=72),
                              strict=True) for e in trio]
    eager, graphed = _engine(d, False, data, False), _engine(d, True, data, False)
    graphed.step_graphs.capture_after, graphed.step_graphs.capture_need = 0, (lambda tokens, recompute: 0.0)
    for eng in (eager, graphed):
        for spec in (job("a", 8, 2, 1), job("b", 16, 3, 2)):
            eng.attach(spec)
    return eager, graphed


def _same_losses(eager, graphed, steps: int) -> None:  # noqa: ANN001
    for _ in range(steps):
        want, got = eager.step(), graphed.step()
        for j in want.losses:
            assert math.isclose(got.losses[j], want.losses[j], rel_tol=2e-2), (j, got.losses, want.losses)


def _same_weights(eager, graphed) -> None:  # noqa: ANN001
    for j in graphed.jobs:  # the weights as the eager steps left them (AdamW's bf16 noise: by norm)
        got, want = graphed.jobs[j].adapter.flat.double(), eager.jobs[j].adapter.flat.double()
        assert ((got - want).norm() / want.norm()).item() < 1e-2, j


def test_the_next_steps_capture_during_a_queued_step_serves_it_with_no_sync(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """trainer.graph_ahead.capture_next on CUDA (LORAPLEX_CAPTURE_NEXT): a new key that follows a replayed step is
    captured during that step with no device sync (at least one while its queued work still runs; a new token
    bucket's module load waits for it), none of the steps' numbers change, and every step after the first
    replays: the same losses as eager steps. The inline capture_next: the capture on a thread (on by default)
    has its own test below."""
    from trainer import graph_ahead, graph_thread

    monkeypatch.setattr(graph_thread, "ON", False)
    eager, graphed = _mixed_two_jobs(tmp_path)
    g = graphed.step_graphs
    syncs, overlapped, real_next, real_sync = [], [], graph_ahead.capture_next, torch.cuda.synchronize

    def next_without_sync(graphs, states):  # noqa: ANN001, ANN202
        # the tiny model's step is done before the host gets here: queued work keeps the device busy through
        # the capture, as an 8B model's step does; the step's numbers are read after it
        torch.cuda._sleep(100_000_000)
        queued = torch.cuda.Event()
        queued.record()
        torch.cuda.synchronize = lambda *a, **k: syncs.append(1) or real_sync(*a, **k)
        try:
            made = real_next(graphs, states)
        finally:
            torch.cuda.synchronize = real_sync
        overlapped.append(made and not queued.query())  # captured while the device still ran this step's work
        return made

    monkeypatch.setattr(graph_ahead, "NEXT", True)
    monkeypatch.setattr(graph_ahead, "capture_next", next_without_sync)
    steps = 14
    _same_losses(eager, graphed, steps)
    made = g.ahead["next_made"]
    # the captures during a replayed step ran with no sync, and while it was still queued; every later step
    # replayed. A capture step is no replay, so a new key right after one is captured at its own step: in this
    # data's order the keys of steps 9 and 12 come after a replay (the CPU trace agrees). A capture whose kernels
    # load a module of a new token bucket waits for the queued work at that load (session 55): in session 56's
    # call 2 one of the 2 captures did, so at least one overlaps, not each
    assert syncs == [] and made >= 2 and sum(map(bool, overlapped)) >= 1, (g.stats(), overlapped)
    assert g.captures > made and g.eager_runs == 1 and g.replays == steps - 1, g.stats()
    _same_weights(eager, graphed)


def test_a_capture_on_a_thread_beside_the_replays_serves_its_step(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """trainer.graph_thread on CUDA (LORAPLEX_CAPTURE_THREAD): a key of the coming steps is captured on a thread
    while the main thread replays and reads the steps' numbers (a device sync meanwhile waits for the capture);
    the graph it makes is a real CUDA graph, every step after the first replays, and the losses equal the eager
    steps'."""
    from trainer import graph_ahead, graph_thread

    eager, graphed = _mixed_two_jobs(tmp_path)
    g = graphed.step_graphs
    real_next, began = graph_ahead.capture_next, []

    def next_on_thread(graphs, states):  # noqa: ANN001, ANN202
        torch.cuda._sleep(50_000_000)  # queued work, as an 8B model's step
        made = real_next(graphs, states)
        if made:
            began.append(graphs.flight.key)
            if len(began) > 1:  # the first capture runs beside the replays; a device sync while a later one
                torch.cuda.synchronize()  # runs waits for it, not fails
        return made

    monkeypatch.setattr(graph_ahead, "NEXT", True)
    monkeypatch.setattr(graph_thread, "ON", True)
    monkeypatch.setattr(graph_ahead, "capture_next", next_on_thread)
    steps = 14
    _same_losses(eager, graphed, steps)
    graph_thread.settle(g)
    made = g.ahead["thread_made"]
    assert made >= 2 and made == len(began) and g.ahead["thread_unmade"] == 0, g.stats()
    assert all(isinstance(g.entries[k].graph, torch.cuda.CUDAGraph) for k in began)
    assert g.eager_runs == 1 and g.replays == steps - 1, g.stats()
    _same_weights(eager, graphed)
