"""GPU correctness of the Triton multi-LoRA kernels: bf16/fp16/fp32 vs a float64 oracle.

Skipped without CUDA. Shapes include the benchmark's (4096, 14336), ragged and empty adapters.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from kernels import multilora_linear, multilora_linear_arena  # noqa: E402
from kernels.testing import (  # noqa: E402
    empty_adapter_grad_nonzero,
    make_case,
    oracle_fp64,
    padding_grad_nonzero,
    rel_errors,
    run_arena,
    run_op,
)

TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-5}

CASES = [
    # counts, ranks, d_in, d_out, dtype
    ([1024] * 8, [16] * 8, 4096, 4096, torch.bfloat16),
    ([256] * 32, [16, 32, 64, 16] * 8, 4096, 14336, torch.bfloat16),
    ([700, 0, 1, 129, 1024, 77, 0, 300], [64, 8, 16, 32, 16, 64, 8, 8], 14336, 4096, torch.bfloat16),
    ([33, 0, 250, 5], [8, 16, 64, 16], 1000, 777, torch.float16),
    ([33, 0, 250, 5], [8, 16, 64, 16], 200, 136, torch.float32),
]


@pytest.mark.parametrize("idx", range(len(CASES)))
def test_triton_matches_fp64(idx: int) -> None:
    counts, ranks, d_in, d_out, dtype = CASES[idx]
    case = make_case(counts, ranks, d_in, d_out, dtype=dtype, device="cuda", bias=random.random() < 0.5)
    got = run_op(case, multilora_linear)  # "auto" must pick Triton here
    errs = rel_errors(got, oracle_fp64(case, device="cuda"))
    assert all(e <= TOL[dtype] for e in errs.values()), f"{errs} for {case.describe()}"
    assert padding_grad_nonzero(got, case.ranks) == 0, case.describe()
    assert empty_adapter_grad_nonzero(got, case.offsets) == 0, case.describe()


def test_no_host_sync_after_warmup() -> None:
    case = make_case([100, 0, 60], [16, 8, 64], 512, 384, dtype=torch.bfloat16, device="cuda")
    run_op(case, multilora_linear)  # compile + autotune (these sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run_op(case, multilora_linear)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(got["y"]).all()


@pytest.mark.parametrize("idx", range(len(CASES)))
def test_triton_arena_matches_fp64(idx: int) -> None:
    """The arena form the engine calls: blocks in shuffled order with NaN gaps, gradients added
    to prior sums, nothing outside the blocks written."""
    counts, ranks, d_in, d_out, dtype = CASES[idx]
    case = make_case(counts, ranks, d_in, d_out, dtype=dtype, device="cuda", bias=random.random() < 0.5)
    got, stray = run_arena(case, multilora_linear_arena)
    errs = rel_errors(got, oracle_fp64(case, device="cuda"))
    assert all(e <= TOL[dtype] for e in errs.values()), f"{errs} for {case.describe()}"
    assert stray == 0 and empty_adapter_grad_nonzero(got, case.offsets) == 0, case.describe()


@pytest.mark.parametrize("form", ["compose", "fused"])
def test_arena_no_host_sync_after_warmup(form: str) -> None:
    case = make_case([100, 0, 60], [16, 8, 64], 512, 384, dtype=torch.bfloat16, device="cuda")
    run_arena(case, multilora_linear_arena, form=form)  # compile + autotune (these sync)
    torch.cuda.synchronize()
    n, d_in, r_max = case.lora_a.shape
    arena = torch.randn(20 * (d_in + 384) * 64, device="cuda", dtype=torch.bfloat16)
    grad = torch.zeros(arena.shape, device="cuda", dtype=torch.float32)
    a_off = torch.tensor([0, 64 * (d_in + 384), 2 * 64 * (d_in + 384)], device="cuda")
    b_off = a_off + 64 * d_in
    x = case.x.clone().requires_grad_()
    token = torch.zeros((), device="cuda", requires_grad=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = multilora_linear_arena(x, case.weight, case.bias, arena, grad, a_off, b_off, case.scales, case.ranks,
                                   case.offsets, r_max, token, form=form)
        y.backward(case.dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(y).all() and torch.isfinite(grad).all() and grad.abs().sum() > 0


# ----- the fused form (kernels.fused_lora): LoRA terms in the Triton GEMMs' epilogues -----
FUSED_CASES = CASES + [
    ([512, 0, 256, 96], [24, 8, 40, 64], 4096, 4096, torch.bfloat16),  # ranks not powers of two
]


@pytest.mark.parametrize("onepass", [True, False])
@pytest.mark.parametrize("idx", range(len(FUSED_CASES)))
def test_fused_matches_fp64(idx: int, onepass: bool) -> None:
    from kernels.fused_lora import multilora_linear_fused

    counts, ranks, d_in, d_out, dtype = FUSED_CASES[idx]
    case = make_case(counts, ranks, d_in, d_out, dtype=dtype, device="cuda", bias=random.random() < 0.5)
    got = run_op(case, multilora_linear_fused, onepass=onepass)
    errs = rel_errors(got, oracle_fp64(case, device="cuda"))
    assert all(e <= TOL[dtype] for e in errs.values()), f"{errs} for {case.describe()}"
    assert padding_grad_nonzero(got, case.ranks) == 0, case.describe()
    assert empty_adapter_grad_nonzero(got, case.offsets) == 0, case.describe()


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("idx", range(len(FUSED_CASES)))
def test_fused_arena_matches_fp64(idx: int, aligned: bool) -> None:
    """The engine's arena form through the public entry point with form="fused"; aligned: every
    block at a 16-element offset, vouched for (the kernels' vector loads where the shape allows)."""
    counts, ranks, d_in, d_out, dtype = FUSED_CASES[idx]
    case = make_case(counts, ranks, d_in, d_out, dtype=dtype, device="cuda", bias=random.random() < 0.5)
    got, stray = run_arena(case, multilora_linear_arena, form="fused", aligned=aligned)
    errs = rel_errors(got, oracle_fp64(case, device="cuda"))
    assert all(e <= TOL[dtype] for e in errs.values()), f"{errs} for {case.describe()}"
    assert stray == 0 and empty_adapter_grad_nonzero(got, case.offsets) == 0, case.describe()



@pytest.mark.parametrize("variant", ["ptr+pf", "tma", "tma+pf", "persist", "persist+pf", "cublas", "auto"])
@pytest.mark.parametrize("idx", [0, 2])
def test_fused_gemm_variants_match_fp64(idx: int, variant: str) -> None:
    """Every fused GEMM variant (TMA main loops, persistent programs, prefetched epilogue
    operands) against the fp64 oracle; TMA variants must really take the TMA path here."""
    from kernels import fused_lora

    counts, ranks, d_in, d_out, dtype = FUSED_CASES[idx]
    case = make_case(counts, ranks, d_in, d_out, dtype=dtype, device="cuda", bias=random.random() < 0.5)
    if variant not in ("ptr+pf", "cublas"):
        assert fused_lora._tma_ok(case.x, case.weight.t()) and fused_lora._tma_ok(case.dy, case.weight)
    got = run_op(case, fused_lora.multilora_linear_fused, gemm=variant)
    errs = rel_errors(got, oracle_fp64(case, device="cuda"))
    assert all(e <= TOL[dtype] for e in errs.values()), f"{errs} for {case.describe()}"


@pytest.mark.parametrize("variant", ["tma", "persist", "persist+pf", "cublas", "auto"])
@pytest.mark.parametrize(("counts", "ranks", "pad"), [
    ([700, 0, 129, 77], [64, 8, 32, 16], 430),    # a step's padding tail, row tiles wholly past it
    ([1024, 384], [16, 64], 0),                   # no padding
    ([0, 0], [16, 64], 300),                      # nothing but padding
])
def test_rows_past_the_last_adapter_are_padding(counts: list[int], ranks: list[int], pad: int, variant: str) -> None:
    """offsets[N] < T (a graphed step's padding, which no job owns; its upstream gradient zero):
    every GEMM variant matches the fp64 oracle on the adapters' rows and their gradients; the
    persistent one stores zeros in the row tiles wholly past the last adapter's rows, the others
    the base output (the oracle's)."""
    from kernels import fused_lora

    case = make_case(counts, ranks, 4096, 14336, dtype=torch.bfloat16, device="cuda", bias=True, pad_rows=pad)
    want = oracle_fp64(case, device="cuda")
    runs = [(run_op(case, fused_lora.multilora_linear_fused, gemm=variant), 0)]
    fused_lora.GEMM_DEFAULT = variant  # the arena form takes the process default
    try:
        runs.append(run_arena(case, multilora_linear_arena, form="fused", aligned=True))
    finally:
        fused_lora.GEMM_DEFAULT = None
    live = int(case.offsets[-1])
    for got, stray in runs:
        tail = got["y"][live:]
        if variant.startswith("persist"):  # zeros from the first row tile wholly past (tiles of 64-256 rows)
            assert bool((tail[-(-live // 256) * 256 - live:] == 0).all())
        if variant.startswith("persist") or variant == "auto":  # "auto": persist's zeros or the base output
            got["y"] = torch.cat([got["y"][:live], want["y"][live:].to(got["y"].dtype)])
        errs = rel_errors(got, want)
        assert all(e <= TOL[torch.bfloat16] for e in errs.values()), f"{errs} for {case.describe()}"
        assert stray == 0 and empty_adapter_grad_nonzero(got, case.offsets) == 0, case.describe()


# Every small-step launch configuration of the fused form's LoRA passes (session 40's and session 52's taller and
# deeper tiles), forced one by one on the arena form at a 2-job step's layout against the float64 oracle; and dA on
# a side stream ($LORAPLEX_DA_SIDE_STREAM), eagerly and inside a capture.

def _small(kernel) -> list:  # noqa: ANN001
    from kernels import fused_lora

    small = {"shrink": "_SMALL_SHRINK", "shrink_wgrad": "_SMALL_SHRINK", "wgrad": "_SMALL_WGRAD"}[kernel.name]
    return list(getattr(fused_lora, small, []))


@pytest.mark.parametrize(("counts", "ranks", "pad", "d_in", "d_out"), [
    ([290, 1160], [16, 64], 0, 4096, 14336),
    ([290, 1160], [16, 64], 86, 14336, 4096),   # a 1,536-row graph key's padding tail
    ([61, 1003], [64, 16], 20, 4096, 1024),
])
def test_every_small_step_configuration_matches_fp64(counts: list[int], ranks: list[int], pad: int, d_in: int,
                                                     d_out: int) -> None:
    from kernels import fused_lora

    kernels = (fused_lora._shrink, fused_lora._shrink_wgrad, fused_lora._wgrad)
    lists = [_small(k) for k in kernels]
    assert all(lists), "the small-step candidates exist on a GPU"
    case = make_case(counts, ranks, d_in, d_out, dtype=torch.bfloat16, device="cuda", bias=False, pad_rows=pad)
    want = oracle_fp64(case, device="cuda")
    live = int(case.offsets[-1])
    checked = 0
    for i in range(max(len(cands) for cands in lists)):
        chosen = [cands[i % len(cands)] for cands in lists]
        for k, cfg in zip(kernels, chosen, strict=True):
            k.choose = lambda *_a, _cfg=cfg, **_k: _cfg
        try:
            got, stray = run_arena(case, multilora_linear_arena, form="fused", aligned=True)
        finally:
            for k in kernels:
                del k.choose
        got["y"], got["dx"] = got["y"][:live], got["dx"][:live]
        errs = rel_errors(got, {**want, "y": want["y"][:live], "dx": want["dx"][:live]})
        assert all(e <= TOL[torch.bfloat16] for e in errs.values()), f"{errs} with {[c.kwargs for c in chosen]} for {case.describe()}"
        assert stray == 0 and empty_adapter_grad_nonzero(got, case.offsets) == 0
        checked += 1
    assert checked == max(len(cands) for cands in lists)


@pytest.mark.parametrize("form", ["arena", "stacked"])
def test_da_on_a_side_stream_matches_fp64_eager_and_captured(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """$LORAPLEX_DA_SIDE_STREAM: dA runs on a side stream beside the dX GEMM, eagerly and inside a CUDA graph
    capture (a second branch of the graph); outputs and every gradient match the float64 oracle either way, and
    the side stream is the one that ran it."""
    from kernels import fused_lora

    monkeypatch.setattr(fused_lora, "DA_SIDE_STREAM", True)
    streams = []  # the stream each dA launch ran on
    own_launch = fused_lora._wgrad_launch

    def spy(c, p, *rest):  # noqa: ANN001, ANN002, ANN202
        if p.dtype == torch.float32 and rest[0].shape[1] == 4096:  # dA: dS (fp32) against X
            streams.append(torch.cuda.current_stream())
        return own_launch(c, p, *rest)

    monkeypatch.setattr(fused_lora, "_wgrad_launch", spy)
    case = make_case([290, 1160], [16, 64], 4096, 4096, dtype=torch.bfloat16, device="cuda", bias=False, pad_rows=86)
    want = oracle_fp64(case, device="cuda")
    live = int(case.offsets[-1])

    def check(got: dict) -> None:
        got = {**got, "y": got["y"][:live], "dx": got["dx"][:live]}
        errs = rel_errors(got, {**want, "y": want["y"][:live], "dx": want["dx"][:live]})
        assert all(e <= TOL[torch.bfloat16] for e in errs.values()), f"{errs} for {case.describe()}"

    if form == "arena":
        got, stray = run_arena(case, multilora_linear_arena, form="fused", aligned=True)
        check(got)
        assert stray == 0
    else:
        x = case.x.detach().clone().requires_grad_(True)
        a = case.lora_a.detach().clone().requires_grad_(True)
        b = case.lora_b.detach().clone().requires_grad_(True)

        def run() -> torch.Tensor:  # the process default GEMM variant ("auto" on Hopper), as the engine runs
            y = fused_lora.multilora_linear_fused(x, case.weight, None, a, b, case.scales, case.ranks, case.offsets)
            y.backward(case.dy)
            return y

        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):  # eager, and it compiles and loads outside the capture
            y = run()
        torch.cuda.current_stream().wait_stream(warm)
        torch.cuda.synchronize()
        check({"y": y.detach(), "dx": x.grad, "dA": a.grad, "dB": b.grad})
        x.grad = a.grad = b.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="relaxed"):  # the step graphs' mode
            y = run()
        graph.replay()
        torch.cuda.synchronize()
        check({"y": y, "dx": x.grad, "dA": a.grad, "dB": b.grad})
    side = fused_lora._SIDE_STREAMS[torch.cuda.current_device()]
    assert streams and all(s == side for s in streams), "every dA launch ran on the side stream"
