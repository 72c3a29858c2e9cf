"""What the kernels ask of a CUDA device: its index, whether it is Hopper or newer (cached per device: the answer
never changes within a process), and the global scratch Triton's device-side TMA descriptors take."""

from __future__ import annotations

import torch

_capabilities: dict[int, tuple[int, int]] = {}
_sm_counts: dict[int, int] = {}


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device (`cuda` without one: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device: torch.device) -> tuple[int, int]:
    """A device's compute capability ((0, 0) off CUDA)."""
    if device.type != "cuda":
        return (0, 0)
    idx = cuda_index(device)
    if idx not in _capabilities:
        _capabilities[idx] = torch.cuda.get_device_capability(idx)
    return _capabilities[idx]


def hopper_or_newer(device: torch.device) -> bool:
    """True on a CUDA device of compute capability 9.0 or more (TMA, the persistent fused GEMMs)."""
    return capability(device) >= (9, 0)


def sm_count(device: torch.device) -> int:
    """A CUDA device's streaming multiprocessors (the persistent kernels' program count)."""
    idx = cuda_index(device)
    if idx not in _sm_counts:
        _sm_counts[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_counts[idx]


def tma_scratch(size: int, align: int, stream: object) -> torch.Tensor:
    """Triton's allocator for TMA descriptors' global scratch (on the current CUDA device)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")
