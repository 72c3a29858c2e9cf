"""What the kernels ask of a CUDA device: its index and whether it is Hopper or newer (cached per
device: the answer never changes within a process)."""

from __future__ import annotations

import torch

_capabilities: dict[int, tuple[int, int]] = {}


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device (`cuda` without one: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def hopper_or_newer(device: torch.device) -> bool:
    """True on a CUDA device of compute capability 9.0 or more (TMA, the persistent fused GEMMs)."""
    if device.type != "cuda":
        return False
    idx = cuda_index(device)
    if idx not in _capabilities:
        _capabilities[idx] = torch.cuda.get_device_capability(idx)
    return _capabilities[idx] >= (9, 0)
