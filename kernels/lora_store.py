"""The "cublas" variant's store pass with a TMA store ("tma"): out = s_i P[rows_i, :r_i] W_i (+ bias), the LoRA
term cuBLAS then adds the base GEMM onto (beta = 1), as `kernels.fused_lora.store_launch` writes it.

The tile form (`_lora_store`: the pointer GEMM's epilogue alone) is bound by its instructions, not its bytes.
Nsight Compute on an H200 (bench/ncu_passes.py, session 64) found it at 255 registers a thread (2 programs an
SM, 12.5% occupancy, 1.45 waves), the integer pipe its busiest, ~1,700 instructions a warp for a 64 x 256 tile,
and its warps stalled on "wait" (fixed-latency dependencies) more than on memory. The output tile's 64-bit
address and mask of every element, computed in registers, cost more than the bytes they move. This form keeps
the tile form's math (the same adapters, rank blocks and dot), but it differs in three places:

- the tile goes out by one TMA store, through a host-made descriptor of `out`; rows and columns past the
  tensor are clipped by the copy engine, so no element carries an address or a mask;
- P's and W's offsets are 32-bit inside their blocks (P is [T, r_max] fp32, W_i one adapter's [r_i, NC] rows),
  and W_i's start is added once as a 64-bit base;
- each adapter's values are picked from the metadata once, not per rank block.

Rows of no adapter (padding past offsets[N], an empty adapter) get zeros (+ bias), as the tile form gives them.
Which form a process runs: $LORAPLEX_LORA_STORE_FORM ("tile", the default until measured on a device, or
"tma"). The tile: $LORAPLEX_LORA_STORE_TMA="BLOCK_M,BLOCK_N,warps" (default 64,256,8). An output TMA cannot
store (not 16-byte aligned, a row stride that is not, a column stride other than 1) takes the tile form.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.fused_lora import _adapter_span, _lora_meta, _pick, _tile_of

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit(do_not_specialize=["M", "N"],
            do_not_specialize_on_alignment=["woff_ptr", "off_ptr", "rank_ptr", "scale_ptr"])
def _lora_store_tma_jit(
    c_desc, bias_ptr, p_ptr, w_ptr, woff_ptr, off_ptr, rank_ptr, scale_ptr,
    M, NC, N, R_MAX,
    stride_pm, stride_wn, stride_wr, stride_wc,
    HAS_BIAS: tl.constexpr, N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, ARENA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[tile] = s_i P[rows_i, :r_i] @ W_i[:, cols] (+ bias) over the adapters whose rows meet the tile, stored
    by TMA. W_i [r_i, NC] at (adapter, rank, column) strides (ARENA: at woff[i] in a flat arena)."""
    pid_m, pid_n = _tile_of(tl.program_id(0), M, NC, BLOCK_M, BLOCK_N, GROUP_M)
    live, lo, hi, rk, sc, wo = _lora_meta(off_ptr, rank_ptr, scale_ptr, woff_ptr, N, R_MAX, N_P2, ACC, ARENA)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    n_mask = rn < NC
    idx = tl.arange(0, N_P2)
    first, last = _adapter_span(m0, live, lo, hi, BLOCK_M)
    dtype = w_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for i in range(first, last):
        rank = _pick(rk, idx, i)
        rows_i = (rm >= _pick(lo, idx, i)) & (rm < _pick(hi, idx, i))
        scale = _pick(sc, idx, i)
        if ARENA:
            w_off = _pick(wo, idx, i)
            if ARENA == 16:
                w_off = tl.multiple_of(w_off, 16)
        else:
            w_off = tl.cast(i, tl.int64) * stride_wn
        w_base = w_ptr + w_off
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + tl.arange(0, BLOCK_R)
            r_mask = rr < rank
            # the mask is constant over R_MAX's aligned column runs (16-byte vectors); the columns past the
            # adapter's rank hold no value of its own and are zeroed after the load
            pt = tl.load(p_ptr + rm[:, None] * stride_pm + rr[None, :], mask=rows_i[:, None] & (rr < R_MAX)[None, :],
                         other=0.0)
            pt = (tl.where(r_mask[None, :], pt, 0.0) * scale).to(dtype)
            wt = tl.load(w_base + rr[:, None] * stride_wr + rn[None, :] * stride_wc,
                         mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(pt, wt, acc, input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(ACC)[None, :]
    c_desc.store([m0, n0], acc.to(c_desc.dtype))


FORMS = ("tile", "tma")
FORM = os.environ.get("LORAPLEX_LORA_STORE_FORM", "tile")
if FORM not in FORMS:
    raise ValueError(f"LORAPLEX_LORA_STORE_FORM must be one of {FORMS}, got {FORM!r}")


def parse_tile(text: str) -> list[int]:
    """A TMA store tile string ("BLOCK_M,BLOCK_N,warps") as its numbers; ValueError naming what is wrong."""
    try:
        v = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"TMA store tile {text!r}: expected integers 'BLOCK_M,BLOCK_N,warps'") from None
    if len(v) != 3 or min(v) < 1 or any(x & (x - 1) for x in v):
        raise ValueError(f"TMA store tile {text!r}: expected three powers of two")
    return v


# under the interpreter one small tile
TILE = parse_tile(os.environ.get("LORAPLEX_LORA_STORE_TMA", "16,16,1" if _INTERPRET else "64,256,8"))


def rank_tile(r_max: int) -> int:
    """The rank tile: 16 where no adapter needs more, else 32 (the tile form's choice, `_gemm_rank_tile`)."""
    return 16 if r_max <= 16 else 32


def tma_store_ok(out: torch.Tensor) -> bool:
    """Whether TMA can store `out`: unit column stride, 16-byte aligned base and row stride."""
    es = out.element_size()
    return (out.dim() == 2 and out.stride(1) == 1 and out.data_ptr() % 16 == 0 and (out.stride(0) * es) % 16 == 0
            and out.dtype in (torch.bfloat16, torch.float16, torch.float32))


def store_tma_launch(c, out: torch.Tensor, bias: torch.Tensor | None, p: torch.Tensor, w: torch.Tensor,  # noqa: ANN001
                     w_strides: tuple[int, int, int], woff: torch.Tensor, arena: int,
                     tile: list[int] | None = None) -> None:
    """out [T, NC] = s_i P[rows_i] W_i (+ bias) by TMA-stored tiles (`c`: kernels.fused_lora._Ctx). The caller
    checks `tma_store_ok(out)`."""
    block_m, block_n, warps = tile or TILE
    t, nc = out.shape
    desc = TensorDescriptor(out, shape=[t, nc], strides=[out.stride(0), 1], block_shape=[block_m, block_n])
    grid = (triton.cdiv(t, block_m) * triton.cdiv(nc, block_n),)
    _lora_store_tma_jit[grid](
        desc, bias if bias is not None else out, p, w, woff, c.offsets, c.ranks, c.scales, t, nc, c.n, c.r_max,
        p.stride(0), *w_strides,
        HAS_BIAS=bias is not None, N_P2=c.n_p2, ACC=c.acc, DOT_PREC=c.prec, ARENA=arena, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_R=rank_tile(c.r_max), GROUP_M=8, num_warps=warps, num_stages=1)
