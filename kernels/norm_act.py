"""Fused RMSNorm, SiLU-gate and RoPE for a frozen backbone: one Triton kernel each way where
transformers' modules launch one kernel per elementwise op (issue 40: at 32 layers of the 8B shape the norms',
the MLP gate's and their casts' `mul`, `pow`, `copy_`, `add`, `rsqrt` kernels took about a quarter
of a training step's GPU time, bench/results/host_profile_h100_recompute.md).

- `rms_norm(x, weight, eps)`: transformers' Llama-style RMSNorm, `weight * (x32 * rsqrt(mean(x32^2) +
  eps)).to(x.dtype)`, rounded where the module rounds (the normalised row to x's dtype before the
  weight, the product to the output dtype). The weight is frozen: the backward gives x's gradient
  alone, and keeps x and one float32 rstd per row (the module kept a float32 copy of x).
- `silu_mul(gate, up)`: `silu(gate) * up` with silu's output rounded to gate's dtype first, as
  `act_fn(gate_proj(x)) * up_proj(x)` does; the backward recomputes the sigmoid from gate and keeps
  gate and up alone (autograd kept silu(gate) too: one intermediate-wide tensor a layer less).
- `rope(x, cos, sin)`: `x * cos + rotate_half(x) * sin` (transformers' apply_rotary_pos_emb for one
  of q and k), each product and the sum rounded as the bf16 ops round; the backward rotates the
  gradient back in one kernel. Any strides of x's leading dims (q arrives as a transposed view).

Each runs its Triton kernels on CUDA tensors (or on the CPU under TRITON_INTERPRET=1, how the tests
check them), and `*_reference` is the same computation in torch ops (the modules' own). Integer
arguments that change from step to step (rows) only size the grid: a new token count compiles
nothing.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU image has triton; the reference path still works
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ELEMENTS_PER_PROGRAM = 4096  # a program's share of rows (narrow rows: several per program)
SILU_BLOCK = 1024


def available(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on this tensor's device."""
    return triton is not None and (t.is_cuda or (_INTERPRET and t.device.type == "cpu"))


# ----------------------------------------------------------------------------- RMSNorm
if triton is not None:
    @triton.jit
    def _rms_fwd(X, W, Y, RSTD, n_rows, D, eps, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
        r1 = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rows = r1[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
        mask = (rows < n_rows) & (cols < D)
        x = tl.load(X + rows * D + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        xhat = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(Y + rows * D + cols, (xhat * w).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + r1, rstd, mask=r1 < n_rows)

    @triton.jit
    def _rms_bwd(DY, X, W, RSTD, DX, n_rows, D, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
        r1 = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rows = r1[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
        mask = (rows < n_rows) & (cols < D)
        x = tl.load(X + rows * D + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows * D + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r1, mask=r1 < n_rows, other=0.0)
        xhat = x * rstd[:, None]
        g = (dy * w).to(X.dtype.element_ty).to(tl.float32)  # the normalised row's gradient, as rounded
        dot = tl.sum(g * xhat, axis=1) / D
        dx = rstd[:, None] * (g - xhat * dot[:, None])
        tl.store(DX + rows * D + cols, dx.to(DX.dtype.element_ty), mask=mask)


def _rows_per_program(d: int) -> tuple[int, int]:
    block = triton.next_power_of_2(d)
    return block, max(1, min(64, ELEMENTS_PER_PROGRAM // block))


def _warps(block: int, rows: int) -> int:
    return 1 if _INTERPRET else max(1, min(16, block * rows // 512))


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype):  # noqa: ANN205
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        n, d = x2.shape
        y = torch.empty((n, d), dtype=out_dtype, device=x.device)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        block, rows = _rows_per_program(d)
        if n:
            _rms_fwd[(triton.cdiv(n, rows),)](x2, weight, y, rstd, n, d, float(eps), BLOCK_D=block, ROWS=rows,
                                              num_warps=_warps(block, rows))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # noqa: ANN205
        x2, weight, rstd = ctx.saved_tensors
        n, d = x2.shape
        dy2 = dy.reshape(n, d).contiguous()
        dx = torch.empty_like(x2)
        block, rows = _rows_per_program(d)
        if n:
            _rms_bwd[(triton.cdiv(n, rows),)](dy2, x2, weight, rstd, dx, n, d, BLOCK_D=block, ROWS=rows,
                                              num_warps=_warps(block, rows))
        return dx.view(ctx.shape), None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
             ) -> torch.Tensor:
    """Llama-style RMSNorm over the last dimension with a frozen weight (no gradient for it)."""
    if weight.requires_grad:
        raise ValueError("rms_norm: the weight must be frozen (its gradient is not computed)")
    out = out_dtype or torch.promote_types(x.dtype, weight.dtype)
    return _RmsNorm.apply(x, weight, eps, out)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward in torch ops."""
    x32 = x.to(torch.float32)
    xhat = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xhat.to(x.dtype)


# ----------------------------------------------------------------------------- SiLU gate
if triton is not None:
    @triton.jit
    def _silu_mul_fwd(G, U, H, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        g = tl.load(G + i, mask=m, other=0.0).to(tl.float32)
        u = tl.load(U + i, mask=m, other=0.0).to(tl.float32)
        a = (g * tl.sigmoid(g)).to(G.dtype.element_ty).to(tl.float32)
        tl.store(H + i, (a * u).to(H.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_mul_bwd(DH, G, U, DG, DU, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        dh = tl.load(DH + i, mask=m, other=0.0).to(tl.float32)
        g = tl.load(G + i, mask=m, other=0.0).to(tl.float32)
        u = tl.load(U + i, mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        a = (g * s).to(G.dtype.element_ty).to(tl.float32)
        da = (dh * u).to(G.dtype.element_ty).to(tl.float32)  # silu's output gradient, as rounded
        tl.store(DU + i, (dh * a).to(DU.dtype.element_ty), mask=m)
        tl.store(DG + i, (da * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=m)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor):  # noqa: ANN205
        g, u = gate.contiguous(), up.contiguous()
        h = torch.empty(g.shape, dtype=torch.promote_types(g.dtype, u.dtype), device=g.device)
        n = g.numel()
        if n:
            _silu_mul_fwd[(triton.cdiv(n, SILU_BLOCK),)](g, u, h, n, BLOCK=SILU_BLOCK, num_warps=_warps(SILU_BLOCK, 2))
        ctx.save_for_backward(g, u)
        return h

    @staticmethod
    def backward(ctx, dh: torch.Tensor):  # noqa: ANN205
        g, u = ctx.saved_tensors
        dh = dh.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        n = g.numel()
        if n:
            _silu_mul_bwd[(triton.cdiv(n, SILU_BLOCK),)](dh, g, u, dg, du, n, BLOCK=SILU_BLOCK,
                                                         num_warps=_warps(SILU_BLOCK, 2))
        return dg, du


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, silu's output rounded to gate's dtype first (the MLP's act_fn output)."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return _SiluMul.apply(gate, up)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


# ----------------------------------------------------------------------------- RoPE
if triton is not None:
    @triton.jit
    def _rope_rows(X, C, S, Y, n_rows, H, T, sxb, sxh, sxt, syb, syh, syt, scb, sct,
                   HALF, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        b, h, t = r // (H * T), (r // T) % H, r % T
        d = tl.arange(0, BLOCK_H)[None, :]
        m = (r < n_rows)[:, None] & (d < HALF)
        xo = (b * sxb + h * sxh + t * sxt)[:, None] + d
        yo = (b * syb + h * syh + t * syt)[:, None] + d
        co = (b * scb + t * sct)[:, None] + d
        x1 = tl.load(X + xo, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(X + xo + HALF, mask=m, other=0.0).to(tl.float32)
        c1 = tl.load(C + co, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(C + co + HALF, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(S + co, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(S + co + HALF, mask=m, other=0.0).to(tl.float32)
        dt = Y.dtype.element_ty
        if BACKWARD:  # the gradient through x*cos + rotate_half(x)*sin: one rounding at the end
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:  # each product rounded, then the sum, as the bf16 ops do
            y1 = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
            y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        tl.store(Y + yo, y1.to(dt), mask=m)
        tl.store(Y + yo + HALF, y2.to(dt), mask=m)


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [B, H, T, D] (any strides, the last dim dense), cos/sin [B or 1, T, D]: the rotation, out
    in x's memory layout (as the bf16 ops' outputs are)."""
    b, h, t, d = x.shape
    y = torch.empty_like(x)  # preserves x's layout (a transposed view: [B, T, H, D] in memory)
    n = b * h * t
    half = d // 2
    block = triton.next_power_of_2(half)
    rows = max(1, min(64, ELEMENTS_PER_PROGRAM // (2 * block)))
    scb = cos.stride(0) if cos.shape[0] > 1 else 0
    if n:
        _rope_rows[(triton.cdiv(n, rows),)](
            x, cos, sin, y, n, h, t, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
            scb, cos.stride(1), half, BACKWARD=backward, BLOCK_H=block, ROWS=rows, num_warps=_warps(block, rows))
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # noqa: ANN205
        ctx.save_for_backward(cos, sin)
        return _rope_launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # noqa: ANN205
        cos, sin = ctx.saved_tensors
        return _rope_launch(dy if dy.stride(-1) == 1 else dy.contiguous(), cos, sin, backward=True), None, None


def rope_ok(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rope` serves these operands: 4-d x with a dense last dim of even width, cos and
    sin [B or 1, T, D] alike with a dense last dim, on a device the kernels run on."""
    return (x.dim() == 4 and cos.dim() == 3 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1
            and cos.shape == sin.shape and cos.stride() == sin.stride() and cos.stride(-1) == 1
            and cos.shape[1:] == (x.shape[2], x.shape[3]) and cos.shape[0] in (1, x.shape[0])
            and not cos.requires_grad and not sin.requires_grad and available(x))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin over x [B, H, T, D] with cos and sin [B, T, D] (unsqueezed at
    dim 1, as transformers' apply_rotary_pos_emb does), rounded as its bf16 ops round."""
    if not rope_ok(x, cos, sin):
        raise ValueError("rope: x [B, H, T, D] with a dense last dim and cos/sin [B or 1, T, D] expected")
    return _Rope.apply(x, cos, sin)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s
