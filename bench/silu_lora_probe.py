"""Probe: the MLP's 14336-wide LoRA terms folded into the SiLU-gate kernels instead of stored for cuBLAS.

A 2-job step's GEMMs spend ~50 us more than cuBLAS alone on each 14336-wide output that carries a LoRA term:
gate's and up's forward, and down's dX (bench/results/raw/gemm_tail_s58_call2_h200.md, "auto" against "cuBLAS
alone" at 1,536 rows). The store pass writes the term as a full [T, 14336] output and cuBLAS reads it back as C.
Every one of those outputs is read next by the SiLU-gate kernel: forward silu(g) * u, backward from dh. This probe
measures what folding the terms in there would give, on one layer's MLP, before any engine change:

  today   forward:  g = store(s S_g B_g) + X W_g^T; u likewise (kernels.fused_lora, variant "cublas" or "auto");
                    h = silu_mul(g, u) (kernels.norm_act)
          backward: dh = store(s dS_d A_d) + dY W_d (down's dX, the same variants); dg, du = silu_mul's backward
  folded  forward:  g0 = X W_g^T, u0 = X W_u^T (cuBLAS, beta 0); h from one kernel that adds s S_g B_g and
                    s S_u B_u to its tiles of g0 and u0 (P loaded once per adapter row tile, B_i's tile per column
                    block, one dot each) and applies silu * u
          backward: dh0 = dY W_d (cuBLAS); one kernel adds s dS_d A_d to dh0's tile, recomputes g and u as the
                    forward did (g0, u0 kept, not g and u), and writes dg, du

Both sides are checked against float64 in the same run (h, dg, du; the gate/up LoRA backward passes after them are
the same in both and are not timed). Times are CUDA-graph medians; "per step" is 32 layers. Rounding: folded rounds
g = bf16(g0 + term) where today rounds bf16(X W^T + bf16(term)); both are within bf16 of float64.

    python3 bench/silu_lora_probe.py [--layout 290x16,1160x64] [--pad-to 1536] [--out FILE.md]
    TRITON_INTERPRET=1 python3 bench/silu_lora_probe.py --check   # the folded kernels against float64 on the CPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))



@triton.jit
def _setup(T, F, off_ptr, rank_ptr, scale_ptr, N, R_MAX, N_P2: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr):
    """This program's rows: one adapter's row tile (clipped at its end) or a tile of the padding past the last
    adapter (rank 0: no term), and its columns [c0, c_end) (none where it has no rows). Returns (adapter or 0,
    rows as int64, row mask, rank, scale, c0, c_end)."""
    idx = tl.arange(0, N_P2)
    live = idx < N
    lo = tl.load(off_ptr + idx, mask=live, other=0).to(tl.int32)
    hi = tl.load(off_ptr + idx + 1, mask=live, other=0).to(tl.int32)
    n_items = tl.where(live, (hi - lo + BLOCK_M - 1) // BLOCK_M, 0)
    end = tl.cumsum(n_items, 0)
    start = end - n_items
    total = tl.sum(n_items, 0)
    pid = tl.program_id(0)
    hit = live & (pid >= start) & (pid < end)
    owned = pid < total
    ad = tl.maximum(tl.max(tl.where(hit, idx, -1), 0), 0)
    m_live = tl.max(tl.where(live, hi, 0), 0)
    row_start = tl.where(owned, tl.sum(tl.where(hit, lo + (pid - start) * BLOCK_M, 0), 0),
                         m_live + (pid - total) * BLOCK_M)
    row_end = tl.minimum(tl.where(owned, tl.sum(tl.where(hit, hi, 0), 0), T), T)
    rank = tl.where(owned, tl.minimum(tl.load(rank_ptr + ad).to(tl.int32), R_MAX), 0)
    scale = tl.load(scale_ptr + ad).to(tl.float32)
    rows = row_start + tl.arange(0, BLOCK_M)
    width = tl.cdiv(tl.cdiv(F, SPLIT_N), BLOCK_N) * BLOCK_N
    first = tl.program_id(1) * width
    last = tl.where(row_start < row_end, tl.minimum(first + width, F), first)
    return ad.to(tl.int64), rows.to(tl.int64), rows < row_end, rank, scale, first, last


@triton.jit
def _p_tile(p_ptr, rows64, row_mask, rr, rank, R_MAX, stride_pm, scale, dtype: tl.constexpr):
    pt = tl.load(p_ptr + rows64[:, None] * stride_pm + rr[None, :], mask=row_mask[:, None] & (rr < R_MAX)[None, :],
                 other=0.0)
    return (tl.where((rr < rank)[None, :], pt, 0.0) * scale).to(dtype)


@triton.jit
def _term(acc, pt, w_base, rr, rank, cols, c_mask, stride_wr):
    wt = tl.load(w_base + rr[:, None] * stride_wr + cols[None, :], mask=(rr < rank)[:, None] & c_mask[None, :],
                 other=0.0)
    return tl.dot(pt, wt, acc)


@triton.jit
def _gu(g_ptr, u_ptr, at, mask, pg, pu, bg, bu, rr, rank, cols, c_mask, stride_wr, dtype: tl.constexpr):
    """g = g0 + s S_g B_g and u likewise on one tile, each rounded to the activations' dtype."""
    g = _term(tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32), pg, bg, rr, rank, cols, c_mask, stride_wr)
    u = _term(tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32), pu, bu, rr, rank, cols, c_mask, stride_wr)
    return g.to(dtype).to(tl.float32), u.to(dtype).to(tl.float32)


@triton.jit
def _gate_up_p(pg_ptr, pu_ptr, rows64, row_mask, rank, R_MAX, stride_pm, scale, dtype: tl.constexpr,
               BLOCK_R: tl.constexpr):
    """The rank columns and this row tile's scaled S_g and S_u (every rank in one block)."""
    rr = tl.arange(0, BLOCK_R)
    return (rr, _p_tile(pg_ptr, rows64, row_mask, rr, rank, R_MAX, stride_pm, scale, dtype),
            _p_tile(pu_ptr, rows64, row_mask, rr, rank, R_MAX, stride_pm, scale, dtype))


@triton.jit
def _col_tile(n0, F, rows64, row_mask, stride_t, BLOCK_N: tl.constexpr):
    """One column tile's columns, their mask, the tile's mask and its offsets into the [T, F] activations."""
    cols = n0 + tl.arange(0, BLOCK_N)
    c_mask = cols < F
    return cols, c_mask, row_mask[:, None] & c_mask[None, :], rows64[:, None] * stride_t + cols[None, :]


@triton.jit
def _silu_lora_fwd(g_ptr, u_ptr, h_ptr, pg_ptr, pu_ptr, bg_ptr, bu_ptr, off_ptr, rank_ptr, scale_ptr,
                   T, F, N, R_MAX, stride_t, stride_pm, stride_wn, stride_wr,
                   N_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   SPLIT_N: tl.constexpr):
    ad, rows64, row_mask, rank, scale, c0, c_end = _setup(T, F, off_ptr, rank_ptr, scale_ptr, N, R_MAX, N_P2,
                                                          BLOCK_M, BLOCK_N, SPLIT_N)
    dtype = g_ptr.dtype.element_ty
    rr, pg, pu = _gate_up_p(pg_ptr, pu_ptr, rows64, row_mask, rank, R_MAX, stride_pm, scale, dtype, BLOCK_R)
    bg, bu = bg_ptr + ad * stride_wn, bu_ptr + ad * stride_wn
    for n0 in range(c0, c_end, BLOCK_N):
        cols, c_mask, mask, at = _col_tile(n0, F, rows64, row_mask, stride_t, BLOCK_N)
        g, u = _gu(g_ptr, u_ptr, at, mask, pg, pu, bg, bu, rr, rank, cols, c_mask, stride_wr, dtype)
        a = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
        tl.store(h_ptr + at, (a * u).to(dtype), mask=mask)


@triton.jit
def _silu_lora_bwd(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, pd_ptr, ad_ptr, pg_ptr, pu_ptr, bg_ptr, bu_ptr,
                   off_ptr, rank_ptr, scale_ptr, T, F, N, R_MAX, stride_t, stride_pm, stride_wn, stride_wr,
                   N_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   SPLIT_N: tl.constexpr):
    ad, rows64, row_mask, rank, scale, c0, c_end = _setup(T, F, off_ptr, rank_ptr, scale_ptr, N, R_MAX, N_P2,
                                                          BLOCK_M, BLOCK_N, SPLIT_N)
    dtype = g_ptr.dtype.element_ty
    rr, pg, pu = _gate_up_p(pg_ptr, pu_ptr, rows64, row_mask, rank, R_MAX, stride_pm, scale, dtype, BLOCK_R)
    pd = _p_tile(pd_ptr, rows64, row_mask, rr, rank, R_MAX, stride_pm, scale, dtype)
    bg, bu, wd = bg_ptr + ad * stride_wn, bu_ptr + ad * stride_wn, ad_ptr + ad * stride_wn
    for n0 in range(c0, c_end, BLOCK_N):
        cols, c_mask, mask, at = _col_tile(n0, F, rows64, row_mask, stride_t, BLOCK_N)
        dh = _term(tl.load(dh_ptr + at, mask=mask, other=0.0).to(tl.float32), pd, wd, rr, rank, cols, c_mask,
                   stride_wr).to(dtype).to(tl.float32)
        g, u = _gu(g_ptr, u_ptr, at, mask, pg, pu, bg, bu, rr, rank, cols, c_mask, stride_wr, dtype)
        s = tl.sigmoid(g)
        a = (g * s).to(dtype).to(tl.float32)
        da = (dh * u).to(dtype).to(tl.float32)
        tl.store(du_ptr + at, (dh * a).to(dtype), mask=mask)
        tl.store(dg_ptr + at, (da * s * (1.0 + g * (1.0 - s))).to(dtype), mask=mask)


def _launch_args(t: int, n: int, r_max: int, tile: list[int]) -> tuple[tuple, dict]:
    block_m, block_n, warps, split = tile
    grid = (2 * triton.cdiv(t, block_m) + n, split)
    meta = dict(N_P2=max(16, triton.next_power_of_2(n)), BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_R=max(16, triton.next_power_of_2(r_max)), SPLIT_N=split, num_warps=warps)
    return grid, meta


def folded_forward(g0, u0, pg, pu, bg, bu, off, ranks, scales, r_max: int, tile: list[int]):  # noqa: ANN001, ANN201
    """h = silu(g0 + s S_g B_g) * (u0 + s S_u B_u), each sum rounded to g0's dtype first (B_* [N, R, F]; tile:
    BLOCK_M, BLOCK_N, warps, SPLIT_N)."""
    t, f = g0.shape
    h = torch.empty_like(g0)
    grid, meta = _launch_args(t, len(ranks), r_max, tile)
    _silu_lora_fwd[grid](g0, u0, h, pg, pu, bg, bu, off, ranks, scales, t, f, len(ranks), r_max, g0.stride(0),
                         pg.stride(0), bg.stride(0), bg.stride(1), **meta)
    return h


def folded_backward(dh0, g0, u0, pd, a_d, pg, pu, bg, bu, off, ranks, scales, r_max: int,  # noqa: ANN001, ANN201
                    tile: list[int]):
    """(dg, du) of h from dh = dh0 + s dS_d A_d (A_d [N, R, F] rank-major), g and u recomputed as forward."""
    t, f = g0.shape
    dg, du = torch.empty_like(g0), torch.empty_like(u0)
    grid, meta = _launch_args(t, len(ranks), r_max, tile)
    _silu_lora_bwd[grid](dh0, g0, u0, dg, du, pd, a_d, pg, pu, bg, bu, off, ranks, scales, t, f, len(ranks), r_max,
                         g0.stride(0), pg.stride(0), bg.stride(0), bg.stride(1), **meta)
    return dg, du


def reference(x, wg, wu, wd, dy, pg, pu, pd, bg, bu, a_d, off, ranks, scales):  # noqa: ANN001, ANN201
    """float64 h, dg, du (dh = dY W_d + s dS_d A_d; g = X W_g^T + s S_g B_g; u likewise)."""
    d = torch.float64

    def term(p, w):  # noqa: ANN001, ANN202
        out = torch.zeros(p.shape[0], w.shape[2], dtype=d, device=p.device)
        o = off.tolist()
        for i, r in enumerate(ranks.tolist()):
            out[o[i]:o[i + 1]] = float(scales[i]) * p[o[i]:o[i + 1], :r].to(d) @ w[i, :r].to(d)
        return out

    g = x.to(d) @ wg.to(d).t() + term(pg, bg)
    u = x.to(d) @ wu.to(d).t() + term(pu, bu)
    dh = dy.to(d) @ wd.to(d) + term(pd, a_d)
    s = torch.sigmoid(g)
    h = g * s * u
    return h, dh * u * s * (1 + g * (1 - s)), dh * g * s


def make(t_counts: list[int], ranks: list[int], pad: int, d: int, f: int, device: str, dtype: torch.dtype):  # noqa: ANN201
    torch.manual_seed(0)
    n, r_max = len(ranks), max(ranks)
    t = sum(t_counts) + pad
    off = torch.tensor([0] + torch.tensor(t_counts).cumsum(0).tolist(), dtype=torch.int32, device=device)
    kw = dict(device=device, dtype=dtype)
    x, dy = torch.randn(t, d, **kw), torch.randn(t, d, **kw) * 0.1
    wg, wu = torch.randn(f, d, **kw) * d ** -0.5, torch.randn(f, d, **kw) * d ** -0.5
    wd = torch.randn(d, f, **kw) * f ** -0.5
    # rank-major LoRA factors [N, R, F]: B_g, B_u (forward expands), A_d (down's A, for dX's dS A)
    bg, bu, a_d = (torch.randn(n, r_max, f, **kw) * 0.05 for _ in range(3))
    pg, pu, pd = (torch.randn(t, r_max, device=device, dtype=torch.float32) for _ in range(3))
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=device)
    scales = torch.tensor([2.0 / r for r in ranks], dtype=torch.float32, device=device)
    return dict(x=x, dy=dy, wg=wg, wu=wu, wd=wd, bg=bg, bu=bu, a_d=a_d, pg=pg, pu=pu, pd=pd, off=off, ranks=ranks_t,
                scales=scales, r_max=r_max)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def check_cpu() -> None:
    """The folded kernels against float64 on small shapes (interpreter): padding, an empty adapter, ranks 8-64."""
    worst = 0.0
    for counts, ranks, pad, tile in (([5, 0, 17, 30], [8, 64, 24, 16], 7, [16, 32, 4, 3]),
                                     ([29, 116], [16, 64], 9, [32, 16, 4, 1])):
        m = make(counts, ranks, pad, 24, 40, "cpu", torch.float32)
        g0, u0 = m["x"] @ m["wg"].t(), m["x"] @ m["wu"].t()
        dh0 = m["dy"] @ m["wd"]
        args = (m["pg"], m["pu"], m["bg"], m["bu"], m["off"], m["ranks"], m["scales"], m["r_max"])
        h = folded_forward(g0, u0, *args, tile=tile)
        dg, du = folded_backward(dh0, g0, u0, m["pd"], m["a_d"], *args, tile=tile)
        want = reference(m["x"], m["wg"], m["wu"], m["wd"], m["dy"], m["pg"], m["pu"], m["pd"], m["bg"], m["bu"],
                         m["a_d"], m["off"], m["ranks"], m["scales"])
        errs = [_rel(a, b) for a, b in zip((h, dg, du), want, strict=True)]
        print(counts, pad, tile, " ".join(f"{e:.1e}" for e in errs))
        worst = max(worst, *errs)
    print(f"worst {worst:.1e}", "ok" if worst < 1e-5 else "FAILED")
    if worst >= 1e-5:
        raise SystemExit(1)


def measure(counts: list[int], ranks: list[int], pad: int, tiles: list[list[int]]) -> list[str]:
    from triton.testing import do_bench_cudagraph

    from kernels import fused_lora as fl
    from kernels.norm_act import _SiluMul, silu_mul_backward

    m = make(counts, ranks, pad, 4096, 14336, "cuda", torch.bfloat16)
    n, r_max, x, dy = len(ranks), m["r_max"], m["x"], m["dy"]
    c = fl._Ctx(x, n, r_max, m["off"], m["ranks"], m["scales"])
    strides = lambda w: (w.stride(0), w.stride(1), w.stride(2))  # noqa: E731 (rank-major [N, R, F])
    want = reference(x, m["wg"], m["wu"], m["wd"], dy, m["pg"], m["pu"], m["pd"], m["bg"], m["bu"], m["a_d"],
                     m["off"], m["ranks"], m["scales"])
    args = (m["pg"], m["pu"], m["bg"], m["bu"], m["off"], m["ranks"], m["scales"], r_max)
    lines = ["| form | forward us | backward us | forward + backward us | per step ms (32 layers) | err h / dg / du |",
             "|---|---|---|---|---|---|"]

    def ms(fn) -> float:  # noqa: ANN001
        fn()
        torch.cuda.synchronize()
        return do_bench_cudagraph(fn, rep=100, return_mode="median")

    def row(name: str, fwd, bwd) -> None:  # noqa: ANN001
        h = fwd()
        dg, du = bwd()
        errs = [_rel(a, b) for a, b in zip((h, dg, du), want, strict=True)]
        f_us, b_us = ms(fwd) * 1e3, ms(bwd) * 1e3
        lines.append(f"| {name} | {f_us:.1f} | {b_us:.1f} | {f_us + b_us:.1f} | {(f_us + b_us) * 32 / 1e3:.2f} | "
                     + " / ".join(f"{e:.1e}" for e in errs) + " |")
        print(lines[-1], flush=True)

    def lora_out(a, w, p, lora, v):  # noqa: ANN001, ANN202 (today's GEMM with its LoRA term, variant v)
        return fl._gemm_launch(c, a, w, None, m[p], m[lora], strides(m[lora]), m["off"], 0, x.dtype, v)

    for variant in ("cublas", "auto"):
        def fwd(v=variant):  # noqa: ANN001, ANN202
            return _SiluMul.apply(lora_out(x, m["wg"].t(), "pg", "bg", v), lora_out(x, m["wu"].t(), "pu", "bu", v))

        # the backward as the step runs it: down's dX, then silu_mul's backward on the forward's g and u (made once)
        g, u = lora_out(x, m["wg"].t(), "pg", "bg", variant), lora_out(x, m["wu"].t(), "pu", "bu", variant)

        def bwd(v=variant, g=g, u=u):  # noqa: ANN001, ANN202
            return silu_mul_backward(lora_out(dy, m["wd"], "pd", "a_d", v), g, u)

        row(f"today, \"{variant}\"", fwd, bwd)
    g0, u0 = x @ m["wg"].t(), x @ m["wu"].t()
    for tile in tiles:
        def ffwd(tile=tile):  # noqa: ANN001, ANN202
            return folded_forward(x @ m["wg"].t(), x @ m["wu"].t(), *args, tile=tile)

        def fbwd(tile=tile):  # noqa: ANN001, ANN202
            return folded_backward(dy @ m["wd"], g0, u0, m["pd"], m["a_d"], *args, tile=tile)

        try:
            row(f"folded, tile {','.join(map(str, tile))}", ffwd, fbwd)
        except triton.runtime.errors.OutOfResources as exc:  # session 71: 64,256,8,8 asks 328 KiB of shared memory
            lines.append(f"| folded, tile {','.join(map(str, tile))} | does not fit: {str(exc)[:80]} | | | | |")

    def bare_fwd():  # noqa: ANN202
        return _SiluMul.apply(x @ m["wg"].t(), x @ m["wu"].t())

    def bare_bwd():  # noqa: ANN202
        return silu_mul_backward(dy @ m["wd"], g0, u0)

    row("cuBLAS + silu_mul, no LoRA term (the floor; its errors are the missing term's)", bare_fwd, bare_bwd)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="290x16,1160x64", help="rows x rank of each adapter")
    ap.add_argument("--pad-to", type=int, default=1536)
    ap.add_argument("--tiles", default="32,128,4,4;64,128,4,8;32,128,4,8;16,128,4,4;32,64,4,4",
                    help="BLOCK_M,BLOCK_N,warps,SPLIT_N of the folded kernels, ';' between")
    ap.add_argument("--check", action="store_true", help="the folded kernels against float64 on the CPU")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.check:
        check_cpu()
        return
    counts = [int(p.split("x")[0]) for p in a.layout.split(",")]
    ranks = [int(p.split("x")[1]) for p in a.layout.split(",")]
    pad = max(0, a.pad_to - sum(counts))
    tiles = [[int(v) for v in t.split(",")] for t in a.tiles.split(";")]
    lines = [f"# The MLP's 14336-wide LoRA terms folded into the SiLU-gate kernels ({torch.cuda.get_device_name()}; "
             f"torch {torch.__version__}, triton {triton.__version__}; bf16)", "",
             f"One layer's MLP (4096 -> 14336 gate/up, 14336 -> 4096 down) at {a.layout} + {pad} rows of padding; "
             "CUDA-graph medians; errors against float64 (relative to the largest value).", "",
             *measure(counts, ranks, pad, tiles)]
    text = "\n".join(lines)
    print(text, flush=True)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
