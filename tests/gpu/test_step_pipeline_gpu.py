"""The next graphed step launched before this one's sync (trainer.step_pipeline) on CUDA: real CUDA graphs replayed
ahead, in stream order behind the step before's updates, give the steps of the same engine without it (a large
learning rate: a step that read the weights before the updates of the step before would differ by far more than
the tolerance), steps were launched and adopted, and a job leaving under a launched step drops it. Skipped without
CUDA."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from tests.helpers.engine_ref import tiny_model_dir  # noqa: E402
from tests.unit.test_graph_ahead import _mixed_lengths  # noqa: E402
from tests.unit.test_step_graphs import job  # noqa: E402
from trainer import graph_thread, step_pipeline, step_update  # noqa: E402
from trainer.engine import MultiLoraEngine  # noqa: E402


def _engine(model_dir, data):  # noqa: ANN001, ANN202
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    eng = MultiLoraEngine(model, data, 0, gradient_checkpointing=False, attention="varlen", step_graphs=True)
    eng.step_graphs.capture_after = 0
    return eng


def _three(eng, lr: float) -> None:  # noqa: ANN001
    for spec in (job("a", 8, 2, 1, lr=lr), job("b", 16, 3, 2, lr=lr), job("c", 8, 1, 3, lr=lr)):
        eng.attach(spec)


def test_steps_launched_ahead_on_cuda_equal_the_steps_without(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The same steps within what two runs of the same graphs differ by on a GPU (atomics in the kernels, which
    AdamW can turn into a learning rate's move of a near-zero element either way: session 65's first run of this
    test, at a learning rate of 5e-2, saw a job's gradient norm 4% apart at equal losses)."""
    monkeypatch.setattr(step_update, "DEVICE_UPDATE", True)
    monkeypatch.setattr(step_pipeline, "ON", True)
    monkeypatch.setattr(graph_thread, "ON", False)
    d = tiny_model_dir("llama", tmp_path)
    data = _mixed_lengths()
    plain, piped = _engine(d, data), _engine(d, data)
    piped.pipeline.holds = lambda: True
    for eng in (plain, piped):
        _three(eng, 5e-3)

    def both(n: int) -> None:
        for _ in range(n):
            want, got = plain.step(), piped.step()
            assert got.skipped == want.skipped and got.job_tokens == want.job_tokens
            for j in want.losses:
                assert math.isclose(got.losses[j], want.losses[j], rel_tol=2e-3), (j, got.losses, want.losses)
                assert math.isclose(got.grad_norms[j], want.grad_norms[j], rel_tol=0.1), (j, got.grad_norms, want.grad_norms)

    both(12)
    g = piped.step_graphs.ahead
    assert g["step_launched"] >= 6 and g["step_adopted"] >= 5 and g["step_dropped"] == 0, dict(g)
    assert isinstance(next(iter(piped.step_graphs.entries.values())).graph, torch.cuda.CUDAGraph)
    for _ in range(8):  # until a step is launched ahead (session 65: after the 12th, the 13th's key was new)
        if piped.pipeline.ahead is not None:
            break
        both(1)
    assert piped.pipeline.ahead is not None, dict(g)
    for eng in (plain, piped):
        eng.detach("b", park_device="cpu").settle()
    both(6)
    assert g["step_dropped"] == 1, dict(g)
    for j in ("a", "c"):
        got, want = piped.jobs[j].adapter.flat.double(), plain.jobs[j].adapter.flat.double()
        assert ((got - want).norm() / want.norm()).item() < 1e-2, j
        assert piped.jobs[j].stream.state_dict() == plain.jobs[j].stream.state_dict()


def test_a_step_launched_ahead_reads_the_weights_after_the_updates_before_it(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Stream order, measured: the losses the launched step's graph wrote equal its body run again eagerly on the
    weights after the step before's updates, and are far from what the weights before them give."""
    monkeypatch.setattr(step_update, "DEVICE_UPDATE", True)
    monkeypatch.setattr(step_pipeline, "ON", True)
    monkeypatch.setattr(graph_thread, "ON", False)
    d = tiny_model_dir("llama", tmp_path)
    eng = _engine(d, _mixed_lengths())
    eng.pipeline.holds = lambda: True
    _three(eng, 5e-2)
    graphs, checked = eng.step_graphs, 0
    for _ in range(14):
        torch.cuda.synchronize()
        before = eng.slots.arena.clone()  # the weights this step's updates start from
        eng.step()
        ahead = eng.pipeline.ahead
        if ahead is None:
            continue
        torch.cuda.synchronize()
        n = len(ahead.states)
        st = ahead.entry.static
        key = next(k for k, e in graphs.entries.items() if e is ahead.entry)
        graphed = st.out[:n, 0].clone()
        after = eng.slots.arena.clone()
        graphs._run(st, key)  # the body again, eagerly, on the weights now (after the updates)
        now = st.out[:n, 0].clone()
        eng.slots.arena.copy_(before)
        graphs._run(st, key)  # and on the weights before them
        lag = st.out[:n, 0].clone()
        eng.slots.arena.copy_(after)
        graphs._run(st, key)  # the buffers as the launched step left them (what the next step adopts)
        torch.cuda.synchronize()
        assert ((graphed - now).abs() <= 1e-3 * now.abs()).all(), (graphed, now)
        assert ((now - lag).abs() > 10 * (graphed - now).abs()).all(), (graphed, now, lag)
        checked += 1
    assert checked >= 4 and graphs.ahead["step_adopted"] >= 4, dict(graphs.ahead)
