"""Triton kernels of the grouped multi-LoRA operator and the autograd Function that wires them.

Layout contract: see `kernels.multilora` (x [T, d_in] grouped by adapter via offsets [N+1]).

Per call, one Triton launch each way and no host sync (grids depend on T and N only):
  forward   y = x @ W.T + b                        cuBLAS (F.linear)
            per row tile of adapter i: S = X_i A_i (kept in registers, also written to a
            [T, r_max] buffer for backward), then y += s_i S B_i in place     `_fwd_kernel`
  backward  dX = dY @ W                            cuBLAS
            per row tile: dS = s_i dY_i B_i^T (registers) and dB_i += s_i S_i^T dY_i while
            sweeping d_out, then dX += dS A_i^T and dA_i += X_i^T dS while sweeping d_in
                                                                              `_bwd_kernel`
Each program owns one (adapter, row tile) pair: it scans the offsets on the device (a prefix
sum over per-adapter tile counts) to find it; tiles never straddle two adapters; the grid is
cdiv(T, BLOCK_M) + N, the upper bound on the tile count, and spare programs do nothing.
Weight gradients reduce over row tiles with fp32 atomics into one zeroed buffer (so they are
not bit-reproducible run to run); padded rank entries are never touched and stay exact zeros.
v1 (four unfused kernels with 2D grids) is in git history and bench/NOTES_kernels.md: the
fused pair halves the launches and host work, which dominated at small T.
"""

from __future__ import annotations

import inspect
import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Under the interpreter one small config runs (no autotuning); tests vary BLOCK_M through the env.
_INTERP_BLOCK_M = int(os.environ.get("LORAPLEX_INTERPRET_BLOCK_M", "16"))


# Autotune choices persist across processes (in Triton's cache dir, $TRITON_CACHE_DIR) where the
# installed Triton supports it (3.4+: `cache_results`), so an executor does not re-tune on start.
AUTOTUNE_KW = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def _cfg(num_warps: int = 4, num_stages: int = 3, **meta: int) -> triton.Config:
    return triton.Config(meta, num_warps=num_warps, num_stages=num_stages)


def wide_dtype_pruner(wide: triton.Config, then=None):  # noqa: ANN001, ANN201
    """An autotuner pre-filter: calls on 4- or 8-byte inputs (fp32/fp64: no tensor-core path, so a
    correctness path on a GPU, not a fast one) run the one small config `wide` instead of tuning the
    list, whose large tiles each take many seconds to compile as FMA code (a first fp32 call at a new
    shape compiled for minutes); 16-bit inputs go on to `then` (another pre-filter) or the list.
    Under the interpreter the list (one config the tests size through the env) is kept."""

    def prune(configs: list[triton.Config], named_args: dict, **kw: object) -> list[triton.Config]:
        t = next((v for k, v in named_args.items() if k in ("x_ptr", "a_ptr", "m_ptr")), None)
        if not _INTERPRET and hasattr(t, "element_size") and t.element_size() >= 4:
            return [wide]
        return then(configs, named_args, **kw) if then is not None else configs

    return prune


if _INTERPRET:
    _FWD_CONFIGS = [_cfg(BLOCK_M=_INTERP_BLOCK_M, BLOCK_K=16, BLOCK_N=16)]
    _BWD_CONFIGS = [_cfg(BLOCK_M=_INTERP_BLOCK_M, BLOCK_K=16, BLOCK_N=16)]
else:  # a few Hopper-friendly shapes; small lists keep tuning short
    # BLOCK_M=16 gives small steps (T of a few thousand) enough programs to fill 132 SMs.
    _FWD_CONFIGS = [
        _cfg(BLOCK_M=64, BLOCK_K=128, BLOCK_N=128),
        _cfg(BLOCK_M=32, BLOCK_K=128, BLOCK_N=128, num_stages=4),
        _cfg(BLOCK_M=16, BLOCK_K=128, BLOCK_N=128, num_stages=4),
        _cfg(BLOCK_M=128, BLOCK_K=64, BLOCK_N=128, num_warps=8),
    ]
    _BWD_CONFIGS = [
        _cfg(BLOCK_M=64, BLOCK_K=128, BLOCK_N=128),
        _cfg(BLOCK_M=32, BLOCK_K=128, BLOCK_N=128, num_stages=4),
        _cfg(BLOCK_M=16, BLOCK_K=128, BLOCK_N=128, num_stages=4),
        _cfg(BLOCK_M=128, BLOCK_K=64, BLOCK_N=64, num_warps=8),
    ]


@triton.jit
def _find_tile(pid, off_ptr, N, BLOCK_M: tl.constexpr, N_P2: tl.constexpr):
    """Map program `pid` to (adapter, first row, end row); adapter = -1 for a spare program.

    Vectorised over adapters: tile counts from offsets, a prefix sum, one hit per program.
    """
    idx = tl.arange(0, N_P2)
    live = idx < N
    lo = tl.load(off_ptr + idx, mask=live, other=0).to(tl.int32)
    hi = tl.load(off_ptr + idx + 1, mask=live, other=0).to(tl.int32)
    n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(n_tiles, 0)
    tile_start = tile_end - n_tiles
    hit = (pid >= tile_start) & (pid < tile_end)
    adapter = tl.max(tl.where(hit, idx, -1), 0)
    row_start = tl.sum(tl.where(hit, lo + (pid - tile_start) * BLOCK_M, 0), 0)
    row_end = tl.sum(tl.where(hit, hi, 0), 0)
    return adapter, row_start, row_end


@triton.jit
def _tile_setup(off_ptr, rank_ptr, scale_ptr, N, R_MAX, BLOCK_M: tl.constexpr, N_P2: tl.constexpr,
                BLOCK_R: tl.constexpr, ACC: tl.constexpr):
    adapter, row_start, row_end = _find_tile(tl.program_id(0), off_ptr, N, BLOCK_M, N_P2)
    valid = adapter >= 0
    ad = tl.maximum(adapter, 0)
    rank = tl.where(valid, tl.minimum(tl.load(rank_ptr + ad).to(tl.int32), R_MAX), 0)
    scale = tl.load(scale_ptr + ad).to(ACC)
    rows = row_start + tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    return valid, ad.to(tl.int64), rows, rows < row_end, rr, rr < rank, scale


@triton.jit
def _adapter_base(ptr, ad, stride_n, off_ptr, ARENA: tl.constexpr):
    """Start of adapter `ad`'s block: `ad * stride_n` into a stacked tensor, or its own element
    offset `off_ptr[ad]` into an arena (one flat buffer holding every job's weights). ARENA == 16:
    the caller vouches that every offset is a multiple of 16 elements, so the compiler may load
    the block's rows as 16-byte vectors (unknown offsets allow only one element per load)."""
    if ARENA:
        off = tl.load(off_ptr + ad).to(tl.int64)
        if ARENA == 16:  # set where the value is made: the hint does not cross a function call
            off = tl.multiple_of(off, 16)
        return ptr + off
    return ptr + ad * stride_n


@triton.jit
def _shrink_sweep(acc, m_rows, stride_mc, row_mask, w_base, stride_wc, stride_wr, rr, r_mask, C, c_end,
                  st_t, g_base, g_scale, FUSE_WGRAD: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """acc += M[rows, :C] @ W[rr, :C]^T, sweeping C in BLOCK_K columns (W addressed (rank, col));
    with FUSE_WGRAD the same sweep adds g_scale * st_t @ M[rows, cols] into G at W's layout
    (atomics): the shrink S = X A (forward) and dS = dY B with dB (backward) of both forms."""
    for c0 in range(0, c_end, BLOCK_K):
        cs = c0 + tl.arange(0, BLOCK_K)
        c_mask = cs < C
        mt = tl.load(m_rows + cs[None, :] * stride_mc, mask=row_mask[:, None] & c_mask[None, :], other=0.0)
        wt = tl.load(w_base + cs[:, None] * stride_wc + rr[None, :] * stride_wr,
                     mask=c_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(mt, wt, acc, input_precision=DOT_PREC)
        if FUSE_WGRAD:
            part = tl.dot(st_t, mt, tl.zeros((st_t.shape[0], BLOCK_K), dtype=ACC), input_precision=DOT_PREC)
            tl.atomic_add(g_base + rr[:, None] * stride_wr + cs[None, :] * stride_wc, part * g_scale,
                          mask=r_mask[:, None] & c_mask[None, :], sem="relaxed")
    return acc


@triton.jit
def _fwd_jit(
    x_ptr, a_ptr, b_ptr, y_ptr, s_ptr, off_ptr, rank_ptr, scale_ptr, aoff_ptr, boff_ptr,
    N, K, D_OUT, R_MAX, T_BUCKET,
    stride_xm, stride_xk, stride_an, stride_ak, stride_ar, stride_bn, stride_br, stride_bo,
    stride_ym, stride_yn, stride_sm,
    BLOCK_R: tl.constexpr, N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr,
    ARENA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    valid, ad, rows, row_mask, rr, r_mask, scale = _tile_setup(
        off_ptr, rank_ptr, scale_ptr, N, R_MAX, BLOCK_M, N_P2, BLOCK_R, ACC)
    rows64 = rows.to(tl.int64)
    # shrink: S = X_i A_i over the whole d_in, for this row tile
    x_rows = x_ptr + rows64[:, None] * stride_xm
    a_base = _adapter_base(a_ptr, ad, stride_an, aoff_ptr, ARENA)
    k_end = tl.where(valid, K, 0)
    acc = _shrink_sweep(tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC), x_rows, stride_xk, row_mask, a_base, stride_ak,
                        stride_ar, rr, r_mask, K, k_end, a_base, a_base, scale, False, ACC, DOT_PREC, BLOCK_K)
    tl.store(s_ptr + rows64[:, None] * stride_sm + rr[None, :], acc,
             mask=row_mask[:, None] & (rr[None, :] < R_MAX))
    # expand: y += s_i S B_i, sweeping d_out
    sd = (acc * scale).to(b_ptr.dtype.element_ty)
    b_base = _adapter_base(b_ptr, ad, stride_bn, boff_ptr, ARENA)
    y_rows = y_ptr + rows64[:, None] * stride_ym
    n_end = tl.where(valid, D_OUT, 0)
    for n0 in range(0, n_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        c_mask = cols < D_OUT
        bt = tl.load(b_base + rr[:, None] * stride_br + cols[None, :] * stride_bo,
                     mask=r_mask[:, None] & c_mask[None, :], other=0.0)
        delta = tl.dot(sd, bt, tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC), input_precision=DOT_PREC)
        y_ptrs = y_rows + cols[None, :] * stride_yn
        mask = row_mask[:, None] & c_mask[None, :]
        yt = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (yt.to(ACC) + delta).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_jit(
    x_ptr, dy_ptr, s_ptr, a_ptr, b_ptr, dx_ptr, da_ptr, db_ptr, off_ptr, rank_ptr, scale_ptr,
    aoff_ptr, boff_ptr,
    N, K, D_OUT, R_MAX, T_BUCKET,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_sm, stride_an, stride_ak, stride_ar,
    stride_bn, stride_br, stride_bo, stride_dxm, stride_dxk,
    BLOCK_R: tl.constexpr, N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr,
    COMPUTE_DX: tl.constexpr, COMPUTE_DA: tl.constexpr, COMPUTE_DB: tl.constexpr, ARENA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    valid, ad, rows, row_mask, rr, r_mask, scale = _tile_setup(
        off_ptr, rank_ptr, scale_ptr, N, R_MAX, BLOCK_M, N_P2, BLOCK_R, ACC)
    rows64 = rows.to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    # sweep d_out: dS = dY_i B_i^T (scaled after), dB_i += s_i S^T dY_i (atomics over row tiles)
    st_t = tl.trans(tl.load(s_ptr + rows64[:, None] * stride_sm + rr[None, :],
                            mask=row_mask[:, None] & r_mask[None, :], other=0.0).to(dtype))
    dy_rows = dy_ptr + rows64[:, None] * stride_dym
    b_base = _adapter_base(b_ptr, ad, stride_bn, boff_ptr, ARENA)
    db_base = _adapter_base(db_ptr, ad, stride_bn, boff_ptr, ARENA)
    n_end = tl.where(valid, D_OUT, 0)
    ds = _shrink_sweep(tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC), dy_rows, stride_dyn, row_mask, b_base, stride_bo,
                       stride_br, rr, r_mask, D_OUT, n_end, st_t, db_base, scale, COMPUTE_DB, ACC, DOT_PREC, BLOCK_N)
    dsd = (ds * scale).to(dtype)
    # sweep d_in: dX += dS A_i^T (in place over cuBLAS's dY W), dA_i += X_i^T dS (atomics)
    x_rows = x_ptr + rows64[:, None] * stride_xm
    dx_rows = dx_ptr + rows64[:, None] * stride_dxm
    a_base = _adapter_base(a_ptr, ad, stride_an, aoff_ptr, ARENA)
    da_base = _adapter_base(da_ptr, ad, stride_an, aoff_ptr, ARENA)
    k_end = tl.where(valid, K, 0)
    if COMPUTE_DX or COMPUTE_DA:
        for k0 in range(0, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            tile_mask = row_mask[:, None] & k_mask[None, :]
            if COMPUTE_DX:
                at_t = tl.load(a_base + rr[:, None] * stride_ar + ks[None, :] * stride_ak,
                               mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                dxp = tl.dot(dsd, at_t, tl.zeros((BLOCK_M, BLOCK_K), dtype=ACC), input_precision=DOT_PREC)
                dx_ptrs = dx_rows + ks[None, :] * stride_dxk
                dxt = tl.load(dx_ptrs, mask=tile_mask, other=0.0)
                tl.store(dx_ptrs, (dxt.to(ACC) + dxp).to(dx_ptr.dtype.element_ty), mask=tile_mask)
            if COMPUTE_DA:
                xt = tl.load(x_rows + ks[None, :] * stride_xk, mask=tile_mask, other=0.0)
                dap = tl.dot(tl.trans(xt), dsd, tl.zeros((BLOCK_K, BLOCK_R), dtype=ACC), input_precision=DOT_PREC)
                tl.atomic_add(da_base + ks[:, None] * stride_ak + rr[None, :] * stride_ar, dap,
                              mask=k_mask[:, None] & r_mask[None, :], sem="relaxed")


_KEY = ["T_BUCKET", "K", "D_OUT", "R_MAX"]
# Every kernel here adds into caller-owned tensors (y, dx, dA/dB): `launch_restoring` keeps tuning
# trials' sums out of them.
# fp32/fp64 calls on a GPU run one small config (`wide_dtype_pruner`), forward and backward alike
_TUNE_KW = dict(AUTOTUNE_KW, prune_configs_by={
    "early_config_prune": wide_dtype_pruner(_cfg(BLOCK_M=32, BLOCK_K=64, BLOCK_N=64, num_stages=2))})
_fwd_kernel = triton.autotune(configs=_FWD_CONFIGS, key=_KEY, **_TUNE_KW)(_fwd_jit)
_bwd_kernel = triton.autotune(configs=_BWD_CONFIGS, key=_KEY, **_TUNE_KW)(_bwd_jit)
# Arena: gradients accumulate into the caller's arena that already holds other layers' sums, so
# tuning trials must not leave their sums there (nor zero it); `launch_restoring` saves and restores
# what the call adds into (dx and the adapters' blocks) around the one call that may tune.
_bwd_kernel_arena = triton.autotune(configs=_BWD_CONFIGS, key=_KEY, **_TUNE_KW)(_bwd_jit)
_TUNED: set[tuple] = set()  # tuning keys whose first call has run in this process


def launch_restoring(kernel, grid, key: tuple, spans, args: tuple, meta: dict) -> None:  # noqa: ANN001
    """Launch an autotuned kernel that adds into caller-owned tensors. Its first call per `key` may
    run tuning trials, each adding too: the ranges `spans()` returns ((1-D view, lo, hi), ...) are
    saved before that call and restored after it, then the call runs again with the chosen config.
    Not Triton's restore_value: that clones and copies back the WHOLE tensor inside every timed
    trial (a multi-GB gradient arena: milliseconds against a kernel of tens of microseconds), which
    makes the tuner's choice noise. Costs one host sync and one extra call, once per key."""
    if len(kernel.configs) == 1 or key in _TUNED:
        kernel[grid](*args, **meta)
        return
    saved = [(flat, lo, hi, flat[lo:hi].clone()) for flat, lo, hi in spans()]
    kernel[grid](*args, **meta)
    for flat, lo, hi, copy in saved:
        flat[lo:hi].copy_(copy)
    del saved
    kernel[grid](*args, **meta)
    _TUNED.add(key)


def arena_span(flat: torch.Tensor, offs: tuple[torch.Tensor, ...], sizes: tuple[int, ...]) -> tuple:
    """(flat, lo, hi): from the lowest block offset in `offs` to the end of the highest block
    (offs[j]'s blocks are sizes[j] elements long), within flat."""
    lo = min(int(o.min()) for o in offs)
    hi = max(int(o.max()) + size for o, size in zip(offs, sizes, strict=True))
    return flat, lo, min(hi, flat.numel())


def _meta(x: torch.Tensor, n: int, r_max: int, t: int) -> dict:
    return {
        "BLOCK_R": max(16, triton.next_power_of_2(r_max)),
        "N_P2": max(16, triton.next_power_of_2(n)),
        "ACC": tl.float64 if x.dtype == torch.float64 else tl.float32,
        "DOT_PREC": "ieee" if x.dtype in (torch.float32, torch.float64) else "tf32",
        # Tuning key: one bucket per power of two of T, so ragged steps reuse the choice.
        "T_BUCKET": triton.next_power_of_2(max(t, 1)),
    }


def _acc_torch(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(x, weight, bias, lora_a, lora_b, scales, ranks, offsets) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, d_in], got shape {tuple(x.shape)}")
    n, d_in, r_max = lora_a.shape
    d_out = weight.shape[0]
    if x.shape[1] != d_in or weight.shape != (d_out, d_in):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, lora_a {tuple(lora_a.shape)} disagree")
    if lora_b.shape != (n, r_max, d_out):
        raise ValueError(f"lora_b must be {(n, r_max, d_out)}, got {tuple(lora_b.shape)}")
    if bias is not None and bias.shape != (d_out,):
        raise ValueError(f"bias must be [{d_out}], got {tuple(bias.shape)}")
    if scales.shape != (n,) or ranks.shape != (n,) or offsets.shape != (n + 1,):
        raise ValueError("scales/ranks must be [N] and offsets [N+1]")
    if not (x.dtype == weight.dtype == lora_a.dtype == lora_b.dtype):
        raise ValueError("x, weight, lora_a and lora_b must share one dtype")
    if not (x.is_cuda or _INTERPRET):
        raise RuntimeError("Triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")


def _launch_fwd(x, a, b, y, s_buf, offsets, ranks, scales, n, d_out, r_max, w_strides, arena_offs) -> None:
    """One `_fwd_kernel` launch (T > 0). w_strides: A's (n, k, r) then B's (n, r, o) strides;
    arena_offs: None for stacked weights, else the (a_off, b_off) element offsets of the arena."""
    t, d_in = x.shape
    meta = _meta(x, n, r_max, t)
    aoff, boff = arena_offs if arena_offs is not None else (offsets, offsets)  # unread when stacked
    args = (x, a, b, y, s_buf, offsets, ranks, scales, aoff, boff, n, d_in, d_out, r_max, meta["T_BUCKET"],
            x.stride(0), x.stride(1), *w_strides, y.stride(0), y.stride(1), s_buf.stride(0))
    kw = dict(BLOCK_R=meta["BLOCK_R"], N_P2=meta["N_P2"], ACC=meta["ACC"], DOT_PREC=meta["DOT_PREC"],
              ARENA=arena_offs is not None)
    key = ("compose fwd", meta["T_BUCKET"], d_in, d_out, r_max, x.dtype, arena_offs is not None, x.device)
    launch_restoring(_fwd_kernel, lambda m: (triton.cdiv(t, m["BLOCK_M"]) + n,), key,
                     lambda: [(y, 0, y.shape[0])], args, kw)  # y: the base output the LoRA term adds to


def _launch_bwd(x, dy, s_buf, a, b, dx, da, db, offsets, ranks, scales, n, d_out, r_max, w_strides, arena_offs,
                need_a: bool, need_b: bool) -> None:
    """One backward launch (T > 0): `_bwd_kernel` for stacked weights (dA/dB into a fresh buffer),
    `_bwd_kernel_arena` for an arena (dA/dB added into the gradient arena at its offsets)."""
    t, d_in = x.shape
    meta = _meta(x, n, r_max, t)
    dx_arg = dx if dx is not None else x  # never written when COMPUTE_DX is False
    aoff, boff = arena_offs if arena_offs is not None else (offsets, offsets)  # unread when stacked
    grid = lambda m: (triton.cdiv(t, m["BLOCK_M"]) + n,)  # noqa: E731
    args = (x, dy, s_buf, a, b, dx_arg, da, db, offsets, ranks, scales, aoff, boff,
            n, d_in, d_out, r_max, meta["T_BUCKET"],
            x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), s_buf.stride(0),
            *w_strides, dx_arg.stride(0), dx_arg.stride(1))
    kw = dict(BLOCK_R=meta["BLOCK_R"], N_P2=meta["N_P2"], ACC=meta["ACC"], DOT_PREC=meta["DOT_PREC"],
              COMPUTE_DX=dx is not None, COMPUTE_DA=need_a, COMPUTE_DB=need_b, ARENA=arena_offs is not None)

    def spans() -> list:  # what the call adds into: dx (over cuBLAS's dY W) and the adapters' blocks
        if arena_offs is None:  # stacked: dA/dB in their own (zeroed) buffers
            out = [(da.view(-1), 0, da.numel()), (db.view(-1), 0, db.numel())]
        else:
            out = [arena_span(da.view(-1), (aoff, boff), (r_max * d_in, r_max * d_out))] if n else []
        return out + ([(dx, 0, dx.shape[0])] if dx is not None else [])

    key = ("compose bwd", meta["T_BUCKET"], d_in, d_out, r_max, x.dtype, dx is not None, need_a, need_b,
           arena_offs is not None, x.device)
    launch_restoring(_bwd_kernel if arena_offs is None else _bwd_kernel_arena, grid, key, spans, args, kw)


def lora_forward(x, lora_a, lora_b, scales, ranks, offsets, y, s_out=None) -> torch.Tensor:
    """Add s_i (X_i A_i) B_i into y in place; return the shrink S [T, r_max] (acc dtype) for backward.

    Every row of S is written (the buffer may be uninitialised; pass `s_out` to reuse one).
    """
    t = x.shape[0]
    n, _, r_max = lora_a.shape
    d_out = lora_b.shape[2]
    s_buf = s_out if s_out is not None else torch.empty((t, r_max), dtype=_acc_torch(x.dtype), device=x.device)
    if t == 0:
        return s_buf
    _launch_fwd(x, lora_a, lora_b, y, s_buf, offsets, ranks, scales, n, d_out, r_max,
                lora_a.stride() + lora_b.stride(), None)
    return s_buf


def lora_backward(x, dy, s_buf, lora_a, lora_b, scales, ranks, offsets, dx, need_a: bool, need_b: bool):
    """Grouped backward: adds dS A^T into dx (if given); returns (dA, dB) as views of one acc buffer."""
    t = x.shape[0]
    n, _, r_max = lora_a.shape
    d_out = lora_b.shape[2]
    n_a = lora_a.numel()
    flat = torch.zeros(n_a + lora_b.numel(), dtype=_acc_torch(x.dtype), device=x.device)
    da, db = flat[:n_a].view(lora_a.shape), flat[n_a:].view(lora_b.shape)
    if t > 0 and (dx is not None or need_a or need_b):
        # da/db use lora_a/lora_b's strides: make them contiguous-compatible views of `flat`.
        if lora_a.stride() != da.stride() or lora_b.stride() != db.stride():
            lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
        _launch_bwd(x, dy, s_buf, lora_a, lora_b, dx, da, db, offsets, ranks, scales, n, d_out, r_max,
                    lora_a.stride() + lora_b.stride(), None, need_a, need_b)
    return flat, (da if need_a else None), (db if need_b else None)


class MultiLoraLinearFn(torch.autograd.Function):
    """Autograd wiring: cuBLAS for the frozen base, the two Triton kernels above for the LoRA path."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scales, ranks, offsets):  # noqa: D102
        y = torch.nn.functional.linear(x, weight, bias)
        if not y.is_contiguous():
            y = y.contiguous()
        s_buf = lora_forward(x, lora_a, lora_b, scales, ranks, offsets, y)
        ctx.save_for_backward(x, weight, lora_a, lora_b, scales, ranks, offsets, s_buf)
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, weight, lora_a, lora_b, scales, ranks, offsets, s_buf = ctx.saved_tensors
        need_x, need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        dx = dy @ weight if need_x else None
        flat, da, db = lora_backward(x, dy, s_buf, lora_a, lora_b, scales, ranks, offsets, dx, need_a, need_b)
        if need_a or need_b:  # one cast for both weight gradients
            out = flat.to(lora_a.dtype)
            n_a = lora_a.numel()
            da = out[:n_a].view(lora_a.shape) if need_a else None
            db = out[n_a:].view(lora_b.shape) if need_b else None
        return dx, None, None, da, db, None, None, None


def multilora_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    ranks: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Triton backend of `kernels.multilora_linear` (same contract).

    scales/ranks/offsets are read in whatever float/int dtype they come in (no conversion
    kernels per call); they are only moved when they live on another device.
    """
    _check(x, weight, bias, lora_a, lora_b, scales, ranks, offsets)
    dev = x.device
    if scales.device != dev or ranks.device != dev or offsets.device != dev:
        scales, ranks, offsets = scales.to(dev), ranks.to(dev), offsets.to(dev)
    return MultiLoraLinearFn.apply(x, weight, bias, lora_a, lora_b, scales, ranks, offsets)


# ----- arena form: every job's weights in one flat buffer, gradients accumulated in place -----
def _arena_strides(d_in: int, d_out: int) -> tuple[int, ...]:
    # A_i is [r_i, d_in] row-major (PEFT's lora_A), B_i^T is [r_i, d_out] row-major; the adapter
    # stride is unused (per-adapter element offsets instead)
    return 0, 1, d_in, 0, d_out, 1


class MultiLoraArenaFn(torch.autograd.Function):
    """Autograd wiring of `multilora_linear_arena` on the Triton kernels (ARENA=True)."""

    @staticmethod
    def forward(ctx, x, weight, bias, arena, grad_arena, a_off, b_off, scales, ranks, offsets, r_max, token):  # noqa: D102
        y = torch.nn.functional.linear(x, weight, bias)
        if not y.is_contiguous():
            y = y.contiguous()
        t, d_in = x.shape
        n, d_out = scales.shape[0], weight.shape[0]
        s_buf = torch.empty((t, r_max), dtype=_acc_torch(x.dtype), device=x.device)
        if t > 0 and n > 0:
            _launch_fwd(x, arena, arena, y, s_buf, offsets, ranks, scales, n, d_out, r_max,
                        _arena_strides(d_in, d_out), (a_off, b_off))
        ctx.save_for_backward(x, weight, arena, a_off, b_off, scales, ranks, offsets, s_buf)
        ctx.grad_arena, ctx.r_max = grad_arena, r_max
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, weight, arena, a_off, b_off, scales, ranks, offsets, s_buf = ctx.saved_tensors
        grad_arena, r_max = ctx.grad_arena, ctx.r_max
        dy = dy.contiguous()
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        t, d_in = x.shape
        n, d_out = scales.shape[0], weight.shape[0]
        if t > 0 and n > 0:
            _launch_bwd(x, dy, s_buf, arena, arena, dx, grad_arena, grad_arena, offsets, ranks, scales, n, d_out,
                        r_max, _arena_strides(d_in, d_out), (a_off, b_off), True, True)
        return dx, None, None, None, None, None, None, None, None, None, None, None


def _check_arena(x, weight, arena, grad_arena) -> None:  # noqa: ANN001
    """The arena form's argument checks (both Triton forms)."""
    if not (x.is_cuda or _INTERPRET):
        raise RuntimeError("Triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if x.dtype != weight.dtype or arena.dtype != x.dtype:
        raise ValueError("x, weight and arena must share one dtype")
    if grad_arena.dtype != _acc_torch(x.dtype) or grad_arena.shape != arena.shape:
        raise ValueError(f"grad_arena must be {_acc_torch(x.dtype)} of the arena's shape")


def multilora_linear_arena_triton(x, weight, bias, arena, grad_arena, a_off, b_off, scales, ranks, offsets,
                                  r_max, token) -> torch.Tensor:
    """Triton backend of `kernels.multilora_linear_arena` (same contract)."""
    _check_arena(x, weight, arena, grad_arena)
    return MultiLoraArenaFn.apply(x, weight, bias, arena, grad_arena, a_off, b_off, scales, ranks, offsets,
                                  r_max, token)
