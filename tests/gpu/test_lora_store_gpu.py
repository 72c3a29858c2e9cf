"""The store pass's TMA-stored form (kernels/lora_store.py) on a GPU: the "cublas" variant with the TMA store,
forward and backward, stacked and arena forms, against the float64 oracle at the engine's shapes (a 2-job small
step with padding, 8 jobs of mixed ranks, a rank of several rank blocks, a bias), in bf16 and fp32.

Skipped without CUDA.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import kernels.fused_lora as fl  # noqa: E402
import kernels.lora_store as sl  # noqa: E402
from kernels.fused_lora import multilora_linear_arena_fused, multilora_linear_fused  # noqa: E402
from kernels.testing import make_case, oracle_fp64, rel_errors, run_arena, run_op  # noqa: E402

TOL = {torch.bfloat16: 1.5e-2, torch.float32: 1e-5}
CASES = [
    # counts, ranks, d_in, d_out, dtype, bias, padding rows
    ([290, 1160], [16, 64], 4096, 4096, torch.bfloat16, False, 86),       # the 2-job step at its 1,536-row key
    ([290, 1160], [16, 64], 4096, 1024, torch.bfloat16, False, 86),
    ([290, 1160], [16, 64], 14336, 4096, torch.bfloat16, False, 86),
    ([700, 0, 1, 129, 1024, 77, 0, 300], [64, 8, 16, 32, 16, 64, 8, 8], 4096, 4096, torch.bfloat16, True, 0),
    ([100, 37, 500], [128, 8, 16], 1024, 640, torch.bfloat16, False, 20),   # rank 128: four rank blocks
    ([33, 0, 250, 5], [8, 16, 64, 16], 200, 136, torch.float32, True, 7),
]


@pytest.fixture
def tma_store(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The TMA store for this test (FORM is read at each store launch), its launches counted."""
    monkeypatch.setattr(sl, "FORM", "tma")
    launches: list[int] = []
    jit = sl._lora_store_tma_jit

    class Counted:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            launches.append(1)
            return jit[grid]

    monkeypatch.setattr(sl, "_lora_store_tma_jit", Counted())
    return launches


@pytest.mark.parametrize("idx", range(len(CASES)))
def test_tma_store_matches_fp64(idx: int, tma_store: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    counts, ranks, d_in, d_out, dtype, bias, pad = CASES[idx]
    c = make_case(counts, ranks, d_in, d_out, dtype=dtype, bias=bias, pad_rows=pad, device="cuda")
    want = oracle_fp64(c)
    got = run_op(c, multilora_linear_fused, gemm="cublas")
    for name, err in rel_errors(got, want).items():
        assert err < TOL[dtype], (name, err)
    assert len(tma_store) == 2  # the forward's store and the backward's dX store
    monkeypatch.setattr(fl, "GEMM_DEFAULT", "cublas")
    got, stray = run_arena(c, multilora_linear_arena_fused, aligned=True)
    for name, err in rel_errors(got, want).items():
        assert err < TOL[dtype], ("arena", name, err)
    assert stray == 0
    assert len(tma_store) == 4
