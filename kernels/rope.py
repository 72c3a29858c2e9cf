"""Rotary position embedding in one Triton kernel each way (issue 40: transformers'
`apply_rotary_pos_emb` runs ~6 kernels a tensor each way: two muls, the half rotation's slices,
neg and cat, and the add; in search (a)'s evaluations its `mul`, `cat` and `add` kernels took
about 8% of the GPU time, bench/results/raw/eval_profile_s27_h100_call6.txt).

`rope(q, k, cos, sin)` is `apply_rotary_pos_emb(q, k, cos, sin)` of the Llama-style families:
`x * cos + rotate_half(x) * sin` with `rotate_half(x) = cat(-x2, x1)`, for q [B, Hq, L, D] and
k [B, Hk, L, D] (any strides with a unit last one: transformers passes transposed views of the
projections), cos and sin [B or 1, L, D]. It computes in float32 and rounds once, where the ops
round each product and the sum (a bfloat16 result is at least as close to a float64 oracle as
theirs, and within one of their roundings: not their bits); so does the backward
(`g * cos + rotate_half^T(g * sin)`). The outputs keep q's and k's strides (transformers'
attention then reads them as it read the ops' outputs). Nothing is kept for the backward but cos
and sin.

`rope_applies(...)` says whether a call has that form; anything else (partial rotary, other
layouts, mixed dtypes, a cos that needs a gradient) stays with the caller's own function.
Runs on CUDA tensors, or on the CPU under TRITON_INTERPRET=1 (how the tests check it).
"""
from __future__ import annotations

import torch

from kernels.norm_act import _INTERPRET, available

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU image has triton
    triton = None

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_ELEMENTS = 4096  # a program's share: heads of one token, up to this many elements

if triton is not None:
    # L (the positions, a new count every step) only sizes the grid and splits a row index: left
    # unspecialised, a new token count compiles nothing (the strides keep their alignment: H * D)
    @triton.jit(do_not_specialize=["L"])
    def _rope_kernel(X, C, S, Y, H, L, sxb, sxh, sxl, syb, syh, syl, scb, scl,
                     HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr):
        """One token's heads [BLOCK_H, D]: y1 = x1*c1 - x2*s1, y2 = x2*c2 + x1*s2 (forward); the
        backward is the same with (s1, s2) -> (-s2, -s1). In float32, rounded once."""
        row = tl.program_id(0).to(tl.int64)
        b = row // L
        t = row % L
        d = tl.arange(0, BLOCK_D)
        dm = d < HALF
        cs = b * scb + t * scl
        c1 = tl.load(C + cs + d, mask=dm, other=0.0).to(tl.float32)
        c2 = tl.load(C + cs + HALF + d, mask=dm, other=0.0).to(tl.float32)
        s1 = tl.load(S + cs + d, mask=dm, other=0.0).to(tl.float32)
        s2 = tl.load(S + cs + HALF + d, mask=dm, other=0.0).to(tl.float32)
        if BACKWARD:
            neg2 = -s2
            s2 = -s1
            s1 = neg2
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = (h < H)[:, None] & dm[None, :]
        xs = X + b * sxb + t * sxl + h[:, None].to(tl.int64) * sxh + d[None, :]
        x1 = tl.load(xs, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xs + HALF, mask=m, other=0.0).to(tl.float32)
        y1 = x1 * c1[None, :] - x2 * s1[None, :]
        y2 = x2 * c2[None, :] + x1 * s2[None, :]
        ys = Y + b * syb + t * syl + h[:, None].to(tl.int64) * syh + d[None, :]
        tl.store(ys, y1.to(Y.dtype.element_ty), mask=m)
        tl.store(ys + HALF, y2.to(Y.dtype.element_ty), mask=m)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [B, H, L, D] rotated (or its gradient, backward=True) into a tensor of x's strides."""
    bsz, heads, length, dim = x.shape
    y = torch.empty_like(x)  # x is dense (checked): its strides, e.g. the projection's [B, L, H, D]
    if x.numel() == 0:
        return y
    half = dim // 2
    block_d = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(heads), HEAD_ELEMENTS // (2 * block_d)))
    scb = cos.stride(0) if cos.shape[0] > 1 else 0  # one row of positions for every batch row
    grid = (bsz * length, triton.cdiv(heads, block_h))
    launch(_rope_kernel, grid, (x, cos, sin, y, heads, length, x.stride(0), x.stride(1), x.stride(2),
                                y.stride(0), y.stride(1), y.stride(2), scb, cos.stride(1)),
           {"HALF": half, "BLOCK_D": block_d, "BLOCK_H": block_h, "BACKWARD": backward,
            "num_warps": 1 if _INTERPRET else 4})
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # noqa: ANN205
        ctx.save_for_backward(cos, sin)
        return _rotate(q, cos, sin, False), _rotate(k, cos, sin, False)

    @staticmethod
    def backward(ctx, dq: torch.Tensor | None, dk: torch.Tensor | None):  # noqa: ANN205
        cos, sin = ctx.saved_tensors
        gq = _rotate(_dense(dq), cos, sin, True) if dq is not None and ctx.needs_input_grad[0] else None
        gk = _rotate(_dense(dk), cos, sin, True) if dk is not None and ctx.needs_input_grad[1] else None
        return gq, gk, None, None


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 and _non_overlapping_dense(t) else t.contiguous()


def _non_overlapping_dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill its storage span exactly once (empty_like then keeps its strides)."""
    if t.numel() == 0:
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def rope_applies(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1) -> bool:
    """Whether `rope` computes this call of the Llama-style function (see the module docstring)."""
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    bsz, _, length, dim = q.shape
    return (dim % 2 == 0 and k.shape[0] == bsz and k.shape[2] == length and k.shape[3] == dim
            and cos.shape[1] == length and cos.shape[2] == dim and cos.shape[0] in (1, bsz)
            and q.dtype in DTYPES and k.dtype == q.dtype and cos.dtype == q.dtype and sin.dtype == q.dtype
            and cos.stride() == sin.stride() and cos.stride(-1) == 1
            and not cos.requires_grad and not sin.requires_grad
            and q.stride(-1) == 1 and k.stride(-1) == 1
            and _non_overlapping_dense(q) and _non_overlapping_dense(k)
            and available(q) and q.device == k.device == cos.device == sin.device)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by the positions' cos and sin (the call must satisfy `rope_applies`)."""
    return _Rope.apply(q, k, cos, sin)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb (Llama's) in torch ops."""
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s

from kernels.lean_launch import launch  # noqa: E402 (here, not above: a line above a @triton.jit function moves it, and its first line is in its cache key)
