"""Public entry point of the grouped multi-LoRA linear operator and its backend dispatch.

`multilora_linear` picks the Triton kernels on CUDA and the plain-torch reference elsewhere.

Tensor layout contract (asserted at the launchers):
    x        [T, d_in]          rows grouped contiguously by adapter (job slot)
    weight   [d_out, d_in]      frozen base weight (nn.Linear layout), no grad
    bias     [d_out] or None    no grad
    lora_a   [N, d_in, r_max]   stacked adapters; rank padded in the weights only
    lora_b   [N, r_max, d_out]
    scales   [N] float32        s_i, no grad
    ranks    [N] int32          r_i <= r_max; A[i][:, r_i:] and B[i][r_i:] read as zero, and
                                their gradients are written as exact zeros
    offsets  [N+1] int32/int64  offsets[0] = 0, offsets[N] = T, nondecreasing; adapter i owns
                                rows offsets[i]:offsets[i+1]; zero-length adapters are legal
    returns  y [T, d_out] = x @ weight.T + bias + s_i * (x_i @ A_i[:, :r_i]) @ B_i[:r_i]
x, weight and lora_* share one dtype (bf16/fp16/fp32 for Triton; any float for torch); y has
that dtype; accumulation is fp32. Gradients flow to x, lora_a and lora_b only.

Arena form (`multilora_linear_arena`, what the training engine calls): the same math, but every
job's weights live in one flat `arena` [P] and adapter i is addressed by element offsets:
    A_i   = arena[a_off[i] : a_off[i] + r_i * d_in ].view(r_i, d_in)    PEFT's lora_A layout
    B_i^T = arena[b_off[i] : b_off[i] + r_i * d_out].view(r_i, d_out)   PEFT's lora_B, transposed
so nothing is stacked or padded per step. Backward ADDS dA_i and dB_i^T into `grad_arena` (same
layout, float32; float64 for float64) at the same offsets, and returns a gradient for x only;
`token`, a scalar that requires grad, ties y to autograd so backward runs even when x needs no
gradient (the first layer's inputs). r_max >= max(r_i) sizes the rank tile.
"""

from __future__ import annotations

import torch

from kernels.reference import multilora_linear_arena_reference, multilora_linear_reference

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_available() -> bool:
    """True when triton imports (the kernels themselves still need CUDA or TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the machine
        return False
    return True


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' requested but triton is not importable")
        return True
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    return x.is_cuda and x.dtype in _TRITON_DTYPES and triton_available()


def multilora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    ranks: torch.Tensor,
    offsets: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """Base linear plus per-adapter LoRA for row-grouped tokens; see the module docstring."""
    if _use_triton(x, backend):
        from kernels.triton_lora import multilora_linear_triton

        return multilora_linear_triton(x, weight, bias, lora_a, lora_b, scales, ranks, offsets)
    return multilora_linear_reference(x, weight, bias, lora_a, lora_b, scales, ranks, offsets)


def multilora_linear_arena(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    arena: torch.Tensor,
    grad_arena: torch.Tensor,
    a_off: torch.Tensor,
    b_off: torch.Tensor,
    scales: torch.Tensor,
    ranks: torch.Tensor,
    offsets: torch.Tensor,
    r_max: int,
    token: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """Base linear plus per-adapter LoRA read from an arena; see "Arena form" above."""
    if _use_triton(x, backend):
        from kernels.triton_lora import multilora_linear_arena_triton

        return multilora_linear_arena_triton(x, weight, bias, arena, grad_arena, a_off, b_off, scales, ranks,
                                             offsets, r_max, token)
    return multilora_linear_arena_reference(x, weight, bias, arena, grad_arena, a_off, b_off, scales, ranks,
                                            offsets, r_max, token)
