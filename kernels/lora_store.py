"""The "cublas" variant's store pass as a column sweep: out = s_i P[rows_i, :r_i] W_i (+ bias), for cuBLAS to add
the base GEMM onto (`kernels.fused_lora.store_launch`; $LORAPLEX_LORA_STORE=sweep).

The tile form (`fused_lora._lora_store`: the GEMM kernel's epilogue with K = 0) runs one program per output tile,
and each program's chain is serial: the adapters' metadata, then each rank block's P and W loads, a dot, the
store (session 57: a 4096-wide store 12.0 us against a 3.0 us bytes floor; every tile size measured slower than
the default). Here a program owns one adapter's row tile (or a tile of the rows no adapter owns) and a range of
columns: it loads that tile's P once (every rank in one block: BLOCK_R >= the call's largest rank), then sweeps
its columns, each step a W_i load (a few KiB, from L2), one dot and a store. The sweep is one plain loop, so the
compiler pipelines the next W_i loads under the current store; nothing in it depends on another adapter.

Work items: for adapter i, cdiv(t_i, BLOCK_M) row tiles clipped to its own rows (a tile never straddles two
adapters, so a rank-0 or empty adapter costs nothing and writes its rows as bias or zeros), then
cdiv(T - end, BLOCK_M) tiles of the rows past the last adapter's end (padding: bias or zeros, so cuBLAS adds onto
defined values). The grid's first axis is an upper bound (`items`); programs past the work list exit at once.
Axis 1 splits the columns into SPLIT_N ranges (more programs for the 132 SMs of a small step).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.triton_lora import _adapter_base

# "BLOCK_M,BLOCK_N,num_warps,SPLIT_N,num_stages" ($LORAPLEX_LORA_STORE_SWEEP); bench/lora_sweep.py --store --sweep
# times the candidates (SWEEP_TILES there) against the tile form: at a 2-job step's layout on an H200 (session 71)
# 64,128,4,8,3 stored a step's projections in 5.60 ms against the tile form's 6.80, yet the 200-step task was even
# with it (bench/results/session71_h200.md), so the tile form stays the default
SWEEP_TILE = [int(v) for v in os.environ.get("LORAPLEX_LORA_STORE_SWEEP", "64,128,4,8,3").split(",")]


@triton.jit
def _store_sweep_jit(
    out_ptr, bias_ptr, p_ptr, w_ptr, woff_ptr, off_ptr, rank_ptr, scale_ptr,
    T, NC, N, R_MAX, T_BUCKET,
    stride_om, stride_on, stride_pm, stride_wn, stride_wr, stride_wc,
    HAS_BIAS: tl.constexpr, N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, ARENA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_N: tl.constexpr,
):
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
    adapter = tl.max(tl.where(hit, idx, -1), 0)
    ad = tl.maximum(adapter, 0)
    m_live = tl.max(tl.where(live, hi, 0), 0)
    # an adapter's tile: its own rows from lo + k * BLOCK_M; else a padding tile past the last adapter's end
    row_start = tl.where(owned, tl.sum(tl.where(hit, lo + (pid - start) * BLOCK_M, 0), 0),
                         m_live + (pid - total) * BLOCK_M)
    row_end = tl.where(owned, tl.sum(tl.where(hit, hi, 0), 0), T)
    rank = tl.where(owned, tl.minimum(tl.load(rank_ptr + ad).to(tl.int32), R_MAX), 0)
    scale = tl.load(scale_ptr + ad).to(ACC)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = (rows < row_end) & (rows < T)
    rows64 = rows.to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    r_mask = rr < rank
    # P under a mask constant over R_MAX's aligned runs (16-byte loads), the columns past this rank zeroed after
    pt = tl.load(p_ptr + rows64[:, None] * stride_pm + rr[None, :],
                 mask=row_mask[:, None] & (rr < R_MAX)[None, :], other=0.0)
    pt = (tl.where(r_mask[None, :], pt, 0.0) * scale).to(w_ptr.dtype.element_ty)
    w_base = _adapter_base(w_ptr, ad.to(tl.int64), stride_wn, woff_ptr, ARENA)
    span = tl.cdiv(tl.cdiv(NC, SPLIT_N), BLOCK_N) * BLOCK_N
    c0 = tl.program_id(1) * span
    # no rows here (a spare program, or a tile past T): no sweep
    c_end = tl.where(row_start < tl.minimum(row_end, T), tl.minimum(c0 + span, NC), c0)
    out_rows = out_ptr + rows64[:, None] * stride_om
    for n0 in range(c0, c_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        c_mask = cols < NC
        wt = tl.load(w_base + rr[:, None] * stride_wr + cols[None, :] * stride_wc,
                     mask=r_mask[:, None] & c_mask[None, :], other=0.0)
        acc = tl.dot(pt, wt, tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC), input_precision=DOT_PREC)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=c_mask, other=0.0).to(ACC)[None, :]
        tl.store(out_rows + cols[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & c_mask[None, :])


def sweep_items(t: int, n: int, block_m: int) -> int:
    """The work list's upper bound: every adapter's row tiles (at most cdiv(t, BLOCK_M) + n, each adapter's last
    tile partial) and the padding's (at most cdiv(t, BLOCK_M))."""
    return 2 * triton.cdiv(t, block_m) + n


def sweep_store(c, out: torch.Tensor, bias, p, w, w_strides, woff, arena: int,  # noqa: ANN001
                tile: list[int] | None = None) -> None:
    """out = s_i P[rows_i, :r_i] W_i (+ bias) for every row of out (c: `fused_lora._Ctx`; W_i [r_i, NC] at
    `w_strides` (adapter, rank, column) from w, or the arena at woff)."""
    block_m, block_n, warps, split, stages = tile or SWEEP_TILE
    t, nc = out.shape
    block_r = max(16, triton.next_power_of_2(max(1, c.r_max)))
    grid = (sweep_items(t, c.n, block_m), split)
    _store_sweep_jit[grid](
        out, bias if bias is not None else out, p, w, woff, c.offsets, c.ranks, c.scales, t, nc, c.n, c.r_max,
        c.t_bucket, out.stride(0), out.stride(1), p.stride(0), *w_strides,
        HAS_BIAS=bias is not None, N_P2=c.n_p2, ACC=c.acc, DOT_PREC=c.prec, ARENA=arena, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_R=block_r, SPLIT_N=split, num_warps=warps, num_stages=stages)
