"""Triton kernels of the grouped multi-LoRA operator and the autograd Function that wires them.

Layout contract: see `kernels.multilora` (x [T, d_in] grouped by adapter via offsets [N+1]).

Per call (no host sync; the launch grids depend on T and N only):
  forward   y = x @ W.T + b                      cuBLAS (F.linear)
            S = X_i A_i           [T, r_max] fp32  `_shrink_kernel`   (one launch, all adapters)
            y += s_i S_i B_i      in place         `_expand_kernel`   (one launch)
  backward  dS = s_i dY_i B_i^T  and  dB_i += s_i S_i^T dY_i          `_bwd_ds_db_kernel`
            dX = dY @ W                          cuBLAS
            dX += dS_i A_i^T     and  dA_i += X_i^T dS_i               `_bwd_dx_da_kernel`
Every kernel walks a work list of (adapter, row tile) pairs: program `pid` scans offsets on the
device to find its adapter (tiles never straddle two adapters); the grid is sized
cdiv(T, BLOCK_M) + N, the upper bound on the tile count, and spare programs do nothing.
Weight gradients reduce over row tiles with fp32 atomics into zeroed buffers (so they are not
bit-reproducible run to run); padded rank entries are never touched and stay exact zeros.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Under the interpreter a single small config runs (no autotuning); SPLIT > 1 exercises the
# atomic split-reduction paths, SPLIT = 1 the plain-store paths (tests run both).
_INTERP_SPLIT = int(os.environ.get("LORAPLEX_INTERPRET_SPLIT", "2"))


def _cfg(num_warps: int = 4, num_stages: int = 3, **meta: int) -> triton.Config:
    return triton.Config(meta, num_warps=num_warps, num_stages=num_stages)


if _INTERPRET:
    _SHRINK_CONFIGS = [_cfg(BLOCK_M=16, BLOCK_K=16, SPLIT_K=_INTERP_SPLIT)]
    _EXPAND_CONFIGS = [_cfg(BLOCK_M=16, BLOCK_N=16)]
    _DS_DB_CONFIGS = [_cfg(BLOCK_M=16, BLOCK_N=16, SPLIT_N=_INTERP_SPLIT)]
    _DX_DA_CONFIGS = [_cfg(BLOCK_M=16, BLOCK_K=16, SPLIT_K=_INTERP_SPLIT)]
else:  # a few Hopper-friendly shapes; small lists keep tuning short
    _SHRINK_CONFIGS = [
        _cfg(BLOCK_M=64, BLOCK_K=128, SPLIT_K=1),
        _cfg(BLOCK_M=64, BLOCK_K=128, SPLIT_K=4),
        _cfg(BLOCK_M=128, BLOCK_K=64, SPLIT_K=2, num_stages=4),
        _cfg(BLOCK_M=32, BLOCK_K=128, SPLIT_K=8),
    ]
    _EXPAND_CONFIGS = [
        _cfg(BLOCK_M=64, BLOCK_N=128, num_stages=1),
        _cfg(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=1),
        _cfg(BLOCK_M=64, BLOCK_N=256, num_warps=8, num_stages=1),
    ]
    _DS_DB_CONFIGS = [
        _cfg(BLOCK_M=64, BLOCK_N=128, SPLIT_N=1),
        _cfg(BLOCK_M=64, BLOCK_N=128, SPLIT_N=4),
        _cfg(BLOCK_M=128, BLOCK_N=128, SPLIT_N=2, num_warps=8),
        _cfg(BLOCK_M=128, BLOCK_N=64, SPLIT_N=4),
    ]
    _DX_DA_CONFIGS = [
        _cfg(BLOCK_M=64, BLOCK_K=128, SPLIT_K=1),
        _cfg(BLOCK_M=64, BLOCK_K=128, SPLIT_K=4),
        _cfg(BLOCK_M=128, BLOCK_K=128, SPLIT_K=2, num_warps=8),
        _cfg(BLOCK_M=128, BLOCK_K=64, SPLIT_K=4),
    ]


@triton.jit
def _find_tile(pid, off_ptr, N, BLOCK_M: tl.constexpr, N_P2: tl.constexpr):
    """Map program `pid` to (adapter, first row, end row); adapter = -1 for a spare program.

    Vectorised over adapters: tile counts from offsets, a prefix sum, one hit per program.
    """
    idx = tl.arange(0, N_P2)
    live = idx < N
    lo = tl.load(off_ptr + idx, mask=live, other=0)
    hi = tl.load(off_ptr + idx + 1, mask=live, other=0)
    n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(n_tiles, 0)
    tile_start = tile_end - n_tiles
    hit = (pid >= tile_start) & (pid < tile_end)
    adapter = tl.max(tl.where(hit, idx, -1), 0)
    row_start = tl.sum(tl.where(hit, lo + (pid - tile_start) * BLOCK_M, 0), 0)
    row_end = tl.sum(tl.where(hit, hi, 0), 0)
    return adapter, row_start, row_end


@triton.autotune(configs=_SHRINK_CONFIGS, key=["T_BUCKET", "K", "R_MAX"], reset_to_zero=["s_ptr"])
@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, s_ptr, off_ptr, rank_ptr,
    N, K, R_MAX, T_BUCKET,
    stride_xm, stride_xk, stride_an, stride_ak, stride_ar, stride_sm,
    BLOCK_R: tl.constexpr, N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    adapter, row_start, row_end = _find_tile(pid_m, off_ptr, N, BLOCK_M, N_P2)
    valid = adapter >= 0
    ad = tl.maximum(adapter, 0)
    rank = tl.where(valid, tl.minimum(tl.load(rank_ptr + ad), R_MAX), 0)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    rr = tl.arange(0, BLOCK_R)
    r_mask = rr < rank
    k_chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_chunk
    k_hi = tl.where(valid, tl.minimum(K, k_lo + k_chunk), k_lo)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    a_base = a_ptr + ad.to(tl.int64) * stride_an
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_hi
        xt = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_base + ks[:, None] * stride_ak + rr[None, :] * stride_ar,
                     mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(xt, at, acc, input_precision=DOT_PREC)
    s_ptrs = s_ptr + rows.to(tl.int64)[:, None] * stride_sm + rr[None, :]
    out_mask = row_mask[:, None] & (rr[None, :] < R_MAX)
    if SPLIT_K == 1:
        tl.store(s_ptrs, acc, mask=out_mask)
    else:
        tl.atomic_add(s_ptrs, acc, mask=out_mask, sem="relaxed")


@triton.autotune(configs=_EXPAND_CONFIGS, key=["T_BUCKET", "D_OUT", "R_MAX"], restore_value=["y_ptr"])
@triton.jit
def _expand_kernel(
    y_ptr, s_ptr, b_ptr, off_ptr, rank_ptr, scale_ptr,
    N, D_OUT, R_MAX, T_BUCKET,
    stride_ym, stride_yn, stride_sm, stride_bn, stride_br, stride_bo,
    BLOCK_R: tl.constexpr, N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    adapter, row_start, row_end = _find_tile(pid_m, off_ptr, N, BLOCK_M, N_P2)
    valid = adapter >= 0
    ad = tl.maximum(adapter, 0)
    rank = tl.where(valid, tl.minimum(tl.load(rank_ptr + ad), R_MAX), 0)
    scale = tl.load(scale_ptr + ad).to(ACC)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < D_OUT
    rr = tl.arange(0, BLOCK_R)
    r_mask = rr < rank
    st = tl.load(s_ptr + rows.to(tl.int64)[:, None] * stride_sm + rr[None, :],
                 mask=row_mask[:, None] & r_mask[None, :], other=0.0)
    bt = tl.load(b_ptr + ad.to(tl.int64) * stride_bn + rr[:, None] * stride_br + cols[None, :] * stride_bo,
                 mask=r_mask[:, None] & col_mask[None, :], other=0.0)
    delta = tl.dot(st.to(bt.dtype), bt, tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC), input_precision=DOT_PREC)
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
    mask = row_mask[:, None] & col_mask[None, :]
    yt = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (yt.to(ACC) + scale * delta).to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_DS_DB_CONFIGS, key=["T_BUCKET", "D_OUT", "R_MAX"], reset_to_zero=["ds_ptr", "db_ptr"])
@triton.jit
def _bwd_ds_db_kernel(
    dy_ptr, s_ptr, b_ptr, ds_ptr, db_ptr, off_ptr, rank_ptr, scale_ptr,
    N, D_OUT, R_MAX, T_BUCKET,
    stride_dym, stride_dyn, stride_sm, stride_bn, stride_br, stride_bo, stride_dsm,
    BLOCK_R: tl.constexpr, N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, COMPUTE_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    adapter, row_start, row_end = _find_tile(pid_m, off_ptr, N, BLOCK_M, N_P2)
    valid = adapter >= 0
    ad = tl.maximum(adapter, 0)
    rank = tl.where(valid, tl.minimum(tl.load(rank_ptr + ad), R_MAX), 0)
    scale = tl.load(scale_ptr + ad).to(ACC)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    rr = tl.arange(0, BLOCK_R)
    r_mask = rr < rank
    n_chunk = tl.cdiv(tl.cdiv(D_OUT, SPLIT_N), BLOCK_N) * BLOCK_N
    n_lo = pid_n * n_chunk
    n_hi = tl.where(valid, tl.minimum(D_OUT, n_lo + n_chunk), n_lo)
    dy_rows = dy_ptr + rows.to(tl.int64)[:, None] * stride_dym
    b_base = b_ptr + ad.to(tl.int64) * stride_bn
    db_base = db_ptr + ad.to(tl.int64) * stride_bn
    st_t = tl.trans(tl.load(s_ptr + rows.to(tl.int64)[:, None] * stride_sm + rr[None, :],
                            mask=row_mask[:, None] & r_mask[None, :], other=0.0).to(dy_ptr.dtype.element_ty))
    ds_acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        c_mask = cols < n_hi
        dyt = tl.load(dy_rows + cols[None, :] * stride_dyn, mask=row_mask[:, None] & c_mask[None, :], other=0.0)
        bt_t = tl.load(b_base + cols[:, None] * stride_bo + rr[None, :] * stride_br,
                       mask=c_mask[:, None] & r_mask[None, :], other=0.0)
        ds_acc = tl.dot(dyt, bt_t, ds_acc, input_precision=DOT_PREC)
        if COMPUTE_DB:
            dbp = tl.dot(st_t, dyt, tl.zeros((BLOCK_R, BLOCK_N), dtype=ACC), input_precision=DOT_PREC)
            tl.atomic_add(db_base + rr[:, None] * stride_br + cols[None, :] * stride_bo, dbp * scale,
                          mask=r_mask[:, None] & c_mask[None, :], sem="relaxed")
    ds_ptrs = ds_ptr + rows.to(tl.int64)[:, None] * stride_dsm + rr[None, :]
    ds_mask = row_mask[:, None] & (rr[None, :] < R_MAX)
    if SPLIT_N == 1:
        tl.store(ds_ptrs, ds_acc * scale, mask=ds_mask)
    else:
        tl.atomic_add(ds_ptrs, ds_acc * scale, mask=ds_mask, sem="relaxed")


@triton.autotune(configs=_DX_DA_CONFIGS, key=["T_BUCKET", "K", "R_MAX"], reset_to_zero=["da_ptr"],
                 restore_value=["dx_ptr"])
@triton.jit
def _bwd_dx_da_kernel(
    x_ptr, ds_ptr, a_ptr, dx_ptr, da_ptr, off_ptr, rank_ptr,
    N, K, R_MAX, T_BUCKET,
    stride_xm, stride_xk, stride_dsm, stride_an, stride_ak, stride_ar,
    BLOCK_R: tl.constexpr, N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr,
    COMPUTE_DX: tl.constexpr, COMPUTE_DA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    adapter, row_start, row_end = _find_tile(pid_m, off_ptr, N, BLOCK_M, N_P2)
    valid = adapter >= 0
    ad = tl.maximum(adapter, 0)
    rank = tl.where(valid, tl.minimum(tl.load(rank_ptr + ad), R_MAX), 0)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    rr = tl.arange(0, BLOCK_R)
    r_mask = rr < rank
    k_chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_chunk
    k_hi = tl.where(valid, tl.minimum(K, k_lo + k_chunk), k_lo)
    dst = tl.load(ds_ptr + rows.to(tl.int64)[:, None] * stride_dsm + rr[None, :],
                  mask=row_mask[:, None] & r_mask[None, :], other=0.0).to(x_ptr.dtype.element_ty)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    dx_rows = dx_ptr + rows.to(tl.int64)[:, None] * stride_xm
    a_base = a_ptr + ad.to(tl.int64) * stride_an
    da_base = da_ptr + ad.to(tl.int64) * stride_an
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_hi
        tile_mask = row_mask[:, None] & k_mask[None, :]
        if COMPUTE_DX:
            at_t = tl.load(a_base + rr[:, None] * stride_ar + ks[None, :] * stride_ak,
                           mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            dxp = tl.dot(dst, at_t, tl.zeros((BLOCK_M, BLOCK_K), dtype=ACC), input_precision=DOT_PREC)
            dx_ptrs = dx_rows + ks[None, :] * stride_xk
            dxt = tl.load(dx_ptrs, mask=tile_mask, other=0.0)
            tl.store(dx_ptrs, (dxt.to(ACC) + dxp).to(dx_ptr.dtype.element_ty), mask=tile_mask)
        if COMPUTE_DA:
            xt = tl.load(x_rows + ks[None, :] * stride_xk, mask=tile_mask, other=0.0)
            dap = tl.dot(tl.trans(xt), dst, tl.zeros((BLOCK_K, BLOCK_R), dtype=ACC), input_precision=DOT_PREC)
            tl.atomic_add(da_base + ks[:, None] * stride_ak + rr[None, :] * stride_ar, dap,
                          mask=k_mask[:, None] & r_mask[None, :], sem="relaxed")


def _meta(x: torch.Tensor, n: int, r_max: int, t: int) -> dict:
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    prec = "ieee" if x.dtype in (torch.float32, torch.float64) else "tf32"
    return {
        "BLOCK_R": max(16, triton.next_power_of_2(r_max)),
        "N_P2": max(16, triton.next_power_of_2(n)),
        "ACC": acc,
        "DOT_PREC": prec,
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


def lora_forward(x, lora_a, lora_b, scales, ranks, offsets, y) -> torch.Tensor:
    """Add s_i (X_i A_i) B_i into y in place; return the fp32 shrink S [T, r_max] for backward."""
    t, d_in = x.shape
    n, _, r_max = lora_a.shape
    d_out = lora_b.shape[2]
    meta = _meta(x, n, r_max, t)
    s_buf = torch.zeros((t, r_max), dtype=_acc_torch(x.dtype), device=x.device)
    if t == 0 or n == 0:
        return s_buf
    _shrink_kernel[lambda m: (triton.cdiv(t, m["BLOCK_M"]) + n, m["SPLIT_K"])](
        x, lora_a, s_buf, offsets, ranks, n, d_in, r_max, meta["T_BUCKET"],
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), s_buf.stride(0),
        BLOCK_R=meta["BLOCK_R"], N_P2=meta["N_P2"], ACC=meta["ACC"], DOT_PREC=meta["DOT_PREC"],
    )
    _expand_kernel[lambda m: (triton.cdiv(t, m["BLOCK_M"]) + n, triton.cdiv(d_out, m["BLOCK_N"]))](
        y, s_buf, lora_b, offsets, ranks, scales, n, d_out, r_max, meta["T_BUCKET"],
        y.stride(0), y.stride(1), s_buf.stride(0), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        BLOCK_R=meta["BLOCK_R"], N_P2=meta["N_P2"], ACC=meta["ACC"], DOT_PREC=meta["DOT_PREC"],
    )
    return s_buf


def lora_backward(x, dy, s_buf, lora_a, lora_b, scales, ranks, offsets, dx, need_a: bool, need_b: bool):
    """Grouped backward: returns (dA, dB) in the acc dtype (None when not needed); adds dS A^T into dx."""
    t, d_in = x.shape
    n, _, r_max = lora_a.shape
    d_out = lora_b.shape[2]
    meta = _meta(x, n, r_max, t)
    acc = _acc_torch(x.dtype)
    ds_buf = torch.zeros((t, r_max), dtype=acc, device=x.device)
    db = torch.zeros(lora_b.shape, dtype=acc, device=x.device)
    da = torch.zeros(lora_a.shape, dtype=acc, device=x.device)
    if t > 0 and n > 0:
        _bwd_ds_db_kernel[lambda m: (triton.cdiv(t, m["BLOCK_M"]) + n, m["SPLIT_N"])](
            dy, s_buf, lora_b, ds_buf, db, offsets, ranks, scales, n, d_out, r_max, meta["T_BUCKET"],
            dy.stride(0), dy.stride(1), s_buf.stride(0), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
            ds_buf.stride(0),
            BLOCK_R=meta["BLOCK_R"], N_P2=meta["N_P2"], ACC=meta["ACC"], DOT_PREC=meta["DOT_PREC"], COMPUTE_DB=need_b,
        )
        if dx is not None or need_a:
            dx_arg = dx if dx is not None else x  # never written when COMPUTE_DX is False
            _bwd_dx_da_kernel[lambda m: (triton.cdiv(t, m["BLOCK_M"]) + n, m["SPLIT_K"])](
                x, ds_buf, lora_a, dx_arg, da, offsets, ranks, n, d_in, r_max, meta["T_BUCKET"],
                x.stride(0), x.stride(1), ds_buf.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
                BLOCK_R=meta["BLOCK_R"], N_P2=meta["N_P2"], ACC=meta["ACC"], DOT_PREC=meta["DOT_PREC"],
                COMPUTE_DX=dx is not None, COMPUTE_DA=need_a,
            )
    return (da if need_a else None), (db if need_b else None)


class MultiLoraLinearFn(torch.autograd.Function):
    """Autograd wiring: cuBLAS for the frozen base, the Triton kernels above for the LoRA path."""

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
        dy = dy.contiguous()
        dx = dy @ weight if need_x else None
        da, db = lora_backward(x, dy, s_buf, lora_a, lora_b, scales, ranks, offsets, dx, need_a, need_b)
        da = da.to(lora_a.dtype) if da is not None else None
        db = db.to(lora_b.dtype) if db is not None else None
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
    """Triton backend of `kernels.multilora_linear` (same contract)."""
    _check(x, weight, bias, lora_a, lora_b, scales, ranks, offsets)
    dev = x.device
    return MultiLoraLinearFn.apply(
        x.contiguous(), weight, bias, lora_a.contiguous(), lora_b.contiguous(),
        scales.to(device=dev, dtype=torch.float32).contiguous(),
        ranks.to(device=dev, dtype=torch.int32).contiguous(),
        offsets.to(device=dev, dtype=torch.int32).contiguous(),
    )
