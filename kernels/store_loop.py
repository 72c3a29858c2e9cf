"""The "cublas" variant's store pass as a column loop ("loop"): out = s_i P[rows_i, :r_i] W_i (+ bias), the
LoRA term cuBLAS then adds the base GEMM onto (beta = 1), as `kernels.fused_lora.store_launch` writes it.

The tile form (`_lora_store`: the pointer GEMM's epilogue alone, one output tile a program) runs a chain per
tile: the adapters' metadata, then each rank block's P and W loads, a dot and the store. Session 57 timed it at
3.5x its bytes (a 4096-wide store of 1,536 rows 12.0 us against a 3.0 us floor), and smaller or larger tiles
were slower. This form gives each program one row tile and a run of column tiles. The program reads the
metadata once. Where the row tile meets at most one adapter whose rank fits the rank tile (every row tile of a
2-job step but the one at the jobs' boundary), it loads that adapter's scaled P once and keeps it in registers.
The loop over the column tiles then only loads W's tile, runs one dot and stores. Its iterations do not depend
on one another, so Triton's pipeliner issues the next tile's W load before this tile's dot. Any other row tile
(several adapters, a rank over the rank tile) runs the tile form's epilogue loop for each column tile.

Rows of no adapter (padding past offsets[N], an empty adapter) get zeros (+ bias), as the tile form gives them.
Which form a process runs: $LORAPLEX_LORA_STORE_FORM ("tile", the default until measured on a device, or
"loop"). The loop's configuration: $LORAPLEX_LORA_STORE_LOOP="BLOCK_M,BLOCK_N,warps,stages,programs per SM[,rank
tile cap]". Programs per SM sets how many column runs a row tile splits into (the grid aims at that many
programs per SM).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fused_lora import _adapter_span, _lora_meta, _lora_operands, _pick

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit(do_not_specialize=["M", "N", "COLS"],
            do_not_specialize_on_alignment=["woff_ptr", "off_ptr", "rank_ptr", "scale_ptr"])
def _store_loop_jit(
    c_ptr, bias_ptr, p_ptr, w_ptr, woff_ptr, off_ptr, rank_ptr, scale_ptr,
    M, NC, N, R_MAX, COLS,
    stride_cm, stride_cn, stride_pm, stride_wn, stride_wr, stride_wc,
    HAS_BIAS: tl.constexpr, N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, ARENA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, STAGES: tl.constexpr,
):
    """C[rows, c0:c0 + COLS] = s_i P[rows_i, :r_i] @ W_i[:, cols] (+ bias) for the row tile program_id(0) and
    the column run program_id(1) (COLS columns, a multiple of BLOCK_N)."""
    live, lo, hi, rk, sc, wo = _lora_meta(off_ptr, rank_ptr, scale_ptr, woff_ptr, N, R_MAX, N_P2, ACC, ARENA)
    m0 = tl.program_id(0) * BLOCK_M
    c_lo = tl.program_id(1) * COLS
    c_hi = tl.minimum(c_lo + COLS, NC)
    rm = m0 + tl.arange(0, BLOCK_M)
    m_mask = rm < M
    c_rows = c_ptr + rm.to(tl.int64)[:, None] * stride_cm
    idx = tl.arange(0, N_P2)
    first, last = _adapter_span(m0, live, lo, hi, BLOCK_M)
    ok = first < last
    rank = tl.where(ok, _pick(rk, idx, first), 0)
    dtype = w_ptr.dtype.element_ty
    if (last - first <= 1) & (rank <= BLOCK_R):
        # one adapter (or none) and one rank block: its scaled P held in registers over the column loop
        rr = tl.arange(0, BLOCK_R)
        r_mask = rr < rank
        rows_i = m_mask & (rm >= _pick(lo, idx, first)) & (rm < _pick(hi, idx, first))
        pt = tl.load(p_ptr + rm.to(tl.int64)[:, None] * stride_pm + rr[None, :],
                     mask=rows_i[:, None] & r_mask[None, :], other=0.0)
        pt = (pt * _pick(sc, idx, first)).to(dtype)
        if ARENA:
            w_off = _pick(wo, idx, first)
            if ARENA == 16:
                w_off = tl.multiple_of(w_off, 16)
        else:
            w_off = tl.cast(tl.maximum(first, 0), tl.int64) * stride_wn
        w_rows = w_ptr + w_off + rr[:, None] * stride_wr
        for n0 in tl.range(c_lo, c_hi, BLOCK_N, num_stages=STAGES):
            rn = n0 + tl.arange(0, BLOCK_N)
            n_mask = rn < NC
            wt = tl.load(w_rows + rn[None, :] * stride_wc, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(pt, wt, tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC), input_precision=DOT_PREC)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(ACC)[None, :]
            tl.store(c_rows + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
                     mask=m_mask[:, None] & n_mask[None, :])
    else:  # the tile form's epilogue loop, one column tile at a time
        for n0 in range(c_lo, c_hi, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            n_mask = rn < NC
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
            for i in range(first, last):
                rank_i = _pick(rk, idx, i)
                for r0 in range(0, rank_i, BLOCK_R):
                    pt, wt = _lora_operands(i, True, r0, rm, m_mask, rn, n_mask, p_ptr, w_ptr, lo, hi, rk, sc, wo,
                                            R_MAX, stride_pm, stride_wn, stride_wr, stride_wc, N_P2, ARENA, BLOCK_R)
                    acc = tl.dot(pt, wt, acc, input_precision=DOT_PREC)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(ACC)[None, :]
            tl.store(c_rows + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
                     mask=m_mask[:, None] & n_mask[None, :])


FORMS = ("tile", "loop")
FORM = os.environ.get("LORAPLEX_LORA_STORE_FORM", "tile")
if FORM not in FORMS:
    raise ValueError(f"LORAPLEX_LORA_STORE_FORM must be one of {FORMS}, got {FORM!r}")
def parse_tile(text: str) -> list[int]:
    """A loop configuration string (LOOP_TILE's form) as its numbers; ValueError naming what is wrong."""
    try:
        v = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"store loop tile {text!r}: expected integers "
                         "'BLOCK_M,BLOCK_N,warps,stages,programs_per_sm[,rank_cap]'") from None
    if len(v) not in (5, 6) or min(v) < 1:
        raise ValueError(f"store loop tile {text!r}: expected 5 or 6 positive integers")
    return v


# BLOCK_M, BLOCK_N, warps, stages, programs per SM[, rank tile cap]
# (under the interpreter one small configuration, whose rank tile 64 takes the one-adapter path)
LOOP_TILE = parse_tile(os.environ.get("LORAPLEX_LORA_STORE_LOOP", "16,16,1,1,1,64" if _INTERPRET else "64,128,4,3,2"))


def rank_tile(r_max: int, cap: int = 64) -> int:
    """The loop's rank tile: the call's largest rank to the next power of two (16 at least), at most `cap`
    (an adapter of a larger rank takes the general path)."""
    return max(16, min(cap, triton.next_power_of_2(max(int(r_max), 1))))


def columns_per_program(rows: int, cols: int, block_m: int, block_n: int, programs: int) -> int:
    """Columns a program stores: the column tiles split so that row tiles x splits is about `programs`
    (never more splits than column tiles)."""
    m_tiles = triton.cdiv(rows, block_m)
    n_tiles = triton.cdiv(cols, block_n)
    splits = max(1, min(n_tiles, round(programs / max(m_tiles, 1))))
    return triton.cdiv(n_tiles, splits) * block_n


def store_loop_launch(c, out: torch.Tensor, bias: torch.Tensor | None, p: torch.Tensor, w: torch.Tensor,  # noqa: ANN001
                      w_strides: tuple[int, int, int], woff: torch.Tensor, arena: int,
                      tile: list[int] | None = None, num_sms: int = 132) -> None:
    """out [T, NC] = s_i P[rows_i] W_i (+ bias) by the column loop (`c`: kernels.fused_lora._Ctx)."""
    v = tile or LOOP_TILE
    block_m, block_n, warps, stages, per_sm = v[:5]
    cap = v[5] if len(v) > 5 else 64
    t, nc = out.shape
    cols = columns_per_program(t, nc, block_m, block_n, per_sm * num_sms)
    grid = (triton.cdiv(t, block_m), triton.cdiv(nc, cols))
    _store_loop_jit[grid](
        out, bias if bias is not None else out, p, w, woff, c.offsets, c.ranks, c.scales, t, nc, c.n, c.r_max, cols,
        out.stride(0), out.stride(1), p.stride(0), *w_strides,
        HAS_BIAS=bias is not None, N_P2=c.n_p2, ACC=c.acc, DOT_PREC=c.prec, ARENA=arena, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_R=rank_tile(c.r_max, cap), STAGES=stages, num_warps=warps, num_stages=stages)
