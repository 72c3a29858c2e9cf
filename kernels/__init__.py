"""Grouped multi-LoRA linear operator: Triton kernels (forward and backward) and a torch reference.

Importing this package needs torch only; triton is imported lazily when the Triton backend runs.
"""

from kernels.multilora import multilora_linear, multilora_linear_arena, triton_available
from kernels.reference import multilora_linear_arena_reference, multilora_linear_reference

__all__ = [
    "multilora_linear",
    "multilora_linear_arena",
    "multilora_linear_arena_reference",
    "multilora_linear_reference",
    "triton_available",
]
