"""Grouped multi-LoRA linear operator: Triton kernels (forward and backward) and a torch reference.

Importing this package needs torch only; triton is imported lazily when the Triton backend runs.
"""

from kernels.multilora import (
    FORMS,
    multilora_linear,
    multilora_linear_arena,
    set_default_form,
    triton_available,
)
from kernels.reference import multilora_linear_arena_reference, multilora_linear_reference

__all__ = [
    "FORMS",
    "multilora_linear",
    "multilora_linear_arena",
    "multilora_linear_arena_reference",
    "multilora_linear_reference",
    "set_default_form",
    "triton_available",
]
