"""GPU: sibling groups of the fused multi-LoRA operator (kernels.fused_groups, $LORAPLEX_LORA_GROUPS): one grouped
call equals each sibling's own fused call at an 8B model's q/k/v and gate/up widths, eagerly and replayed from a
CUDA graph, and an engine's graphed steps with the groups on equal its steps with them off. The same on the CPU
under the interpreter: tests/slow/test_lora_groups_interpret.py."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from kernels.testing import group_against_siblings  # noqa: E402

CASES = [
    # counts, ranks, d_in, d_outs, dtype, bias, aligned, x_grad, onepass, graphed
    ([290, 1160], [16, 64], 4096, [4096, 1024, 1024], torch.bfloat16, False, True, True, True, False),   # q/k/v
    ([290, 1160], [16, 64], 4096, [14336, 14336], torch.bfloat16, False, True, True, True, True),        # gate/up
    ([700, 0, 1, 129], [64, 8, 16, 32], 1024, [1024, 256, 256], torch.bfloat16, True, False, False, True, True),
    ([33, 250], [8, 24], 200, [136, 72], torch.float32, True, False, True, False, False),
]


@pytest.mark.parametrize("idx", range(len(CASES)))
def test_a_grouped_call_equals_each_siblings_own_fused_call_on_cuda(idx: int) -> None:
    r = group_against_siblings(*CASES[idx][:9], device="cuda", graphed=CASES[idx][9])
    assert not r["nan"] and r["moved"] > 0, r
    # the same kernels' programs per sibling on the same configuration: the outputs and gradients of the siblings'
    # own calls up to the order of fp32 atomics (split shrinks, weight-gradient chunks; a bf16 output's rounding
    # may flip where its LoRA term moved by one), dX up to the order of its sum
    bf16 = CASES[idx][4] == torch.bfloat16
    assert r["y"] <= (1e-3 if bf16 else 1e-5) and r["grad"] <= 1e-5, r
    assert r["dx"] <= (1e-2 if bf16 else 1e-5), r


def test_graphed_engine_steps_with_siblings_grouped_equal_the_steps_without(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A graphed engine's steps (two jobs of mixed ranks, a tiny Llama in bf16, the fused form) with q/k/v and
    gate/up grouped give the losses of the same steps with them off, and every layer's two groups ran."""
    import kernels.fused_groups as fg
    import kernels.multilora as km
    from tests.gpu.test_step_graphs_gpu import _mixed_two_jobs
    from trainer import multilora

    monkeypatch.setattr(km, "_default_form", "fused")
    calls: list[int] = []
    real = fg.FusedGroupArenaFn.forward
    monkeypatch.setattr(fg.FusedGroupArenaFn, "forward",
                        staticmethod(lambda ctx, x, *a: calls.append(len(a)) or real(ctx, x, *a)))
    losses = {}
    for on in (False, True):
        monkeypatch.setattr(multilora, "GROUPS", on)
        _, graphed = _mixed_two_jobs(tmp_path / str(on))
        losses[on] = [graphed.step().losses for _ in range(6)]
        groups = {id(m.group) for m in graphed.layers.values() if m.group is not None}
        assert len(groups) == 2 * graphed.model.config.num_hidden_layers
        assert bool(calls) == on and graphed.step_graphs.replays >= 3
    for off, on in zip(losses[False], losses[True], strict=True):
        for j in off:
            assert math.isclose(on[j], off[j], rel_tol=2e-2), (j, on[j], off[j])
