"""The overlapped LoRA term (LORAPLEX_LORA_OVERLAP: the LoRA pass on the side stream beside cuBLAS's GEMM, then
kernels/lora_add.py adds the term in place) on a GPU: forward and backward against the float64 oracle at the
engine's shapes, stacked and arena forms, the "cublas" variant and "auto" at a 2-job small step; and a CUDA graph
of a forward and backward (the side stream's fork and joins captured) replays what the eager call computes.

Skipped without CUDA.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import kernels.fused_lora as fl  # noqa: E402
import kernels.lora_add as la  # noqa: E402
from kernels.fused_lora import multilora_linear_arena_fused, multilora_linear_fused  # noqa: E402
from kernels.testing import make_case, oracle_fp64, rel_errors, run_arena, run_op  # noqa: E402

TOL = {torch.bfloat16: 1.5e-2, torch.float32: 1e-5}
CASES = [
    # counts, ranks, d_in, d_out, dtype, bias, padding rows, variant
    ([290, 1160], [16, 64], 4096, 4096, torch.bfloat16, False, 86, "auto"),   # the 2-job step at its 1,536-row key
    ([290, 1160], [16, 64], 4096, 1024, torch.bfloat16, False, 86, "auto"),
    ([290, 1160], [16, 64], 14336, 4096, torch.bfloat16, False, 86, "cublas"),
    ([700, 0, 1, 129, 1024, 77, 0, 300], [64, 8, 16, 32, 16, 64, 8, 8], 4096, 4096, torch.bfloat16, True, 0, "cublas"),
    ([100, 37, 500], [128, 8, 16], 1024, 640, torch.bfloat16, False, 20, "cublas"),
    ([33, 0, 250, 5], [8, 16, 64, 16], 200, 136, torch.float32, True, 7, "cublas"),
]


@pytest.fixture
def overlap(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The overlap on for this test (read at each call), the add kernel's launches counted."""
    monkeypatch.setattr(fl, "LORA_OVERLAP", True)
    launches: list[int] = []
    jit = la._lora_add_tma_jit

    class Counted:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            launches.append(1)
            return jit[grid]

    monkeypatch.setattr(la, "_lora_add_tma_jit", Counted())
    return launches


@pytest.mark.parametrize("idx", range(len(CASES)))
def test_overlap_matches_fp64(idx: int, overlap: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    counts, ranks, d_in, d_out, dtype, bias, pad, variant = CASES[idx]
    c = make_case(counts, ranks, d_in, d_out, dtype=dtype, bias=bias, pad_rows=pad, device="cuda")
    want = oracle_fp64(c)
    got = run_op(c, multilora_linear_fused, gemm=variant)
    for name, err in rel_errors(got, want).items():
        assert err < TOL[dtype], (name, err)
    added = len(overlap)
    if variant == "cublas":
        assert added == 2  # the forward and the dX GEMM, both overlapped
    monkeypatch.setattr(fl, "GEMM_DEFAULT", variant)
    got, stray = run_arena(c, multilora_linear_arena_fused, aligned=True)
    for name, err in rel_errors(got, want).items():
        assert err < TOL[dtype], ("arena", name, err)
    assert stray == 0
    assert len(overlap) == 2 * added


def test_overlap_in_a_cuda_graph(overlap: list[int]) -> None:
    """A forward and backward captured with the overlap (its side-stream fork, event wait and joins) replay the
    eager call's output and gradients."""
    c = make_case([290, 1160], [16, 64], 4096, 4096, dtype=torch.bfloat16, pad_rows=86, device="cuda")
    x = c.x.clone().requires_grad_()
    a, b = c.lora_a.clone().requires_grad_(), c.lora_b.clone().requires_grad_()

    def step() -> torch.Tensor:
        y = multilora_linear_fused(x, c.weight, c.bias, a, b, c.scales, c.ranks, c.offsets, gemm="cublas")
        y.backward(c.dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up (compiles) off the default stream, as torch's capture recipe does
            for t in (x, a, b):
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in (x, a, b):
        t.grad = None
    want_y = step().detach().clone()
    want = [t.grad.clone() for t in (x, a, b)]
    graph = torch.cuda.CUDAGraph()
    for t in (x, a, b):
        t.grad = None
    with torch.cuda.graph(graph):
        y = step()
    launched = len(overlap)
    for t in (x, a, b):
        t.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert len(overlap) == launched  # a replay launches nothing from the host
    # the split shrink's and dB's float32 atomics sum in any order: equal up to that
    assert torch.allclose(y.float(), want_y.float(), rtol=1e-2, atol=1e-3 * want_y.float().abs().max().item())
    for got, ref in zip((x.grad, a.grad, b.grad), want, strict=True):
        assert torch.allclose(got.float(), ref.float(), rtol=1e-2, atol=1e-3 * ref.float().abs().max().item())
