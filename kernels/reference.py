"""Plain-torch reference of the grouped multi-LoRA linear operator.

Same math and signature as `kernels.multilora_linear` (minus `backend`); differentiable by
autograd, used on CPU, in the tests, and as the fallback when no CUDA device is present.
"""

from __future__ import annotations

import torch


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # Accumulate in fp32 (fp64 stays fp64) like the Triton kernels do.
    return torch.float64 if dtype == torch.float64 else torch.float32


def rank_mask(ranks: torch.Tensor, r_max: int) -> torch.Tensor:
    """Boolean mask [N, r_max]: True where rank column j < r_i (the live part of an adapter)."""
    cols = torch.arange(r_max, device=ranks.device)
    return cols[None, :] < ranks.to(cols.device, torch.int64)[:, None]


def _row_bounds(offsets: torch.Tensor, t: int) -> list[int]:
    """offsets as host ints, checked: start at 0, end at most at T (rows past the end belong to no
    adapter), nondecreasing (the one host sync)."""
    bounds = [int(v) for v in offsets.tolist()]
    if bounds[0] != 0 or bounds[-1] > t or any(lo > hi for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)):
        raise ValueError(f"offsets must start at 0, end at most at T={t} and be nondecreasing, got {bounds}")
    return bounds


def multilora_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    ranks: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """y = x @ weight.T + bias + s_i * (x_i @ A_i[:, :r_i]) @ B_i[:r_i] for each adapter's rows.

    Shapes: x [T, d_in] (rows grouped by adapter), weight [d_out, d_in], bias [d_out] or None,
    lora_a [N, d_in, r_max], lora_b [N, r_max, d_out], scales [N], ranks [N], offsets [N+1].
    Padded rank entries are masked with `torch.where`, so their gradients are exact zeros.
    One host sync per call (offsets are read to split the rows).
    """
    n, d_in, r_max = lora_a.shape
    t = x.shape[0]
    if x.dim() != 2 or x.shape[1] != d_in or weight.shape[1] != d_in:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}, lora_a {tuple(lora_a.shape)}")
    d_out = weight.shape[0]
    if lora_b.shape != (n, r_max, d_out) or scales.shape[0] != n or ranks.shape[0] != n or offsets.shape[0] != n + 1:
        raise ValueError("lora_b/scales/ranks/offsets do not match lora_a and weight")
    acc = _acc_dtype(x.dtype)
    mask = rank_mask(ranks, r_max).to(lora_a.device)
    a = torch.where(mask[:, None, :], lora_a, torch.zeros((), dtype=lora_a.dtype, device=lora_a.device))
    b = torch.where(mask[:, :, None], lora_b, torch.zeros((), dtype=lora_b.dtype, device=lora_b.device))
    base = torch.nn.functional.linear(x, weight, bias).to(acc)
    bounds = _row_bounds(offsets, t)
    s = scales.to(acc)
    pieces = []
    for i in range(n):
        lo, hi = bounds[i], bounds[i + 1]
        if hi == lo:
            continue
        xi = x[lo:hi].to(acc)
        shrink = xi @ a[i].to(acc)
        pieces.append(base[lo:hi] + s[i] * (shrink @ b[i].to(acc)))
    if not pieces:
        # no adapter rows: keep y on the graph of lora_a/lora_b so their gradients are zeros, not
        # None, exactly as the Triton path returns them.
        pieces.append(base[:0] + (x[:0].to(acc) @ a[0].to(acc)) @ b[0].to(acc))
    y = torch.cat(pieces + [base[bounds[-1]:]], 0)  # rows past the last adapter's: the base output
    return y.to(x.dtype)


class _ArenaReferenceFn(torch.autograd.Function):
    """Plain-torch arena operator: forward and backward written out per adapter (no autograd
    inside), gradients added into grad_arena. One host sync per call (offsets, ranks, a/b offsets)."""

    @staticmethod
    def forward(ctx, x, weight, bias, arena, grad_arena, a_off, b_off, scales, ranks, offsets, r_max, token):  # noqa: D102
        acc = _acc_dtype(x.dtype)
        y = torch.nn.functional.linear(x, weight, bias).to(acc)
        for lo, hi, a, bt, s, _ao, _bo in _arena_blocks(x, weight, arena, a_off, b_off, scales, ranks, offsets, acc):
            y[lo:hi] += s * ((x[lo:hi].to(acc) @ a.t()) @ bt)
        ctx.save_for_backward(x, weight, arena, a_off, b_off, scales, ranks, offsets)
        ctx.grad_arena = grad_arena
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, weight, arena, a_off, b_off, scales, ranks, offsets = ctx.saved_tensors
        g = ctx.grad_arena
        acc = _acc_dtype(x.dtype)
        need_x = ctx.needs_input_grad[0]
        dx = (dy @ weight).to(acc) if need_x else None
        d_in, d_out = x.shape[1], weight.shape[0]
        for lo, hi, a, bt, s, ao, bo in _arena_blocks(x, weight, arena, a_off, b_off, scales, ranks, offsets, acc):
            xi, dyi = x[lo:hi].to(acc), dy[lo:hi].to(acc)
            shrink = xi @ a.t()                     # [t_i, r]
            d_bt = s * (shrink.t() @ dyi)           # [r, d_out]
            d_s = s * (dyi @ bt.t())                # [t_i, r]
            r = a.shape[0]
            g[ao : ao + r * d_in] += (d_s.t() @ xi).reshape(-1).to(g.dtype)
            g[bo : bo + r * d_out] += d_bt.reshape(-1).to(g.dtype)
            if need_x:
                dx[lo:hi] += d_s @ a
        return (dx.to(x.dtype) if need_x else None,) + (None,) * 11


def _arena_blocks(x, weight, arena, a_off, b_off, scales, ranks, offsets, acc):  # noqa: ANN001, ANN202
    """(row lo, row hi, A [r, d_in], B^T [r, d_out], scale, A offset, B^T offset) per adapter, in order."""
    d_in, d_out = x.shape[1], weight.shape[0]
    bounds = _row_bounds(offsets, x.shape[0])
    for i, (ao, bo, r, s) in enumerate(zip(a_off.tolist(), b_off.tolist(), ranks.tolist(), scales.tolist(), strict=True)):
        a = arena[ao : ao + r * d_in].view(r, d_in).to(acc)
        bt = arena[bo : bo + r * d_out].view(r, d_out).to(acc)
        yield bounds[i], bounds[i + 1], a, bt, s, ao, bo


def multilora_linear_arena_reference(x, weight, bias, arena, grad_arena, a_off, b_off, scales, ranks, offsets,
                                     r_max, token) -> torch.Tensor:  # noqa: ANN001
    """Reference of `kernels.multilora_linear_arena` (same contract)."""
    if grad_arena.dtype != _acc_dtype(x.dtype) or grad_arena.shape != arena.shape:
        raise ValueError(f"grad_arena must be {_acc_dtype(x.dtype)} of the arena's shape")
    return _ArenaReferenceFn.apply(x, weight, bias, arena, grad_arena, a_off, b_off, scales, ranks, offsets,
                                   r_max, token)
