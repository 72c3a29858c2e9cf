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
    offsets  [N+1] int32/int64  offsets[0] = 0, offsets[N] <= T, nondecreasing; adapter i owns
                                rows offsets[i]:offsets[i+1]; zero-length adapters are legal;
                                rows past offsets[N] are padding: they get the base output
                                (the persistent fused GEMM, Hopper's default, stores zeros in
                                the row tiles wholly past offsets[N]: read no padding row)
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

Operator forms of the Triton backend (`form=`; None means the process default, "compose" unless
set by `set_default_form` or $LORAPLEX_LORA_FORM; unset: "fused" on Hopper or newer, "compose"
elsewhere):
    "compose"  cuBLAS base GEMMs + separate grouped LoRA passes (kernels.triton_lora)
    "fused"    Triton GEMMs with the LoRA expand and dS A in their epilogues, per-adapter rank
               tiles (kernels.fused_lora)
    "auto"     per shape, the faster of the two by measured timings (kernels.form_choice)
The torch backend ignores the form.
"""

from __future__ import annotations

import os

import torch

from kernels.devices import cuda_index, hopper_or_newer
from kernels.reference import multilora_linear_arena_reference, multilora_linear_reference

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FORMS = ("compose", "fused", "auto")
# None: the device's default (`device_default_form`); set_default_form or $LORAPLEX_LORA_FORM pin one
_default_form: str | None = os.environ.get("LORAPLEX_LORA_FORM") or None
_device_names: dict[int, str] = {}
def device_default_form(x: torch.Tensor) -> str:
    """"fused" on Hopper or newer (its persistent TMA GEMMs beat cuBLAS + separate LoRA passes end to
    end: bench/results/engine_step_variants_h100.md), "compose" elsewhere."""
    return "fused" if hopper_or_newer(x.device) else "compose"


def _check_form(form: str | None) -> None:
    if form is not None and form not in FORMS:
        raise ValueError(f"form must be one of {FORMS} or None, got {form!r}")


def set_default_form(form: str) -> None:
    """The form used where a caller passes form=None (e.g. a benchmark switching the engine)."""
    global _default_form
    if form is None:
        raise ValueError("set_default_form needs a form")
    _check_form(form)
    _default_form = form


def _device_name(x: torch.Tensor) -> str:
    if not x.is_cuda:
        return str(x.device.type)
    idx = cuda_index(x.device)
    if idx not in _device_names:
        _device_names[idx] = torch.cuda.get_device_name(idx)
    return _device_names[idx]


def resolve_form(form: str | None, x: torch.Tensor, d_out: int, r_max: int) -> str:
    """"compose" or "fused" for this call (host ints only: no device sync)."""
    form = _default_form if form is None else form
    if form is None:
        return device_default_form(x)
    _check_form(form)
    if form != "auto":
        return form
    from kernels.form_choice import table

    return table().choose(_device_name(x), x.shape[-1], d_out, x.shape[0], r_max, fallback=device_default_form(x))


def triton_available() -> bool:
    """True when triton imports (the kernels themselves still need CUDA or TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the machine
        return False
    return True


def use_triton(x: torch.Tensor, backend: str) -> bool:
    """Whether the Triton kernels serve a call on `x` under `backend` ("auto": CUDA in a kernel dtype)."""
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
    form: str | None = None,
) -> torch.Tensor:
    """Base linear plus per-adapter LoRA for row-grouped tokens; see the module docstring."""
    _check_form(form)
    if use_triton(x, backend):
        if resolve_form(form, x, weight.shape[0], lora_a.shape[2]) == "fused":
            from kernels.fused_lora import multilora_linear_fused

            return multilora_linear_fused(x, weight, bias, lora_a, lora_b, scales, ranks, offsets)
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
    form: str | None = None,
    aligned: bool = False,
) -> torch.Tensor:
    """Base linear plus per-adapter LoRA read from an arena; see "Arena form" above. aligned: the
    caller vouches that every offset in a_off and b_off is a multiple of 16 elements (the fused
    kernels then load the adapters' rows as 16-byte vectors; a false word gives wrong results)."""
    _check_form(form)
    if use_triton(x, backend):
        if resolve_form(form, x, weight.shape[0], r_max) == "fused":
            from kernels.fused_lora import multilora_linear_arena_fused

            return multilora_linear_arena_fused(x, weight, bias, arena, grad_arena, a_off, b_off, scales, ranks,
                                                offsets, r_max, token, aligned=aligned)
        from kernels.triton_lora import multilora_linear_arena_triton

        return multilora_linear_arena_triton(x, weight, bias, arena, grad_arena, a_off, b_off, scales, ranks,
                                             offsets, r_max, token)
    return multilora_linear_arena_reference(x, weight, bias, arena, grad_arena, a_off, b_off, scales, ranks,
                                            offsets, r_max, token)
