"""Fused form of the grouped multi-LoRA operator: the LoRA terms ride inside the base GEMMs.

Same contracts as `kernels.triton_lora` (stacked and arena forms); what differs is the schedule:

  forward   S = X A_i^T                 `_shrink`     per (adapter, row tile, rank block) item
            Y = X W^T + b + s_i S B_i^T `_gemm_lora`  one Triton GEMM; its epilogue adds, for each
                                                     adapter whose rows meet the output tile, the
                                                     rank-blocks of s_i S B_i^T (no pass over Y)
  backward  dS = dY B_i                 `_shrink` (the same kernel, dY and B^T for X and A);
                                        with `onepass`, the same sweep over dY also adds
                                        dB_i^T += s_i S^T dY (fp32 atomics per row tile)
            dB_i^T += s_i S^T dY        `_wgrad`      (when not onepass) per (adapter, row chunk,
                                                     rank block) x column block; atomics only
                                                     across row chunks
            dA_i += s_i dS^T X          `_wgrad`
            dX = dY W + s_i dS A_i      `_gemm_lora`  (the same GEMM kernel, dS A in its epilogue)

Per-adapter rank tiles: every LoRA loop runs over cdiv(r_i, BLOCK_R) rank blocks of the adapter's
OWN rank, so with BLOCK_R = 16 a rank-16 adapter beside a rank-64 one costs one block, not four;
the work lists are built on the device from offsets and ranks (prefix sums), no host sync. Ranks
need not be powers of two (the last block is masked). In `_shrink` and `_wgrad` BLOCK_R is an
autotuned parameter (16, 32, 64; never wider than the call's largest rank): a wider tile reads each
adapter's rows of X or dY once instead of once per rank block, at the price of masked MMA columns
for smaller ranks (the masked loads move no bytes), which is the faster trade where a pass is bound
by bytes. The GEMM epilogue's rank tile is 16, or 32 where some adapter has a larger rank.

Where a Triton GEMM is slower than cuBLAS on a shape, the composition (`triton_lora`: cuBLAS +
separate LoRA passes) is the faster choice; `kernels.form_choice` picks per shape from measured
timings (bench/lora_op.py writes them). GEMM variants (`GEMM_VARIANTS`, `gemm=` or
$LORAPLEX_FUSED_GEMM): pointer loads or TMA tensor descriptors for the main loop, one program per
tile or persistent programs over a flattened tile loop, and optionally the epilogue's first LoRA
operands prefetched before the main loop; same epilogue math in all ("cublas", "auto": GEMM_VARIANTS).
Design, predictions and what to measure: bench/NOTES_kernels.md ("Issue 20").
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.devices import hopper_or_newer, sm_count, tma_scratch
from kernels.triton_lora import (
    _acc_torch,
    _adapter_base,
    _check,
    _check_arena,
    _shrink_sweep,
    wide_dtype_pruner,
)
from kernels.tuned import Tuned, cdiv, next_pow2, row_bucket

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Under the interpreter one small config runs; tests vary the tile sizes through the env.
_IB = int(os.environ.get("LORAPLEX_INTERPRET_BLOCK_M", "16"))
_ICHUNK = int(os.environ.get("LORAPLEX_INTERPRET_CHUNK", "32"))
_IBR = int(os.environ.get("LORAPLEX_INTERPRET_BLOCK_R", "16"))  # rank tile under the interpreter
_ISPLIT = int(os.environ.get("LORAPLEX_INTERPRET_SPLIT_C", "1"))  # shrink column splits under the interpreter


def _zero_p(nargs: dict) -> None:
    """pre_hook of a split shrink config: its programs add partial sums into P."""
    nargs["p_ptr"].zero_()


# Arguments Triton must not specialise: it compiles a kernel per combination of "divisible by 16" and
# "== 1" over the integer arguments and of 16-byte alignment over the pointers, and a task's token
# counts (M), adapter counts (N) and the step's small metadata tensors (offsets, ranks, scalings: a
# few bytes a program reads once) vary from step to step and from run to run. Specialised, a node met
# combinations the shipped Triton archive lacked and compiled inside a task (session 34: 4 fused-GEMM
# kernels, 3.3 s of one step of the 60-step task); no speed depends on them.
_VARYING = dict(do_not_specialize=["M", "N"],
                do_not_specialize_on_alignment=["woff_ptr", "off_ptr", "rank_ptr", "scale_ptr"])
_VARYING_SHRINK = dict(do_not_specialize=["N"],
                       do_not_specialize_on_alignment=["woff_ptr", "off_ptr", "rank_ptr", "scale_ptr", "goff_ptr"])
_VARYING_WGRAD = dict(do_not_specialize=["N"],
                      do_not_specialize_on_alignment=["goff_ptr", "off_ptr", "rank_ptr", "scale_ptr"])


def _cfg(num_warps: int = 4, num_stages: int = 3, **meta: int) -> triton.Config:
    hook = _zero_p if meta.get("SPLIT_C", 1) > 1 else None
    return triton.Config(meta, num_warps=num_warps, num_stages=num_stages, pre_hook=hook)


if _INTERPRET:
    _GEMM_CONFIGS = [_cfg(BLOCK_M=_IB, BLOCK_N=16, BLOCK_K=16, BLOCK_R=_IBR, GROUP_M=2)]
    _SHRINK_CONFIGS = [_cfg(BLOCK_M=_IB, BLOCK_K=16, BLOCK_R=_IBR, SPLIT_C=_ISPLIT)]
    _WGRAD_CONFIGS = [_cfg(BLOCK_M=16, BLOCK_N=16, CHUNK=_ICHUNK, BLOCK_R=_IBR)]
    _GEMM_WIDE, _SHRINK_WIDE, _WGRAD_WIDE = _GEMM_CONFIGS[0], _SHRINK_CONFIGS[0], _WGRAD_CONFIGS[0]  # unused
else:  # Hopper-friendly tiles (wgmma wants BLOCK_M >= 64 and 8 warps for the large ones).
    # BLOCK_R, the rank tile, is tuned too: 16 gives every adapter only the rank blocks it needs
    # (a rank-16 adapter beside a rank-64 one costs one block), but each rank block of the
    # work-list kernels re-reads its rows of X or dY; 32/64 read them once per adapter and pay
    # masked MMA columns instead (free where the pass is bound by bytes, as these are).
    # `_prune_rank_tiles` drops rank tiles wider than the call's largest rank.
    # $LORAPLEX_FUSED_RANK_TILES=narrow keeps the earlier lists (rank tile 16, one 32 GEMM
    # config): the baseline of bench/lora_op.py --engine-stages and bench/engine_step.py.
    _WIDE = os.environ.get("LORAPLEX_FUSED_RANK_TILES", "tuned") != "narrow"
    # The GEMMs' tiles are tuned; their epilogue's rank tile is not (`_gemm_rank_tile`): in the
    # engine (8 jobs, ranks 16/32/64) the runs whose tuner happened to pick rank tile 32 for every
    # GEMM took 0.957-0.959 s a step, those with a mix of 16/32/64 0.978-0.980 s, while the tuner's
    # own trials could not tell them apart (bench/results/engine_step_breakdown_h100.md).
    _GEMM_TILES = [
        dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
        dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    ]
    _GEMM_CONFIGS = [_cfg(**t) for t in _GEMM_TILES] if _WIDE else [
        _cfg(BLOCK_R=16, **t) for t in _GEMM_TILES] + [
        _cfg(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, BLOCK_R=32, GROUP_M=8, num_warps=8, num_stages=3)]
    _SHRINK_CONFIGS = [
        _cfg(BLOCK_M=64, BLOCK_K=128, BLOCK_R=16, SPLIT_C=1),
        _cfg(BLOCK_M=32, BLOCK_K=128, BLOCK_R=16, SPLIT_C=1, num_stages=4),
        _cfg(BLOCK_M=16, BLOCK_K=256, BLOCK_R=16, SPLIT_C=1, num_stages=4),
        _cfg(BLOCK_M=128, BLOCK_K=64, BLOCK_R=16, SPLIT_C=1, num_warps=8),
    ] + [
        _cfg(BLOCK_M=64, BLOCK_K=128, BLOCK_R=32, SPLIT_C=1),
        _cfg(BLOCK_M=64, BLOCK_K=128, BLOCK_R=64, SPLIT_C=1),
        _cfg(BLOCK_M=128, BLOCK_K=64, BLOCK_R=64, SPLIT_C=1, num_warps=8),
        _cfg(BLOCK_M=128, BLOCK_K=128, BLOCK_R=64, SPLIT_C=1, num_warps=8),
        # column splits: more, shorter programs (atomics into P)
        _cfg(BLOCK_M=64, BLOCK_K=128, BLOCK_R=16, SPLIT_C=4),
        _cfg(BLOCK_M=128, BLOCK_K=128, BLOCK_R=16, SPLIT_C=4, num_warps=8),
        _cfg(BLOCK_M=64, BLOCK_K=128, BLOCK_R=64, SPLIT_C=2),
        _cfg(BLOCK_M=128, BLOCK_K=64, BLOCK_R=64, SPLIT_C=4, num_warps=8),
    ] * _WIDE
    _WGRAD_CONFIGS = [
        _cfg(BLOCK_M=64, BLOCK_N=128, CHUNK=1024, BLOCK_R=16),
        _cfg(BLOCK_M=64, BLOCK_N=128, CHUNK=512, BLOCK_R=16, num_stages=4),
        _cfg(BLOCK_M=128, BLOCK_N=64, CHUNK=2048, BLOCK_R=16, num_warps=8),
        _cfg(BLOCK_M=64, BLOCK_N=256, CHUNK=1024, BLOCK_R=16, num_warps=8),
    ] + [
        _cfg(BLOCK_M=64, BLOCK_N=128, CHUNK=1024, BLOCK_R=32),
        _cfg(BLOCK_M=64, BLOCK_N=128, CHUNK=1024, BLOCK_R=64),
        _cfg(BLOCK_M=64, BLOCK_N=256, CHUNK=1024, BLOCK_R=64, num_warps=8),
        _cfg(BLOCK_M=128, BLOCK_N=128, CHUNK=2048, BLOCK_R=64, num_warps=8),
    ] * _WIDE
    # fp32/fp64 inputs (no tensor cores: a correctness path on a GPU) run one small config each
    _GEMM_WIDE = _cfg(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_stages=2, **({} if _WIDE else {"BLOCK_R": 16}))
    _SHRINK_WIDE = _cfg(BLOCK_M=32, BLOCK_K=64, BLOCK_R=16, SPLIT_C=1, num_stages=2)
    _WGRAD_WIDE = _cfg(BLOCK_M=32, BLOCK_N=64, CHUNK=512, BLOCK_R=16, num_stages=2)


def _gemm_rank_tile(r_max: int) -> dict:
    """The fused GEMMs' epilogue rank tile, where the configs do not carry one: 16 when no adapter
    needs more, else 32 (a rank-64 adapter takes two blocks)."""
    if "BLOCK_R" in _GEMM_CONFIGS[0].kwargs:
        return {}
    return {"BLOCK_R": 16 if r_max <= 16 else 32}


def _prune_rank_tiles(configs: list[triton.Config], named_args: dict, **_kw: object) -> list[triton.Config]:
    """Autotuner pre-filter: no rank tile wider than the call's largest rank needs (R_MAX 16
    tunes only BLOCK_R 16); the narrowest tile always stays."""
    need = max(16, triton.next_power_of_2(int(named_args["R_MAX"])))
    keep = [c for c in configs if c.kwargs.get("BLOCK_R", 16) <= need]
    return keep or configs


@triton.jit
def _find_item(pid, off_ptr, rank_ptr, N, R_MAX, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, N_P2: tl.constexpr):
    """Map `pid` to one (adapter, row block of ROWS, rank block of BLOCK_R) item of the work list.

    Adapter i has cdiv(t_i, ROWS) * cdiv(r_i, BLOCK_R) items (rank block fastest, so the items
    of one row block run side by side and share its input rows through L2). Returns adapter
    (-1 for a spare program), first row, adapter's end row, first rank column, adapter's rank.
    """
    idx = tl.arange(0, N_P2)
    live = idx < N
    lo = tl.load(off_ptr + idx, mask=live, other=0).to(tl.int32)
    hi = tl.load(off_ptr + idx + 1, mask=live, other=0).to(tl.int32)
    rk = tl.minimum(tl.load(rank_ptr + idx, mask=live, other=0).to(tl.int32), R_MAX)
    n_rb = (rk + BLOCK_R - 1) // BLOCK_R
    n_items = ((hi - lo + ROWS - 1) // ROWS) * n_rb
    end = tl.cumsum(n_items, 0)
    start = end - n_items
    hit = (pid >= start) & (pid < end)
    adapter = tl.max(tl.where(hit, idx, -1), 0)
    local = tl.sum(tl.where(hit, pid - start, 0), 0)
    nrb = tl.maximum(tl.sum(tl.where(hit, n_rb, 0), 0), 1)
    row_start = tl.sum(tl.where(hit, lo, 0), 0) + (local // nrb) * ROWS
    row_end = tl.sum(tl.where(hit, hi, 0), 0)
    rank = tl.sum(tl.where(hit, rk, 0), 0)
    return adapter, row_start, row_end, (local % nrb) * BLOCK_R, rank


@triton.jit(**_VARYING_SHRINK)
def _shrink_jit(
    m_ptr, w_ptr, p_ptr, woff_ptr, off_ptr, rank_ptr,
    s_ptr, g_ptr, goff_ptr, scale_ptr,
    N, C, R_MAX, T_BUCKET,
    stride_mm, stride_mc, stride_wn, stride_wr, stride_wc, stride_pm, stride_sm,
    N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, ARENA: tl.constexpr,
    FUSE_WGRAD: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_C: tl.constexpr,
):
    """P[rows_i, :r_i] = M[rows_i, :] @ W_i^T with W_i [r_i, C] (A_i forward, B_i^T backward).

    With FUSE_WGRAD (backward, M = dY, W = B^T): the same sweep adds s_i S^T M into G_i [r_i, C]
    (dB_i^T) with atomics, so dS and dB come from one read of dY.
    With SPLIT_C > 1, axis 1 splits the C sweep in SPLIT_C parts (more programs, each shorter:
    the pass is bound by how many bytes are in flight) that add their partial P with fp32 atomics
    (the config's pre_hook zeroes P first).
    """
    adapter, row_start, row_end, r0, rank = _find_item(
        tl.program_id(0), off_ptr, rank_ptr, N, R_MAX, BLOCK_M, BLOCK_R, N_P2)
    valid = adapter >= 0
    ad = tl.maximum(adapter, 0).to(tl.int64)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    rows64 = rows.to(tl.int64)
    rr = r0 + tl.arange(0, BLOCK_R)
    r_mask = rr < rank
    dtype = m_ptr.dtype.element_ty
    w_base = _adapter_base(w_ptr, ad, stride_wn, woff_ptr, ARENA)
    m_rows = m_ptr + rows64[:, None] * stride_mm
    scale = tl.load(scale_ptr + ad).to(ACC)
    if FUSE_WGRAD:
        st = tl.load(s_ptr + rows64[:, None] * stride_sm + rr[None, :], mask=row_mask[:, None] & r_mask[None, :],
                     other=0.0)
        st_t = tl.trans(st.to(dtype))
    else:
        st_t = w_base  # unread
    g_base = _adapter_base(g_ptr, ad, stride_wn, goff_ptr, ARENA)
    # this program's columns [c0, c0 + span) of C (all of them unless SPLIT_C > 1): the sweep runs on
    # pointers moved to c0 over C - c0 columns
    span = tl.cdiv(tl.cdiv(C, SPLIT_C), BLOCK_K) * BLOCK_K
    c0 = tl.program_id(1) * span
    c_left = tl.maximum(C - c0, 0)
    c_end = tl.where(valid, tl.minimum(c_left, span), 0)
    acc = _shrink_sweep(tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC), m_rows + c0 * stride_mc, stride_mc, row_mask,
                        w_base + c0 * stride_wc, stride_wc, stride_wr, rr, r_mask, c_left, c_end, st_t,
                        g_base + c0 * stride_wc, scale, FUSE_WGRAD, ACC, DOT_PREC, BLOCK_K)
    out = p_ptr + rows64[:, None] * stride_pm + rr[None, :]
    if SPLIT_C == 1:
        tl.store(out, acc, mask=row_mask[:, None] & r_mask[None, :])
    else:
        tl.atomic_add(out, acc, mask=row_mask[:, None] & r_mask[None, :], sem="relaxed")  # spares: no rows


@triton.jit(**_VARYING_WGRAD)
def _wgrad_jit(
    p_ptr, m_ptr, g_ptr, goff_ptr, off_ptr, rank_ptr, scale_ptr,
    N, C, R_MAX, T_BUCKET,
    stride_pm, stride_mm, stride_mc, stride_gn, stride_gr, stride_gc,
    N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, ARENA: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    """G_i[:r_i, cols] += s_i P[rows_i, :r_i]^T @ M[rows_i, cols] (dA_i: P = dS, M = X; dB_i^T:
    P = S, M = dY). Axis 0: (adapter, row chunk of CHUNK, rank block) items; axis 1: column
    blocks. Each program reduces its chunk in registers; chunks of one adapter meet in atomics."""
    adapter, row_start, row_end, r0, rank = _find_item(
        tl.program_id(0), off_ptr, rank_ptr, N, R_MAX, CHUNK, BLOCK_R, N_P2)
    valid = adapter >= 0
    ad = tl.maximum(adapter, 0).to(tl.int64)
    dtype = m_ptr.dtype.element_ty
    scale = tl.load(scale_ptr + ad).to(ACC)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < C
    rr = r0 + tl.arange(0, BLOCK_R)
    r_mask = rr < rank
    chunk_end = tl.where(valid, tl.minimum(row_start + CHUNK, row_end), row_start)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=ACC)
    for m0 in range(row_start, chunk_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < chunk_end
        rows64 = rows.to(tl.int64)
        pt = tl.load(p_ptr + rows64[:, None] * stride_pm + rr[None, :], mask=row_mask[:, None] & r_mask[None, :],
                     other=0.0)
        mt = tl.load(m_ptr + rows64[:, None] * stride_mm + cols[None, :] * stride_mc,
                     mask=row_mask[:, None] & c_mask[None, :], other=0.0)
        acc = tl.dot(tl.trans((pt * scale).to(dtype)), mt, acc, input_precision=DOT_PREC)
    g_base = _adapter_base(g_ptr, ad, stride_gn, goff_ptr, ARENA)
    tl.atomic_add(g_base + rr[:, None] * stride_gr + cols[None, :] * stride_gc, acc,
                  mask=r_mask[:, None] & c_mask[None, :], sem="relaxed")


@triton.jit
def _tile_of(pid, M, NC, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles in a row share their B tiles through L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(NC, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _lora_meta(off_ptr, rank_ptr, scale_ptr, woff_ptr, N, R_MAX,
               N_P2: tl.constexpr, ACC: tl.constexpr, ARENA: tl.constexpr):
    """Every adapter's row span, rank, scale and weight offset, loaded once per program into
    registers (one round trip, issued before the main loop), so the epilogue picks an adapter's
    values without a chain of dependent loads (span, then rank, then operands)."""
    idx = tl.arange(0, N_P2)
    live = idx < N
    lo = tl.load(off_ptr + idx, mask=live, other=0).to(tl.int32)
    hi = tl.load(off_ptr + idx + 1, mask=live, other=0).to(tl.int32)
    rk = tl.minimum(tl.load(rank_ptr + idx, mask=live, other=0).to(tl.int32), R_MAX)
    sc = tl.load(scale_ptr + idx, mask=live, other=0.0).to(ACC)
    if ARENA:
        wo = tl.load(woff_ptr + idx, mask=live, other=0).to(tl.int64)
    else:  # stacked weights: `_lora_operands` computes i * stride_wn instead
        wo = tl.zeros((N_P2,), dtype=tl.int64)
    return live, lo, hi, rk, sc, wo


@triton.jit
def _pick(vec, idx, i):
    """vec[i] of a register vector (no load)."""
    return tl.sum(tl.where(idx == i, vec, tl.zeros_like(vec)), 0)


@triton.jit
def _adapter_span(m0, live, lo, hi, BLOCK_M: tl.constexpr):
    """[first, last): the adapters whose rows meet the row tile starting at m0."""
    first = tl.sum(tl.where(live & (hi <= m0), 1, 0), 0)
    last = tl.sum(tl.where(live & (lo < m0 + BLOCK_M), 1, 0), 0)
    return first, last


@triton.jit
def _lora_operands(i, ok, r0, rm, m_mask, rn, n_mask, p_ptr, w_ptr, lo, hi, rk, sc, wo, R_MAX, stride_pm,
                   stride_wn, stride_wr, stride_wc, N_P2: tl.constexpr, ARENA: tl.constexpr, BLOCK_R: tl.constexpr):
    """(s_i P[rows_i, r0:r0+BLOCK_R], W_i[r0:r0+BLOCK_R, cols]) for adapter i (zeros unless ok):
    the two operands of one rank block of the tile's LoRA term. Both loads are written so the
    compiler can issue 16-byte vectors: W_i's offset is known to be aligned (stacked: i * stride;
    ARENA == 16: vouched for by the caller), and P is loaded under a mask that is constant over
    R_MAX's aligned column runs, the columns past the adapter's rank zeroed afterwards."""
    idx = tl.arange(0, N_P2)
    rank = tl.where(ok, _pick(rk, idx, i), 0)
    rows_i = m_mask & (rm >= _pick(lo, idx, i)) & (rm < _pick(hi, idx, i))
    if ARENA:
        w_off = _pick(wo, idx, i)
        if ARENA == 16:  # here, not in a helper: the hint does not cross a function call
            w_off = tl.multiple_of(w_off, 16)
    else:
        w_off = tl.cast(i, tl.int64) * stride_wn
    rr = r0 + tl.arange(0, BLOCK_R)
    r_mask = rr < rank
    pt = tl.load(p_ptr + rm.to(tl.int64)[:, None] * stride_pm + rr[None, :],
                 mask=rows_i[:, None] & (rr < R_MAX)[None, :], other=0.0)
    pt = tl.where(r_mask[None, :], pt, 0.0)  # P's columns past rank_i hold no value of this adapter
    wt = tl.load(w_ptr + w_off + rr[:, None] * stride_wr + rn[None, :] * stride_wc,
                 mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    return (pt * _pick(sc, idx, i)).to(w_ptr.dtype.element_ty), wt


@triton.jit
def _lora_prefetch(m0, n0, M, NC, R_MAX, p_ptr, w_ptr, live, lo, hi, rk, sc, wo, stride_pm, stride_wn, stride_wr,
                   stride_wc, PREFETCH: tl.constexpr, N_P2: tl.constexpr, ARENA: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """With PREFETCH, the first rank block of the tile's first adapter, loaded BEFORE the GEMM's
    main loop so its latency hides behind the loop (the epilogue then only runs the dot)."""
    if PREFETCH:
        rm = m0 + tl.arange(0, BLOCK_M)
        rn = n0 + tl.arange(0, BLOCK_N)
        first, last = _adapter_span(m0, live, lo, hi, BLOCK_M)
        pre_p, pre_w = _lora_operands(first, first < last, 0, rm, rm < M, rn, rn < NC, p_ptr, w_ptr, lo, hi, rk, sc,
                                      wo, R_MAX, stride_pm, stride_wn, stride_wr, stride_wc, N_P2, ARENA, BLOCK_R)
    else:
        pre_p = tl.zeros((BLOCK_M, BLOCK_R), dtype=w_ptr.dtype.element_ty)
        pre_w = tl.zeros((BLOCK_R, BLOCK_N), dtype=w_ptr.dtype.element_ty)
    return pre_p, pre_w


@triton.jit
def _lora_epilogue_store(
    acc, pid_m, pid_n, c_ptr, bias_ptr, p_ptr, w_ptr, live, lo, hi, rk, sc, wo,
    M, NC, R_MAX, stride_cm, stride_cn, stride_pm, stride_wn, stride_wr, stride_wc, pre_p, pre_w,
    HAS_BIAS: tl.constexpr, N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, ARENA: tl.constexpr,
    PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """acc += s_i P[rows_i, :r_i] @ W_i for the adapters [first, last) whose rows meet this tile
    (cdiv(r_i, BLOCK_R) rank blocks each; with PREFETCH the first adapter's first block arrives as
    pre_p/pre_w), + bias; store the tile into C. Adapter metadata comes from `_lora_meta`."""
    m0 = pid_m * BLOCK_M
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < NC
    idx = tl.arange(0, N_P2)
    first, last = _adapter_span(m0, live, lo, hi, BLOCK_M)
    if PREFETCH:
        acc = tl.dot(pre_p, pre_w, acc, input_precision=DOT_PREC)
    for i in range(first, last):
        rank = _pick(rk, idx, i)
        if PREFETCH:
            r_begin = tl.where(i == first, BLOCK_R, 0)
        else:
            r_begin = 0
        for r0 in range(r_begin, rank, BLOCK_R):
            pt, wt = _lora_operands(i, True, r0, rm, m_mask, rn, n_mask, p_ptr, w_ptr, lo, hi, rk, sc, wo, R_MAX,
                                    stride_pm, stride_wn, stride_wr, stride_wc, N_P2, ARENA, BLOCK_R)
            acc = tl.dot(pt, wt, acc, input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(ACC)[None, :]
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(**_VARYING)
def _gemm_lora_jit(
    a_ptr, b_ptr, c_ptr, bias_ptr, p_ptr, w_ptr, woff_ptr, off_ptr, rank_ptr, scale_ptr,
    M, NC, K, N, R_MAX, T_BUCKET,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_pm, stride_wn, stride_wr, stride_wc,
    HAS_BIAS: tl.constexpr, N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, ARENA: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C = A @ B (+ bias) + s_i P[rows_i, :r_i] @ W_i (W_i [r_i, NC]) for every adapter i whose
    rows meet this output tile: the LoRA expand (forward: P = S, W = B^T) or dS A (backward:
    P = dS, W = A) folded into the base GEMM's epilogue. Pointer loads (any strides)."""
    pid_m, pid_n = _tile_of(tl.program_id(0), M, NC, BLOCK_M, BLOCK_N, GROUP_M)
    live, lo, hi, rk, sc, wo = _lora_meta(off_ptr, rank_ptr, scale_ptr, woff_ptr, N, R_MAX, N_P2, ACC, ARENA)
    pre_p, pre_w = _lora_prefetch(pid_m * BLOCK_M, pid_n * BLOCK_N, M, NC, R_MAX, p_ptr, w_ptr, live, lo, hi, rk, sc, wo,
                                  stride_pm, stride_wn, stride_wr, stride_wc, PREFETCH, N_P2, ARENA, BLOCK_M,
                                  BLOCK_N, BLOCK_R)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < NC
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + rn[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        at = tl.load(a_rows + ks[None, :] * stride_ak, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        bt = tl.load(b_cols + ks[:, None] * stride_bk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(at, bt, acc, input_precision=DOT_PREC)
    _lora_epilogue_store(acc, pid_m, pid_n, c_ptr, bias_ptr, p_ptr, w_ptr, live, lo, hi, rk, sc, wo, M, NC, R_MAX,
                         stride_cm, stride_cn, stride_pm, stride_wn, stride_wr, stride_wc, pre_p, pre_w,
                         HAS_BIAS, N_P2, ACC, DOT_PREC, ARENA, PREFETCH, BLOCK_M, BLOCK_N, BLOCK_R)


@triton.jit
def _tma_descs(a_ptr, b_ptr, M, NC, K, stride_am, stride_bk, stride_bn, B_NK: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_NK:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[NC, K], strides=[stride_bn, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, NC], strides=[stride_bk, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    return a_desc, b_desc


@triton.jit
def _tma_mainloop(a_desc, b_desc, m0, n0, K, B_NK: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        at = a_desc.load([m0, k0])
        if B_NK:
            bt = b_desc.load([n0, k0]).T
        else:
            bt = b_desc.load([k0, n0])
        acc = tl.dot(at, bt, acc, input_precision=DOT_PREC)
    return acc


@triton.jit(**_VARYING)
def _gemm_lora_tma_jit(
    a_ptr, b_ptr, c_ptr, bias_ptr, p_ptr, w_ptr, woff_ptr, off_ptr, rank_ptr, scale_ptr,
    M, NC, K, N, R_MAX, T_BUCKET,
    stride_am, stride_bk, stride_bn, stride_cm, stride_cn, stride_pm, stride_wn, stride_wr, stride_wc,
    B_NK: tl.constexpr, HAS_BIAS: tl.constexpr, N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr,
    ARENA: tl.constexpr, PREFETCH: tl.constexpr, NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """`_gemm_lora_jit` with the main loop's A and B tiles fetched by TMA (Hopper tensor
    descriptors; out-of-range rows and columns read as zero). A and B must have unit stride in
    their last dimension; B_NK: B given as [NC, K] (nn.Linear's W, forward) instead of [K, NC]."""
    pid_m, pid_n = _tile_of(tl.program_id(0), M, NC, BLOCK_M, BLOCK_N, GROUP_M)
    a_desc, b_desc = _tma_descs(a_ptr, b_ptr, M, NC, K, stride_am, stride_bk, stride_bn, B_NK, BLOCK_M, BLOCK_N,
                                BLOCK_K)
    live, lo, hi, rk, sc, wo = _lora_meta(off_ptr, rank_ptr, scale_ptr, woff_ptr, N, R_MAX, N_P2, ACC, ARENA)
    pre_p, pre_w = _lora_prefetch(pid_m * BLOCK_M, pid_n * BLOCK_N, M, NC, R_MAX, p_ptr, w_ptr, live, lo, hi, rk, sc, wo,
                                  stride_pm, stride_wn, stride_wr, stride_wc, PREFETCH, N_P2, ARENA, BLOCK_M,
                                  BLOCK_N, BLOCK_R)
    acc = _tma_mainloop(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, K, B_NK, ACC, DOT_PREC, BLOCK_M, BLOCK_N,
                        BLOCK_K)
    _lora_epilogue_store(acc, pid_m, pid_n, c_ptr, bias_ptr, p_ptr, w_ptr, live, lo, hi, rk, sc, wo, M, NC, R_MAX,
                         stride_cm, stride_cn, stride_pm, stride_wn, stride_wr, stride_wc, pre_p, pre_w,
                         HAS_BIAS, N_P2, ACC, DOT_PREC, ARENA, PREFETCH, BLOCK_M, BLOCK_N, BLOCK_R)


@triton.jit(**_VARYING)
def _gemm_lora_persist_jit(
    a_ptr, b_ptr, c_ptr, bias_ptr, p_ptr, w_ptr, woff_ptr, off_ptr, rank_ptr, scale_ptr,
    M, NC, K, N, R_MAX, T_BUCKET,
    stride_am, stride_bk, stride_bn, stride_cm, stride_cn, stride_pm, stride_wn, stride_wr, stride_wc,
    B_NK: tl.constexpr, HAS_BIAS: tl.constexpr, N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr,
    ARENA: tl.constexpr, PREFETCH: tl.constexpr, NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The TMA GEMM as a persistent kernel: NUM_SMS programs walk the output tiles (grouped order)
    in one flattened loop, so the compiler can pipeline the next tile's TMA loads under this
    tile's epilogue (the LoRA term and the store); the epilogue's tile index has its own counter.
    The walk covers the row tiles that meet an adapter's rows: M_LIVE, the last adapter's end row
    (read from the offsets on the device, so one CUDA graph serves every step of its shape); the
    row tiles wholly past it (padding no adapter owns) are stored as zeros, with no main loop."""
    a_desc, b_desc = _tma_descs(a_ptr, b_ptr, M, NC, K, stride_am, stride_bk, stride_bn, B_NK, BLOCK_M, BLOCK_N,
                                BLOCK_K)
    live, lo, hi, rk, sc, wo = _lora_meta(off_ptr, rank_ptr, scale_ptr, woff_ptr, N, R_MAX, N_P2, ACC, ARENA)
    m_live = tl.minimum(tl.max(tl.where(live, hi, 0), 0), M)
    num_n = tl.cdiv(NC, BLOCK_N)
    live_m = tl.cdiv(m_live, BLOCK_M)
    tiles = live_m * num_n
    k_steps = tl.cdiv(K, BLOCK_K)
    tile_c = tl.program_id(0) - NUM_SMS
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_of(tile, m_live, NC, BLOCK_M, BLOCK_N, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        pre_p, pre_w = _lora_prefetch(m0, n0, M, NC, R_MAX, p_ptr, w_ptr, live, lo, hi, rk, sc, wo, stride_pm,
                                      stride_wn, stride_wr, stride_wc, PREFETCH, N_P2, ARENA, BLOCK_M, BLOCK_N,
                                      BLOCK_R)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
        for ki in range(k_steps):
            at = a_desc.load([m0, ki * BLOCK_K])
            if B_NK:
                bt = b_desc.load([n0, ki * BLOCK_K]).T
            else:
                bt = b_desc.load([ki * BLOCK_K, n0])
            acc = tl.dot(at, bt, acc, input_precision=DOT_PREC)
        tile_c += NUM_SMS
        pid_mc, pid_nc = _tile_of(tile_c, m_live, NC, BLOCK_M, BLOCK_N, GROUP_M)
        _lora_epilogue_store(acc, pid_mc, pid_nc, c_ptr, bias_ptr, p_ptr, w_ptr, live, lo, hi, rk, sc, wo, M, NC,
                             R_MAX, stride_cm, stride_cn, stride_pm, stride_wn, stride_wr, stride_wc, pre_p, pre_w,
                             HAS_BIAS, N_P2, ACC, DOT_PREC, ARENA, PREFETCH, BLOCK_M, BLOCK_N, BLOCK_R)
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)
    for pad in range(tl.program_id(0), (tl.cdiv(M, BLOCK_M) - live_m) * num_n, NUM_SMS):
        rm = (live_m + pad // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (pad % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn, zeros,
                 mask=(rm < M)[:, None] & (rn < NC)[None, :])


# The GEMMs' tuning keys name B's layout too: the forward (B = W^T, read as W's [NC, K] rows) and the
# dX GEMM (B = W [K, NC]) of two projections can share (T, NC, K) (Llama's down projection forward
# and gate/up dX are both 4096 x 14336), and one layout's best tile was measured 7% slower on the
# other (bench/results/engine_step_breakdown_h100.md, session 6).
_PRUNE = {"gemm": wide_dtype_pruner(_GEMM_WIDE, _prune_rank_tiles),
          "shrink": wide_dtype_pruner(_SHRINK_WIDE, _prune_rank_tiles),
          "wgrad": wide_dtype_pruner(_WGRAD_WIDE, _prune_rank_tiles)}
_gemm_lora = Tuned("gemm_lora", _gemm_lora_jit, _GEMM_CONFIGS, ["T_BUCKET", "NC", "K", "R_MAX", "stride_bk"],
                   _PRUNE["gemm"])
_gemm_lora_tma = Tuned("gemm_lora_tma", _gemm_lora_tma_jit, _GEMM_CONFIGS, ["T_BUCKET", "NC", "K", "R_MAX", "B_NK"],
                       _PRUNE["gemm"])
_gemm_lora_persist = Tuned("gemm_lora_persist", _gemm_lora_persist_jit, _GEMM_CONFIGS,
                           ["T_BUCKET", "NC", "K", "R_MAX", "B_NK"], _PRUNE["gemm"])
# The "cublas" variant's epilogue-only pass (K = 0: the LoRA term and bias stored, cuBLAS adds the base GEMM
# onto them): one configuration, so nothing is tuned (its tiles move no main loop's bytes; fp32/fp64 calls take
# the GEMMs' small one); $LORAPLEX_LORA_STORE_TILE="BLOCK_M,BLOCK_N,num_warps[,BLOCK_R]" picks another (64 x 256,
# 4 warps: bench/results/session48_h200.md, device phase s48_store; a fourth number caps the rank tile, else
# `_gemm_rank_tile`'s, and under narrow rank tiles or the interpreter the configuration's own;
# `bench/lora_sweep.py --store` times candidates apart: session 57 kept the default)
_STORE_TILE = [int(v) for v in os.environ.get("LORAPLEX_LORA_STORE_TILE", "64,256,4").split(",")]


def _store_config(tile: list[int]) -> triton.Config:
    """The store pass's configuration for a tile [BLOCK_M, BLOCK_N, num_warps(, rank tile cap)]: a rank tile of 16
    where the GEMMs' configurations carry one (narrow rank tiles), else none (`_store_rank_tile` gives it)."""
    return _cfg(BLOCK_M=tile[0], BLOCK_N=tile[1], BLOCK_K=16, GROUP_M=8, num_warps=tile[2], num_stages=1,
                **({"BLOCK_R": 16} if "BLOCK_R" in _GEMM_CONFIGS[0].kwargs else {}))


_lora_store = Tuned("lora_store", _gemm_lora_jit, _GEMM_CONFIGS[:1] if _INTERPRET else [_store_config(_STORE_TILE)],
                    ["T_BUCKET", "NC", "K", "R_MAX", "stride_bk"], _PRUNE["gemm"])


def _store_rank_tile(r_max: int, tile: list[int] = _STORE_TILE) -> dict:
    """The store pass's rank tile for a tile (default: the process's): `_gemm_rank_tile`'s, or up to the tile's
    fourth number (no wider than the call's largest rank needs)."""
    if len(tile) < 4 or "BLOCK_R" in _GEMM_CONFIGS[0].kwargs:
        return _gemm_rank_tile(r_max)
    return {"BLOCK_R": min(tile[3], max(16, triton.next_power_of_2(r_max)))}


_shrink = Tuned("shrink", _shrink_jit, _SHRINK_CONFIGS, ["T_BUCKET", "C", "R_MAX"], _PRUNE["shrink"])
# Kernels that add into caller-owned gradients (an arena already holds other layers' sums): an
# offline tuning run restores those around its trials (kernels.tuned)
_shrink_wgrad = Tuned("shrink_wgrad", _shrink_jit, _SHRINK_CONFIGS, ["T_BUCKET", "C", "R_MAX"], _PRUNE["shrink"],
                      restore=("g_ptr",))
_wgrad = Tuned("wgrad", _wgrad_jit, _WGRAD_CONFIGS, ["T_BUCKET", "C", "R_MAX"], _PRUNE["wgrad"],
               restore=("g_ptr",))
# Candidates for small steps (session 40): a step of a few hundred rows leaves most SMs idle under the tiles above
# (a k/v projection of 419 rows is 16 tiles of 128 x 256 on 132 SMs; a shrink of 7 row tiles sweeps 4096-14336
# columns in 4 parts). Appended here, below every @triton.jit function: a line added above one moves it, and its
# first line is in its Triton cache key (the shipped archive's). A table without entries that name them never
# launches them.
if not _INTERPRET and _WIDE:
    _SMALL_GEMM = [_cfg(**t) for t in (
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4))]
    _SMALL_SHRINK = [
        _cfg(BLOCK_M=64, BLOCK_K=128, BLOCK_R=16, SPLIT_C=8),
        _cfg(BLOCK_M=32, BLOCK_K=128, BLOCK_R=16, SPLIT_C=8, num_stages=4),
        _cfg(BLOCK_M=64, BLOCK_K=128, BLOCK_R=16, SPLIT_C=16),
        _cfg(BLOCK_M=64, BLOCK_K=128, BLOCK_R=64, SPLIT_C=8),
        # session 52 (bench/lora_sweep.py --extra, a 2-job step of 1,450 rows at ranks 16 and 64): the one-pass dS + dB
        # with taller, narrower tiles (fewer fp32 atomics per column of dB) and deeper pipelines, 42 against 54 us at
        # 4096 x 14336, 17.7 against 20.1 us at 4096 x 4096
        _cfg(BLOCK_M=128, BLOCK_K=64, BLOCK_R=64, SPLIT_C=8, num_warps=8, num_stages=4)]
    _SMALL_WGRAD = [
        _cfg(BLOCK_M=64, BLOCK_N=64, CHUNK=256, BLOCK_R=16),
        _cfg(BLOCK_M=64, BLOCK_N=64, CHUNK=256, BLOCK_R=64),
        _cfg(BLOCK_M=32, BLOCK_N=128, CHUNK=256, BLOCK_R=16, num_stages=4),
        # session 52, the same sweep: dA in short row chunks with wide column tiles, 10.8 against 19.3 us at d_in 4096,
        # and in 512-row chunks, 28.5 against 32.3 us at d_in 14336
        _cfg(BLOCK_M=32, BLOCK_N=256, CHUNK=256, BLOCK_R=64, num_warps=8, num_stages=4),
        _cfg(BLOCK_M=64, BLOCK_N=256, CHUNK=512, BLOCK_R=64, num_warps=8, num_stages=4)]
    for _k, _more in ((_gemm_lora, _SMALL_GEMM), (_gemm_lora_tma, _SMALL_GEMM), (_gemm_lora_persist, _SMALL_GEMM),
                      (_shrink, _SMALL_SHRINK), (_shrink_wgrad, _SMALL_SHRINK), (_wgrad, _SMALL_WGRAD)):
        _k.configs += _more


class _Ctx:
    """Per-call constants every launch shares: work-list bounds and dtype metadata."""

    def __init__(self, x: torch.Tensor, n: int, r_max: int, offsets, ranks, scales) -> None:  # noqa: ANN001
        self.t = x.shape[0]
        self.n = n
        self.r_max = r_max
        self.offsets, self.ranks, self.scales = offsets, ranks, scales
        self.n_p2 = max(16, next_pow2(n))
        self.acc = tl.float64 if x.dtype == torch.float64 else tl.float32
        self.prec = "ieee" if x.dtype in (torch.float32, torch.float64) else "tf32"
        self.t_bucket = row_bucket(self.t)  # the tables' key (kernels.tuned), not a size any kernel reads

    def items(self, rows: int, block_r: int) -> int:
        """Upper bound of the work list's length for row blocks of `rows` and rank tiles of `block_r`."""
        return (cdiv(self.t, rows) + self.n) * cdiv(self.r_max, block_r)

    def epilogue(self, bias: torch.Tensor | None, arena: int, prefetch: bool) -> dict:
        """The LoRA epilogue's constants of a GEMM launch (the fused GEMMs' and the store pass's)."""
        return dict(HAS_BIAS=bias is not None, N_P2=self.n_p2, ACC=self.acc, DOT_PREC=self.prec, ARENA=arena,
                    PREFETCH=prefetch)


def _shrink_launch(c: _Ctx, m, w, w_strides, woff, p, arena: int, wgrad=None) -> None:  # noqa: ANN001
    """p[rows_i, :r_i] = m[rows_i] @ W_i^T; with wgrad = (s_buf, g, goff): also g_i += s_i S^T m."""
    s_buf, g, goff = wgrad if wgrad is not None else (p, p, woff)
    grid = lambda meta: (c.items(meta["BLOCK_M"], meta["BLOCK_R"]), meta["SPLIT_C"])  # noqa: E731
    args = (m, w, p, woff, c.offsets, c.ranks, s_buf, g, goff, c.scales, c.n, m.shape[1], c.r_max, c.t_bucket,
            m.stride(0), m.stride(1), *w_strides, p.stride(0), s_buf.stride(0))
    meta = dict(N_P2=c.n_p2, ACC=c.acc, DOT_PREC=c.prec, ARENA=arena, FUSE_WGRAD=wgrad is not None)
    if wgrad is None:
        _shrink[grid](*args, **meta)
    else:
        _shrink_wgrad[grid](*args, **meta)


def _wgrad_launch(c: _Ctx, p, m, g, g_strides, goff, arena: int) -> None:  # noqa: ANN001
    """g_i[:r_i, :] += s_i p[rows_i, :r_i]^T m[rows_i] (g_strides: adapter, rank, column)."""
    cols = m.shape[1]
    _wgrad[lambda meta: (c.items(meta["CHUNK"], meta["BLOCK_R"]), cdiv(cols, meta["BLOCK_N"]))](
        p, m, g, goff, c.offsets, c.ranks, c.scales, c.n, cols, c.r_max, c.t_bucket, p.stride(0), m.stride(0),
        m.stride(1), *g_strides, N_P2=c.n_p2, ACC=c.acc, DOT_PREC=c.prec, ARENA=arena)


# The fused GEMMs' main loop and epilogue schedule: "ptr" (pointer loads, one program per tile),
# "tma" (TMA tensor descriptors), "persist" (TMA, persistent programs, one flattened loop over the
# tiles that meet an adapter's rows; zeros in the row tiles wholly past the last adapter's end); "+pf"
# prefetches the epilogue's first LoRA operands before the main loop. The process
# default comes from $LORAPLEX_FUSED_GEMM ($LORAPLEX_FUSED_TMA=1 is the older spelling of "tma");
# unset (None): "auto" on Hopper or newer ("persist" alone was the fastest of the first six on H100:
# bench/results/lora_op_variants_h100.md), "ptr" elsewhere and under the interpreter.
# "cublas": the base GEMM by cuBLAS (beta = 1) over the LoRA term and bias, which an epilogue-only pass
# of the pointer kernel stores first (no main loop: K = 0); rows of no adapter hold the base output.
# "auto": per call, "persist", or "cublas" where the persistent kernel's tiles (its table's configuration
# for the call) keep under CUBLAS_BELOW of its last round of programs busy (`wave_fill`): a 2-job step of
# ~1.4k tokens graphed at 1,536 rows runs its 4096-wide GEMMs as 192 tiles of 128 x 256 on 132 SMs (1.45
# rounds); there its graph replays 5.6% faster than "persist", at 1,792 and 2,048 rows (1.70 and 1.94
# rounds) within 1% (bench/results/session48_h200.md). The sm90 archive holds the store pass's kernels
# since session 49 (AUTO_READY below; the device phase that grew them: bench/device_session.sh s49_a).
GEMM_VARIANTS = ("ptr", "ptr+pf", "tma", "tma+pf", "persist", "persist+pf", "cublas", "auto")
CUBLAS_BELOW = float(os.environ.get("LORAPLEX_CUBLAS_BELOW", "0.75"))  # measured side by side: bench/device_session.sh s50_a
# $LORAPLEX_CUBLAS_WIDTH: "auto" also takes cuBLAS for every output of at most this many columns, whatever the fill
# (0: none). Session 56's trace of a 1,792-row step: the persistent kernel ran its 4096-wide GEMMs at ~500 TFLOP/s
# and its 1024-wide ones at 300-375, where cuBLAS ran the 1,536-row step's at ~650-725 (bench/device_session.sh s57_d)
CUBLAS_WIDTH = int(os.environ.get("LORAPLEX_CUBLAS_WIDTH", "0"))
# Hopper's default: "auto" once the shipped sm90 archive holds the store pass's kernels (a default that
# compiled them inside a node's first tasks would break the start issue's "nothing compiles in a task")
AUTO_READY = True
GEMM_DEFAULT: str | None = os.environ.get("LORAPLEX_FUSED_GEMM") or (
    "tma" if os.environ.get("LORAPLEX_FUSED_TMA", "0") == "1" else None)


def gemm_variant(gemm: str | None = None, tma: bool | None = None, device: torch.device | None = None) -> str:
    """The variant a call runs: `gemm` if given, else `tma` (True: "tma", False: "ptr"), else the
    process default, else the device's. Unknown names are refused here, before any launch."""
    v = gemm if gemm is not None else ("tma" if tma else "ptr") if tma is not None else GEMM_DEFAULT
    if v is None:
        hopper = device is not None and not _INTERPRET and hopper_or_newer(device)
        v = ("auto" if AUTO_READY else "persist") if hopper else "ptr"
    if v not in GEMM_VARIANTS:
        raise ValueError(f"unknown fused GEMM variant {v!r} (LORAPLEX_FUSED_GEMM or gemm=): "
                         f"expected one of {', '.join(GEMM_VARIANTS)}")
    return v


def auto_takes_cublas(tiles: int, programs: int, width: int) -> bool:
    """"auto"'s choice for one GEMM: cuBLAS over the LoRA store where the persistent tiles keep under CUBLAS_BELOW
    of their last round busy, or the output is at most CUBLAS_WIDTH columns wide; else the persistent kernel."""
    return 0 < width <= CUBLAS_WIDTH or wave_fill(tiles, programs) < CUBLAS_BELOW


def wave_fill(tiles: int, programs: int) -> float:
    """The share of its rounds' program slots that `tiles` tiles keep busy on `programs` SMs (1.0:
    the last round full)."""
    if tiles <= 0:
        return 1.0
    return tiles / (-(-tiles // programs) * programs)


def _num_sms(device: torch.device) -> int:
    if _INTERPRET or device.type != "cuda":
        return 4
    return sm_count(device)


def _tma_ok(a: torch.Tensor, b_kn: torch.Tensor) -> bool:
    """TMA wants 16-byte aligned bases and row strides, unit stride along the loaded rows."""
    es = a.element_size()
    b_nk = b_kn.stride(0) == 1  # W^T view of nn.Linear's W: load W [NC, K] rows instead
    b_row = b_kn.stride(1) if b_nk else b_kn.stride(0)
    return (a.stride(1) == 1 and (b_kn.stride(1) == 1 or b_nk) and a.data_ptr() % 16 == 0
            and b_kn.data_ptr() % 16 == 0 and (a.stride(0) * es) % 16 == 0 and (b_row * es) % 16 == 0)


# The warp-specialised Gluon GEMM (kernels/ws_gemm.py) for the GEMMs it serves (`_ws_takes`): $LORAPLEX_WS_GEMM names
# its variant ("0", the default: none). Outputs narrower than WS_MIN_WIDTH keep "auto"'s forms: with the LoRA term, on
# an H200 at 1,024-2,560 rows, "pingpong" won every 14336-wide GEMM of the 8B shape (gate/up forward, down dX: 14-22
# us of ~200-490) and lost or tied the 4096- and 1024-wide ones (bench/results/session69_h200.md)
WS_GEMM = os.environ.get("LORAPLEX_WS_GEMM", "0")
WS_MIN_WIDTH = int(os.environ.get("LORAPLEX_WS_MIN_WIDTH", "8192"))
# "0": not the GEMMs that dA runs beside on the side stream (the down projection's dX). The Gluon kernel holds every
# SM's shared memory, so dA no longer fills that GEMM's last round (session 69's likely cause of the task's loss)
WS_BESIDE_DA = os.environ.get("LORAPLEX_WS_BESIDE_DA", "1") == "1"


def _ws_takes(c: _Ctx, a, b_kn, p, arena: int, out_dtype, beside: bool = False) -> str | None:  # noqa: ANN001
    """The Gluon GEMM's variant for this call, or None: bf16/fp16 on an sm_90 device, the engine's arena (16-element
    offsets or not), adapters present, an fp32 LoRA operand, TMA-loadable operands, an output at least
    WS_MIN_WIDTH wide; where dA runs `beside` the call on the side stream, only with WS_BESIDE_DA."""
    if WS_GEMM in ("", "0") or _INTERPRET or a.device.type != "cuda" or not arena or c.n == 0:
        return None
    if beside and not WS_BESIDE_DA:
        return None
    if a.dtype not in (torch.bfloat16, torch.float16) or out_dtype != a.dtype or p.dtype != torch.float32:
        return None
    if b_kn.shape[1] < WS_MIN_WIDTH or not _tma_ok(a, b_kn):
        return None
    from kernels.ws_gemm import serves

    return WS_GEMM if serves(a.device) else None


def _gemm_launch(c: _Ctx, a, b_kn, bias, p, w, w_strides, woff, arena: int, out_dtype,  # noqa: ANN001
                 gemm: str | None = None, beside: bool = False) -> torch.Tensor:
    """a [T, K] @ b_kn [K, NC] (+ bias) + s_i p_i W_i into a new [T, NC] tensor (`gemm`: the
    variant, see GEMM_VARIANTS; TMA variants fall back to pointer loads where TMA cannot load;
    `beside`: dA runs beside it on the side stream)."""
    variant = gemm_variant(gemm, device=a.device)
    base, prefetch = variant.split("+")[0], variant.endswith("+pf")
    t, k = a.shape
    nc = b_kn.shape[1]
    out = torch.empty((t, nc), dtype=out_dtype, device=a.device)
    if gemm is None and (ws := _ws_takes(c, a, b_kn, p, arena, out_dtype, beside)) is not None:
        from kernels.ws_gemm import ws_gemm

        b_nk = b_kn.stride(0) == 1
        lora = (p, w, woff, c.offsets, c.ranks, c.scales, c.r_max, 16 if c.r_max <= 16 else 32)
        return ws_gemm(a, b_kn.t() if b_nk else b_kn, out, b_nk, c.offsets[c.n:c.n + 1], variant=ws,
                       bias=bias, lora=lora)
    grid = lambda meta: (cdiv(t, meta["BLOCK_M"]) * cdiv(nc, meta["BLOCK_N"]),)  # noqa: E731
    common = (c.n, c.r_max, c.t_bucket)
    meta = dict(c.epilogue(bias, arena, prefetch), **_gemm_rank_tile(c.r_max))
    bias_arg = bias if bias is not None else out

    def cublas() -> torch.Tensor:  # the LoRA term (+ bias) stored by the pointer kernel's epilogue, cuBLAS over it
        store_launch(c, a, b_kn, out, bias, p, w, w_strides, woff, arena)
        return out.addmm_(a, b_kn)

    if base == "cublas":
        return cublas()
    if base != "ptr" and _tma_ok(a, b_kn):
        # device-side descriptors need a little global scratch per program. Triton keeps its
        # allocator in a context variable, which the autograd engine's thread (the backward) does
        # not inherit: set it at every launch, in whichever thread launches
        triton.set_allocator(tma_scratch)
        sms = _num_sms(a.device)
        kernel, kgrid = _gemm_lora_tma, grid
        if base in ("persist", "auto"):
            kernel = _gemm_lora_persist
            kgrid = lambda meta: (min(sms, cdiv(t, meta["BLOCK_M"]) * cdiv(nc, meta["BLOCK_N"])),)  # noqa: E731
        args = (a, b_kn, out, bias_arg, p, w, woff, c.offsets, c.ranks, c.scales, t, nc, k, *common,
                a.stride(0), b_kn.stride(0), b_kn.stride(1), out.stride(0), out.stride(1), p.stride(0), *w_strides)
        kw = dict(B_NK=b_kn.stride(0) == 1, NUM_SMS=sms, **meta)
        cfg = kernel.choose(kgrid, args, kw)
        tiles = cdiv(t, cfg.kwargs["BLOCK_M"]) * cdiv(nc, cfg.kwargs["BLOCK_N"])
        if base == "auto" and auto_takes_cublas(tiles, sms, nc):
            return cublas()  # over every tile (`grid`), not the persistent programs' count
        kernel.run_config(cfg, kgrid, args, kw)
        return out
    _gemm_lora[grid](
        a, b_kn, out, bias_arg, p, w, woff, c.offsets, c.ranks, c.scales, t, nc, k, *common,
        a.stride(0), a.stride(1), b_kn.stride(0), b_kn.stride(1), out.stride(0), out.stride(1), p.stride(0),
        *w_strides, **meta,
    )
    return out


def store_launch(c: _Ctx, a, b_kn, out, bias, p, w, w_strides, woff, arena: int) -> None:  # noqa: ANN001
    """The "cublas" variant's first pass: out = s_i P[rows_i] W_i (+ bias), the pointer kernel's epilogue alone
    (K = 0; a and b_kn give only their strides), for cuBLAS to add a @ b_kn onto."""
    t, nc = out.shape
    meta = dict(c.epilogue(bias, arena, False), **_store_rank_tile(c.r_max))
    _lora_store[lambda m: (cdiv(t, m["BLOCK_M"]) * cdiv(nc, m["BLOCK_N"]),)](
        a, b_kn, out, bias if bias is not None else out, p, w, woff, c.offsets, c.ranks, c.scales, t, nc, 0, c.n,
        c.r_max, c.t_bucket, a.stride(0), a.stride(1), b_kn.stride(0), b_kn.stride(1), out.stride(0), out.stride(1),
        p.stride(0), *w_strides, **meta,
    )


# Rank-major views of the weights: A_i and B_i^T as [r, C] with (adapter, rank, column) strides.
def _stacked_a(lora_a: torch.Tensor) -> tuple[int, int, int]:
    return lora_a.stride(0), lora_a.stride(2), lora_a.stride(1)     # lora_a [N, d_in, r]


def _stacked_b(lora_b: torch.Tensor) -> tuple[int, int, int]:
    return lora_b.stride(0), lora_b.stride(1), lora_b.stride(2)     # lora_b [N, r, d_out]


def _arena_rank_major(cols: int) -> tuple[int, int, int]:
    return 0, cols, 1  # arena blocks are [r, cols] row-major at per-adapter offsets (stride unused)


def fused_forward(c: _Ctx, x, weight, bias, a, a_strides, aoff, b, b_strides, boff, arena: int,  # noqa: ANN001
                  gemm: str | None = None):
    """(y, S): S = X A_i^T by `_shrink`, then y from the fused GEMM."""
    s_buf = torch.empty((c.t, c.r_max), dtype=_acc_torch(x.dtype), device=x.device)
    _shrink_launch(c, x, a, a_strides, aoff, s_buf, arena)
    y = _gemm_launch(c, x, weight.t(), bias, s_buf, b, b_strides, boff, arena, x.dtype, gemm)
    return y, s_buf


# dA (s dS^T X) feeds nothing of the layer's backward but the gradient arena. With $LORAPLEX_DA_SIDE_STREAM=1 it
# runs on a side stream beside the dX GEMM, whose last round of tiles leaves SMs idle at a small step's sizes (a
# 1,536-row 4096-wide output is 1.45 rounds of 128 x 256 tiles on 132 SMs; dA is 3.0-4.8 ms of a 2-job step,
# bench/results/session52_h200.md). The side stream forks from the current one after dS and joins back before the
# call returns: every tensor dA reads is alive until then and nothing later is reordered, in an eager step and
# inside a graph capture alike (the capture gets two branches). On by default since session 53's H200 run: the
# 200-step task's 147 plain replays 17.04 -> 16.84 s, its eager 8-job steps 4.59 -> 4.49 s; =0 keeps dA in line.
DA_SIDE_STREAM = os.environ.get("LORAPLEX_DA_SIDE_STREAM", "1") == "1"
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The device's side stream for dA (created once, outside any capture in practice: a step class runs
    eagerly before it is captured), or None where dA stays on the current stream."""
    if not DA_SIDE_STREAM or device.type != "cuda" or _INTERPRET:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def fused_backward(c: _Ctx, x, dy, s_buf, weight, a, a_strides, aoff, b, b_strides, boff, da, da_strides,
                   db, db_strides, arena: int, need_x: bool, need_a: bool, need_b: bool, onepass: bool,  # noqa: ANN001
                   gemm: str | None = None):
    """Adds dA_i into da and dB_i^T into db (at the adapters' blocks); returns dX (or None)."""
    ds = torch.empty((c.t, c.r_max), dtype=_acc_torch(x.dtype), device=x.device)
    fuse_db = need_b and onepass
    _shrink_launch(c, dy, b, b_strides, boff, ds, arena, wgrad=(s_buf, db, boff) if fuse_db else None)
    if need_b and not fuse_db:
        _wgrad_launch(c, s_buf, dy, db, db_strides, boff, arena)
    side = _side_stream(x.device) if need_a and need_x else None
    if need_a and side is None:
        _wgrad_launch(c, ds, x, da, da_strides, aoff, arena)
    if not need_x:
        return None
    if side is None:
        return _gemm_launch(c, dy, weight, None, ds, a, a_strides, aoff, arena, dy.dtype, gemm)
    main = torch.cuda.current_stream(x.device)
    side.wait_stream(main)
    try:
        with torch.cuda.stream(side):
            _wgrad_launch(c, ds, x, da, da_strides, aoff, arena)
        return _gemm_launch(c, dy, weight, None, ds, a, a_strides, aoff, arena, dy.dtype, gemm, beside=True)
    finally:  # joined even where a launch raised: nothing freed here is still read there, no capture branch left open
        main.wait_stream(side)


class FusedMultiLoraFn(torch.autograd.Function):
    """Stacked form on the fused kernels; dA/dB land in one fresh accumulator, cast once."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scales, ranks, offsets, onepass, gemm):  # noqa: D102
        n, _, r_max = lora_a.shape
        c = _Ctx(x, n, r_max, offsets, ranks, scales)
        if c.t == 0:
            y, s_buf = torch.nn.functional.linear(x, weight, bias), x.new_empty((0, r_max))
        else:
            y, s_buf = fused_forward(c, x, weight, bias, lora_a, _stacked_a(lora_a), offsets, lora_b,
                                     _stacked_b(lora_b), offsets, False, gemm)
        ctx.save_for_backward(x, weight, lora_a, lora_b, scales, ranks, offsets, s_buf)
        ctx.onepass, ctx.gemm = onepass, gemm
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, weight, lora_a, lora_b, scales, ranks, offsets, s_buf = ctx.saved_tensors
        need_x, need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        n, _, r_max = lora_a.shape
        c = _Ctx(x, n, r_max, offsets, ranks, scales)
        flat = torch.zeros(lora_a.numel() + lora_b.numel(), dtype=_acc_torch(x.dtype), device=x.device)
        da = flat[: lora_a.numel()].view(lora_a.shape)
        db = flat[lora_a.numel():].view(lora_b.shape)
        if lora_b.stride() != db.stride():  # the one-pass dB reuses B's strides for its gradient
            lora_b = lora_b.contiguous()
        if c.t == 0:
            dx = dy @ weight if need_x else None
        else:
            dx = fused_backward(c, x, dy, s_buf, weight, lora_a, _stacked_a(lora_a), offsets, lora_b,
                                _stacked_b(lora_b), offsets, da, _stacked_a(da), db, _stacked_b(db), False,
                                need_x, need_a, need_b, ctx.onepass, ctx.gemm)
        out = flat.to(lora_a.dtype)
        da = out[: lora_a.numel()].view(lora_a.shape) if need_a else None
        db = out[lora_a.numel():].view(lora_b.shape) if need_b else None
        return dx, None, None, da, db, None, None, None, None, None


def multilora_linear_fused(x, weight, bias, lora_a, lora_b, scales, ranks, offsets, onepass: bool = True,  # noqa: ANN001
                           tma: bool | None = None, gemm: str | None = None):
    """Fused Triton form of `kernels.multilora_linear` (same contract). onepass: dS and dB from
    one read of dY (atomics per row tile) instead of two; gemm: the GEMMs' variant (GEMM_VARIANTS;
    None: `tma` True/False for "tma"/"ptr", else the process default)."""
    _check(x, weight, bias, lora_a, lora_b, scales, ranks, offsets)
    dev = x.device
    if scales.device != dev or ranks.device != dev or offsets.device != dev:
        scales, ranks, offsets = scales.to(dev), ranks.to(dev), offsets.to(dev)
    return FusedMultiLoraFn.apply(x, weight, bias, lora_a, lora_b, scales, ranks, offsets, onepass,
                                 gemm_variant(gemm, tma, x.device))


class FusedArenaFn(torch.autograd.Function):
    """Arena form on the fused kernels: gradients added into grad_arena at the adapters' offsets."""

    @staticmethod
    def forward(ctx, x, weight, bias, arena, grad_arena, a_off, b_off, scales, ranks, offsets, r_max, token,  # noqa: D102
                onepass, aligned):
        d_in, d_out = x.shape[1], weight.shape[0]
        c = _Ctx(x, scales.shape[0], r_max, offsets, ranks, scales)
        mode = _arena_mode(aligned, arena, grad_arena, d_in, d_out)
        if c.t == 0 or c.n == 0:
            y, s_buf = torch.nn.functional.linear(x, weight, bias), x.new_empty((0, r_max))
        else:
            y, s_buf = fused_forward(c, x, weight, bias, arena, _arena_rank_major(d_in), a_off, arena,
                                     _arena_rank_major(d_out), b_off, mode)
        ctx.save_for_backward(x, weight, arena, a_off, b_off, scales, ranks, offsets, s_buf)
        ctx.grad_arena, ctx.r_max, ctx.onepass, ctx.mode = grad_arena, r_max, onepass, mode
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, weight, arena, a_off, b_off, scales, ranks, offsets, s_buf = ctx.saved_tensors
        g = ctx.grad_arena
        need_x = ctx.needs_input_grad[0]
        d_in, d_out = x.shape[1], weight.shape[0]
        c = _Ctx(x, scales.shape[0], ctx.r_max, offsets, ranks, scales)
        dy = dy.contiguous()
        if c.t == 0 or c.n == 0:
            dx = dy @ weight if need_x else None
        else:
            sa, sb = _arena_rank_major(d_in), _arena_rank_major(d_out)
            dx = fused_backward(c, x, dy, s_buf, weight, arena, sa, a_off, arena, sb, b_off, g, sa, g, sb, ctx.mode,
                                need_x, True, True, ctx.onepass)
        return (dx,) + (None,) * 13


def _arena_mode(aligned: bool, arena: torch.Tensor, grad_arena: torch.Tensor, d_in: int, d_out: int) -> int:
    """The kernels' ARENA constexpr: 16 where every block starts 16-element aligned (the caller's
    word for the offsets, checked here for the buffers and the blocks' row lengths), else 1."""
    ok = (aligned and d_in % 16 == 0 and d_out % 16 == 0 and arena.data_ptr() % 32 == 0
          and grad_arena.data_ptr() % 64 == 0)
    return 16 if ok else 1


def multilora_linear_arena_fused(x, weight, bias, arena, grad_arena, a_off, b_off, scales, ranks, offsets, r_max,
                                 token, onepass: bool = True, aligned: bool = False) -> torch.Tensor:  # noqa: ANN001
    """Fused Triton form of `kernels.multilora_linear_arena` (same contract). aligned: the caller
    vouches that every offset in a_off and b_off is a multiple of 16 elements (the kernels then load
    the adapters' rows as 16-byte vectors)."""
    _check_arena(x, weight, arena, grad_arena)
    return FusedArenaFn.apply(x, weight, bias, arena, grad_arena, a_off, b_off, scales, ranks, offsets, r_max,
                              token, onepass, bool(aligned))
