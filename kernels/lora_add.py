"""The LoRA term added onto a GEMM's output in place ("overlap"): out += s_i P[rows_i, :r_i] W_i (+ bias), for the
GEMMs "auto" gives to cuBLAS, when $LORAPLEX_LORA_OVERLAP=1 (`kernels.fused_lora.fused_forward`/`fused_backward`).

Today such a GEMM runs three passes in a row: the LoRA pass that makes P (the forward's shrink S = X A^T, the
backward's dS = dY B with dB), the store pass (out = s P W), then cuBLAS with beta = 1 over it. cuBLAS's tiles
at a small step leave its last round of programs under 75% busy (`fused_lora.auto_takes_cublas`), and the LoRA
pass is latency-bound on few SMs. With the overlap, the LoRA pass runs on the side stream beside cuBLAS's
beta = 0 GEMM, and this kernel then adds the term: one TMA load of the output tile, the adapters' rank-block
dots (the store pass's math), one TMA store. Its offsets inside P and W are 32-bit, and W_i's start is added
once. Rows of no adapter keep cuBLAS's output (+ bias). An output TMA cannot load and store (not 16-byte
aligned, a row stride that is not, a column stride other than 1, float64) keeps the three passes.

Tile: $LORAPLEX_LORA_ADD_TILE="BLOCK_M,BLOCK_N,warps" (default 64,256,4: the best TMA-stored tile of session
64's sweep, bench/results/session64_h200.md).
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
def _lora_add_tma_jit(
    c_desc, bias_ptr, p_ptr, w_ptr, woff_ptr, off_ptr, rank_ptr, scale_ptr,
    M, NC, N, R_MAX,
    stride_pm, stride_wn, stride_wr, stride_wc,
    HAS_BIAS: tl.constexpr, N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, ARENA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[tile] += s_i P[rows_i, :r_i] @ W_i[:, cols] (+ bias) over the adapters whose rows meet the tile, the
    tile loaded and stored by TMA. W_i [r_i, NC] at (adapter, rank, column) strides (ARENA: at woff[i] in a flat
    arena)."""
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
    acc = c_desc.load([m0, n0]).to(ACC)
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


def parse_tile(text: str) -> list[int]:
    """A tile string ("BLOCK_M,BLOCK_N,warps") as its numbers; ValueError naming what is wrong."""
    try:
        v = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"LoRA add tile {text!r}: expected integers 'BLOCK_M,BLOCK_N,warps'") from None
    if len(v) != 3 or min(v) < 1 or any(x & (x - 1) for x in v):
        raise ValueError(f"LoRA add tile {text!r}: expected three powers of two")
    return v


# under the interpreter one small tile
TILE = parse_tile(os.environ.get("LORAPLEX_LORA_ADD_TILE", "16,16,1" if _INTERPRET else "64,256,4"))


def rank_tile(r_max: int) -> int:
    """The rank tile: 16 where no adapter needs more, else 32 (the tile form's choice, `_gemm_rank_tile`)."""
    return 16 if r_max <= 16 else 32


def tma_ok(out: torch.Tensor) -> bool:
    """Whether TMA can load and store `out`: unit column stride, 16-byte aligned base and row stride."""
    es = out.element_size()
    return (out.dim() == 2 and out.stride(1) == 1 and out.data_ptr() % 16 == 0 and (out.stride(0) * es) % 16 == 0
            and out.dtype in (torch.bfloat16, torch.float16, torch.float32))


def add_launch(c, out: torch.Tensor, bias: torch.Tensor | None, p: torch.Tensor, w: torch.Tensor,  # noqa: ANN001
               w_strides: tuple[int, int, int], woff: torch.Tensor, arena: int, tile: list[int] | None = None) -> None:
    """out [T, NC] += s_i P[rows_i] W_i (+ bias), in place (`c`: kernels.fused_lora._Ctx). The caller checks
    `tma_ok(out)`."""
    block_m, block_n, warps = tile or TILE
    t, nc = out.shape
    desc = TensorDescriptor(out, shape=[t, nc], strides=[out.stride(0), 1], block_shape=[block_m, block_n])
    grid = (triton.cdiv(t, block_m) * triton.cdiv(nc, block_n),)
    _lora_add_tma_jit[grid](
        desc, bias if bias is not None else out, p, w, woff, c.offsets, c.ranks, c.scales, t, nc, c.n, c.r_max,
        p.stride(0), *w_strides,
        HAS_BIAS=bias is not None, N_P2=c.n_p2, ACC=c.acc, DOT_PREC=c.prec, ARENA=arena, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_R=rank_tile(c.r_max), GROUP_M=8, num_warps=warps, num_stages=1)
