"""The warp-specialised Gluon GEMM (kernels/ws_gemm.py) on a Hopper device: every variant, both B layouts, with and
without the LoRA term and a bias, against a float64 reference; the row tiles past the live rows hold zeros, the
rows inside them are exact whatever the live count; adapters of rank 0, of no rows, and several in one row tile; a
CUDA graph replays it with another live count written into its device scalar. Skipped without a Hopper GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="needs a Hopper (sm_90) device")

from kernels import ws_gemm  # noqa: E402

TOL = 1e-2


def _case(m: int, k: int, nc: int, counts: list[int], ranks: list[int], b_nk: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    a = torch.randn(m, k, device=dev, dtype=bf, generator=g)
    b = torch.randn(nc, k, device=dev, dtype=bf, generator=g) if b_nk else torch.randn(k, nc, device=dev, dtype=bf,
                                                                                          generator=g)
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), device=dev, dtype=torch.int64)
    r_max = max(max(ranks), 16)
    p = torch.randn(m, r_max, device=dev, dtype=torch.float32, generator=g) * 0.3
    woff, pieces, pos = [], [], 0
    for r in ranks:
        woff.append(pos)
        block = torch.randn(r * nc, device=dev, dtype=bf, generator=g) * 0.3
        pieces += [block, torch.zeros(-(r * nc) % 16 + 16, device=dev, dtype=bf)]
        pos += block.numel() + pieces[-1].numel()
    arena = torch.cat(pieces)
    ranks_t = torch.tensor(ranks, device=dev, dtype=torch.int64)
    scales = torch.tensor([0.5 + i for i in range(len(ranks))], device=dev, dtype=torch.float32)
    return a, b, p, arena, torch.tensor(woff, device=dev, dtype=torch.int64), offsets, ranks_t, scales, r_max


def _reference(a, b, b_nk, bias, lora, live):  # noqa: ANN001
    out = a[:live].double() @ (b.double().t() if b_nk else b.double())
    if bias is not None:
        out += bias.double()
    if lora is not None:
        p, arena, woff, offsets, ranks, scales = lora[:6]
        nc = out.shape[1]
        for i, r in enumerate(ranks.tolist()):
            lo, hi = int(offsets[i]), min(int(offsets[i + 1]), live)
            if r and hi > lo:
                w = arena[int(woff[i]): int(woff[i]) + r * nc].view(r, nc).double()
                out[lo:hi] += float(scales[i]) * (p[lo:hi, :r].double() @ w)
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("variant", sorted(ws_gemm.VARIANTS))
@pytest.mark.parametrize("b_nk", [True, False])
@pytest.mark.parametrize("with_lora", [False, True])
def test_each_variant_matches_float64(variant: str, b_nk: bool, with_lora: bool) -> None:
    # 700 live rows of 1,000: row tiles 0-5 live (the sixth partly), the rest zeros; NC not a tile multiple;
    # adapter 1 owns no rows, adapter 3 has rank 0, adapters 0 and 2 share a row tile
    counts, ranks = [70, 0, 500, 100, 30], [16, 8, 64, 0, 32]
    m, k, nc = 1000, 512, 1000
    a, b, p, arena, woff, offsets, ranks_t, scales, r_max = _case(m, k, nc, counts, ranks, b_nk)
    live = int(offsets[-1])
    bias = torch.randn(nc, device="cuda", dtype=torch.bfloat16) if with_lora else None
    lora = (p, arena, woff, offsets, ranks_t, scales, r_max, 32) if with_lora else None
    out = torch.full((m, nc), float("nan"), device="cuda", dtype=torch.bfloat16)
    ws_gemm.ws_gemm(a, b, out, b_nk, offsets[-1:], variant=variant, bias=bias, lora=lora)
    torch.cuda.synchronize()
    assert _rel(out[:live], _reference(a, b, b_nk, bias, lora, live)) < TOL
    bm = ws_gemm.VARIANTS[variant][0]
    tiles_end = -(-live // bm) * bm
    assert not out[:tiles_end].isnan().any()
    assert (out[tiles_end:] == 0).all()


def test_a_captured_graph_follows_the_live_rows_written_into_its_scalar() -> None:
    m, k, nc = 768, 256, 512
    a, b, p, arena, woff, offsets, ranks_t, scales, r_max = _case(m, k, nc, [300, 300], [16, 32], True, seed=1)
    lora = (p, arena, woff, offsets, ranks_t, scales, r_max, 32)
    out = torch.empty(m, nc, device="cuda", dtype=torch.bfloat16)
    ws_gemm.ws_gemm(a, b, out, True, offsets[-1:], variant="pingpong", lora=lora)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ws_gemm.ws_gemm(a, b, out, True, offsets[-1:], variant="pingpong", lora=lora)
    for counts in ([300, 300], [500, 200], [40, 10]):
        offsets.copy_(torch.tensor([0, counts[0], sum(counts)], device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        live = sum(counts)
        assert _rel(out[:live], _reference(a, b, True, None, lora, live)) < TOL
        assert (out[-(-live // 128) * 128:] == 0).all()


@pytest.mark.parametrize("variant", ["pingpong", "coop"])
@pytest.mark.parametrize("aligned", [True, False])
def test_the_fused_operator_on_the_gluon_gemm_matches_the_oracle(monkeypatch: pytest.MonkeyPatch, variant: str,
                                                                 aligned: bool) -> None:
    """The product's path ($LORAPLEX_WS_GEMM): forward and backward of the arena operator, its GEMMs on this kernel,
    against the float64 oracle; NaN gaps between the arena's blocks poison any read outside an adapter's block."""
    from kernels import fused_lora as fl
    from kernels.testing import make_case, oracle_fp64, rel_errors, run_arena

    monkeypatch.setattr(fl, "WS_GEMM", variant)
    monkeypatch.setattr(fl, "WS_MIN_WIDTH", 0)
    calls = []
    real = ws_gemm.ws_gemm
    monkeypatch.setattr(ws_gemm, "ws_gemm", lambda *a, **k: calls.append(k["variant"]) or real(*a, **k))
    case = make_case(counts=[300, 0, 517, 90], ranks=[16, 8, 64, 32], d_in=1024, d_out=776, dtype=torch.bfloat16,
                     device="cuda", seed=3)
    got, stray = run_arena(case, fl.multilora_linear_arena_fused, aligned=aligned)
    errors = rel_errors(got, oracle_fp64(case, device="cuda"))
    assert stray == 0 and max(errors.values()) < 1.5e-2, errors
    assert calls and set(calls) == {variant}
