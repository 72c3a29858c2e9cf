"""Fused RMSNorm and SiLU-gate for a frozen backbone: one Triton kernel each way where transformers'
modules launch one kernel per elementwise op (issue 40: at 32 layers of the 8B shape the norms',
the MLP gate's and their casts' `mul`, `pow`, `copy_`, `add`, `rsqrt` kernels took about a quarter
of a training step's GPU time, bench/results/host_profile_h100_recompute.md).

- `rms_norm(x, weight, eps)`: transformers' Llama-style RMSNorm, `weight * (x32 * rsqrt(mean(x32^2) +
  eps)).to(x.dtype)`, rounded where the module rounds (the normalised row to x's dtype before the
  weight, the product to the output dtype). The weight is frozen: the backward gives x's gradient
  alone, and keeps x and one float32 rstd per row (the module kept a float32 copy of x).
- `silu_mul(gate, up)`: `silu(gate) * up` with silu's output rounded to gate's dtype first, as
  `act_fn(gate_proj(x)) * up_proj(x)` does; the backward recomputes the sigmoid from gate and keeps
  gate and up alone (autograd kept silu(gate) too: one intermediate-wide tensor a layer less).

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
    @triton.jit(do_not_specialize=["n_rows"])
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

    @triton.jit(do_not_specialize=["n_rows"])
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
            launch(_rms_fwd, (triton.cdiv(n, rows),), (x2, weight, y, rstd, n, d, float(eps)),
                   {"BLOCK_D": block, "ROWS": rows, "num_warps": _warps(block, rows)})
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
            launch(_rms_bwd, (triton.cdiv(n, rows),), (dy2, x2, weight, rstd, dx, n, d),
                   {"BLOCK_D": block, "ROWS": rows, "num_warps": _warps(block, rows)})
        return dx.view(ctx.shape), None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm over the last dimension with a frozen weight (no gradient for it), in
    the dtype the module's `weight * normalised` gives."""
    if weight.requires_grad:
        raise ValueError("rms_norm: the weight must be frozen (its gradient is not computed)")
    return _RmsNorm.apply(x, weight, eps, torch.promote_types(x.dtype, weight.dtype))


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
            launch(_silu_mul_fwd, (triton.cdiv(n, SILU_BLOCK),), (g, u, h, n),
                   {"BLOCK": SILU_BLOCK, "num_warps": _warps(SILU_BLOCK, 2)})
        ctx.save_for_backward(g, u)
        return h

    @staticmethod
    def backward(ctx, dh: torch.Tensor):  # noqa: ANN205
        return silu_mul_backward(dh, *ctx.saved_tensors)


def silu_mul_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of silu_mul from its output's gradient and the contiguous gate and up it kept."""
    dh = dh.contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    if n:
        launch(_silu_mul_bwd, (triton.cdiv(n, SILU_BLOCK),), (dh, g, u, dg, du, n),
               {"BLOCK": SILU_BLOCK, "num_warps": _warps(SILU_BLOCK, 2)})
    return dg, du


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, silu's output rounded to gate's dtype first (the MLP's act_fn output)."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return _SiluMul.apply(gate, up)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up

from kernels.lean_launch import launch  # noqa: E402 (here, not above: a line above a @triton.jit function moves it, and its first line is in its cache key)
