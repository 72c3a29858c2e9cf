"""Zeroed buffers for one step's LoRA shrinks, handed out several to one fill (torch only).

A shrink that splits its column sweep (`SPLIT_C` > 1 in kernels.fused_lora) adds partial sums into its
output S with atomics, so S must start at zero. Its configuration zeroes S before every launch (a pre_hook:
one fill kernel each). A 2-job step of the 8B shape at 32 layers ran 427 of them (448 shrinks), ~4 us each
with their gaps: ~1.9 ms of a ~105 ms replayed step (bench/results/session56_h200.md). A `ZeroSlab` instead
hands out S buffers as slices of one zeroed slab of SLICES buffers: one fill per SLICES shrinks, and the
shrink's own zeroing is skipped for a slice it is the first to write (kernels.fused_lora).

Its life is one step's (one `trainer.multilora.StepLayout`): the forward's, the recompute's and the backward's
shrinks of that step take from it in turn, and the next step (or capture) has a new one. A slice is handed
out once and holds zeros until its one shrink writes it, so within a CUDA graph the slab's fill is part of
the graph and runs at every replay; a slab never outlives its step, so no graph reads another one's slab.
"""

from __future__ import annotations

import os

import torch

# $LORAPLEX_ZERO_SLAB=0: every shrink zeroes its own S as before (the side-by-side baseline: bench/device_session.sh)
ON = os.environ.get("LORAPLEX_ZERO_SLAB", "1") != "0"
SLICES = 8  # buffers a slab holds: a decoder layer's seven projections and one spare


def slab_on() -> bool:
    """Whether the fused shrinks take a step's slab where one is given ($LORAPLEX_ZERO_SLAB)."""
    return ON


class ZeroSlab:
    """Zeroed [rows, cols] buffers, SLICES to one allocation and one fill."""

    def __init__(self, slices: int = SLICES) -> None:
        if slices < 1:
            raise ValueError(f"slices must be >= 1, got {slices}")
        self.slices = slices
        self._slab: torch.Tensor | None = None
        self._next = 0
        self.fills = 0  # slabs allocated and zeroed
        self.taken = 0  # buffers handed out

    def take(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed contiguous [rows, cols] buffer no caller had before."""
        slab = self._slab
        if (slab is None or self._next >= slab.shape[0] or slab.shape[1] != rows or slab.shape[2] != cols
                or slab.dtype != dtype or slab.device != device):
            slab = self._slab = torch.zeros((self.slices, rows, cols), dtype=dtype, device=device)
            self._next = 0
            self.fills += 1
        out = slab[self._next]
        self._next += 1
        self.taken += 1
        return out
