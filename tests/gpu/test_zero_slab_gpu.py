"""The fused multi-LoRA operator's shrinks on a step's zeroed slab (kernels.zero_slab) inside a CUDA graph, at a
2-job step's shape (1,536 rows, ranks 16 and 64, a 4096 -> 14336 projection): the slab's fill is part of the
graph, so every replay (new inputs each) gives the eager operator's y, dX and weight gradients, where each
shrink zeroes its own S; no split shrink zeroes its S under the slab, while the eager run's do.

Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from kernels import fused_lora  # noqa: E402
from kernels.fused_lora import multilora_linear_arena_fused  # noqa: E402
from kernels.testing import make_case  # noqa: E402
from kernels.zero_slab import ZeroSlab  # noqa: E402


def _arena(case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """The case's adapters in one arena, every block at a multiple of 16 elements: A [r, d_in], then B^T [r, d_out]."""
    pieces, a_off, b_off, pos = [], [], [], 0
    for i, r in enumerate(case.ranks.tolist()):
        for block, offs in ((case.lora_a[i, :, :r].t(), a_off), (case.lora_b[i, :r, :], b_off)):
            offs.append(pos)
            pieces.append(block.reshape(-1))
            pos += block.numel()
    dev = case.x.device
    return (torch.cat(pieces).contiguous(), torch.tensor(a_off, device=dev), torch.tensor(b_off, device=dev))


def test_graph_replays_on_the_slab_equal_the_eager_operator() -> None:
    hooks = []
    shared = {id(c): c for k in (fused_lora._shrink, fused_lora._shrink_wgrad) for c in k.configs}  # shared lists
    for cfg in shared.values():
        if cfg.pre_hook is not None:
            cfg.pre_hook = (lambda h: lambda nargs: (hooks.append(1), h(nargs)))(cfg.pre_hook)
    case = make_case([300, 1236], [16, 64], 4096, 14336, dtype=torch.bfloat16, device="cuda", bias=False,
                     nan_padding=False, seed=7)
    arena, a_off, b_off = _arena(case)
    grad = torch.zeros(arena.numel(), dtype=torch.float32, device="cuda")
    token = torch.zeros((), device="cuda", requires_grad=True)
    x = case.x.detach().clone().requires_grad_()
    probe = case.dy.float()

    def body(slab: ZeroSlab | None) -> torch.Tensor:
        grad.zero_()
        x.grad = None
        y = multilora_linear_arena_fused(x, case.weight, None, arena, grad, a_off, b_off, case.scales, case.ranks,
                                         case.offsets, 64, token, aligned=True, slab=slab)
        (y.float() * probe).sum().backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # kernels loaded and configurations chosen before the capture
        for _ in range(2):
            body(ZeroSlab())
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    hooks.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = body(ZeroSlab())
    assert hooks == []  # no split shrink zeroed its S: the slab's zeros serve both
    dx_graph = x.grad
    gen = torch.Generator(device="cuda").manual_seed(11)
    for _ in range(3):
        x.data.copy_(torch.randn(x.shape, generator=gen, device="cuda").to(x.dtype))
        graph.replay()
        got = (y_graph.float().clone(), dx_graph.float().clone(), grad.clone())
        hooks.clear()
        y = body(None)
        assert hooks, "the eager run's shrinks split their sweep (the case the slab serves)"
        want = (y.float(), x.grad.float(), grad.clone())
        for g, w in zip(got, want, strict=True):
            err = float((g - w).norm() / w.norm())
            assert err < 2e-3, err
