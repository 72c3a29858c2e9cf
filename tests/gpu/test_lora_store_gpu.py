"""GPU correctness of the store pass's column-sweep form (kernels.lora_store, $LORAPLEX_LORA_STORE=sweep): the
"cublas" GEMM variant through the whole operator, forward and backward, against the float64 oracle at the 8B
shapes and a 2-job step's layout with graph-key padding, and replayed inside a CUDA graph.

Skipped without CUDA.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import kernels.fused_lora as fl  # noqa: E402
import kernels.lora_store as ls  # noqa: E402
from kernels.fused_lora import multilora_linear_arena_fused, multilora_linear_fused  # noqa: E402
from kernels.testing import make_case, oracle_fp64, rel_errors, run_arena, run_op  # noqa: E402

TOL = 1.5e-2  # bf16 (tests/gpu/test_kernels_gpu.py's)

CASES = [
    # counts, ranks, d_in, d_out, pad rows (a 2-job step of the 200-step task and its graph key's padding)
    ([290, 1160], [16, 64], 4096, 4096, 86),
    ([290, 1160], [16, 64], 4096, 14336, 86),
    ([700, 0, 1, 129, 77], [64, 8, 16, 32, 24], 14336, 4096, 5),
]


@pytest.fixture
def sweep(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    calls = []
    own = ls.sweep_store
    monkeypatch.setattr(fl, "STORE_FORM", "sweep")
    monkeypatch.setattr(ls, "sweep_store", lambda *a, **k: (calls.append(1), own(*a, **k))[1])
    return calls


@pytest.mark.parametrize("idx", range(len(CASES)))
@pytest.mark.parametrize("tile", [None, [16, 128, 4, 2, 3], [64, 256, 8, 8, 3]])
def test_sweep_store_matches_fp64(idx: int, tile: list[int] | None, sweep, monkeypatch: pytest.MonkeyPatch) -> None:
    if tile is not None:
        monkeypatch.setattr(ls, "SWEEP_TILE", tile)
    counts, ranks, d_in, d_out, pad = CASES[idx]
    torch.manual_seed(idx)
    c = make_case(counts, ranks, d_in, d_out, dtype=torch.bfloat16, device="cuda", bias=idx == 2, pad_rows=pad)
    want = oracle_fp64(c, device="cuda")
    errs = rel_errors(run_op(c, multilora_linear_fused, gemm="cublas"), want)
    monkeypatch.setattr(fl, "GEMM_DEFAULT", "cublas")
    got, stray = run_arena(c, multilora_linear_arena_fused)
    assert sweep, "the sweep form never ran"
    assert max(errs.values()) < TOL, errs
    assert max(rel_errors(got, want).values()) < TOL
    assert stray == 0


def test_sweep_store_replays_in_a_graph(sweep) -> None:
    """The store's launch captured in a CUDA graph and replayed on new operands equals an eager launch."""
    torch.manual_seed(0)
    c = make_case([290, 1160], [16, 64], 4096, 4096, dtype=torch.bfloat16, device="cuda", pad_rows=86)
    ctx = fl._Ctx(c.x, 2, 64, c.offsets, c.ranks, c.scales)
    p = torch.randn(c.x.shape[0], ctx.r_max, device="cuda", dtype=torch.float32)
    out = torch.empty(c.x.shape[0], 4096, device="cuda", dtype=torch.bfloat16)

    def launch() -> None:
        fl.store_launch(ctx, c.x, c.weight.t(), out, None, p, c.lora_b, fl._stacked_b(c.lora_b), c.offsets, 0)

    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    p.copy_(torch.randn_like(p))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    launch()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
    assert replayed.abs().sum() > 0 and len(sweep) >= 3
