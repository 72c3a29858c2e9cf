"""A lean launch path for Triton kernels (issue 40: "give whatever stays eager a lean launch path").

Triton's `JITFunction.run` binds and specializes every argument, builds a cache key string and
looks the kernel up at every launch. A capture of a step graph, an eager step and an evaluation's
first passes launch ~2,200 tuned kernels from Python (bench/results/session44_h200.md), so that
per-launch work is host time a capture or an eager step waits on. `launch(fn, grid, args, kwargs)`
does what `fn[grid](*args, **kwargs)` does, but after the first launch of a specialization it
calls the compiled kernel's launcher directly, keyed by what Triton specializes on, or finer:

- a tensor: its dtype and whether its data pointer is 16-byte aligned;
- an int: whether it is 1, whether 16 divides it, and whether it fits 32 bits (Triton's i32/i64);
- a bool or a float: its type and value; None; the constexpr and option keyword arguments' values;
- the function, the current CUDA device.

Anything else (an argument of another kind, an unhashable keyword value, launch hooks installed,
the interpreter, a kernel whose trailing parameters the keywords do not name) takes Triton's own
path every time. $LORAPLEX_LEAN_LAUNCH=0 turns the lean path off (the side-by-side baseline).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

ENABLED = os.environ.get("LORAPLEX_LEAN_LAUNCH", "1") != "0" and os.environ.get("TRITON_INTERPRET", "0") != "1"
_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_pdl",
                      "debug", "sanitize_overflow"})
_I32 = (-(2**31), 2**31)
# (function, device, keywords, argument specs) -> (compiled kernel, names of the keyword parameters in order)
_CACHE: dict[tuple, tuple[Any, tuple[str, ...]]] = {}
_STATS = {"lean": 0, "triton": 0}


def _spec(a: object) -> object:
    """What Triton specializes an argument on (or finer); TypeError for a kind it does not cover."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool) or a is None or isinstance(a, float):
        return type(a), a
    if isinstance(a, int):
        return a == 1, a % 16 == 0, _I32[0] <= a < _I32[1]
    raise TypeError(type(a).__name__)


def _hooks_installed() -> bool:
    try:
        from triton import knobs
    except ImportError:  # a Triton without knobs: no hooks to honour
        return False
    rt = knobs.runtime
    return rt.launch_enter_hook is not None or rt.launch_exit_hook is not None


def _device_and_stream() -> tuple[int, int]:
    device = torch._C._cuda_getDevice()
    return device, torch._C._cuda_getCurrentRawStream(device)


def launch(fn: Any, grid: Sequence[int], args: Sequence[object], kwargs: dict[str, object]) -> None:
    """`fn[grid](*args, **kwargs)` for a CUDA launch, through the compiled kernel's launcher once
    Triton has launched this specialization (see the module docstring)."""
    if not ENABLED:
        fn[grid](*args, **kwargs)
        return
    try:
        device, stream = _device_and_stream()
        key = (fn, device, tuple(kwargs.items()), *[_spec(a) for a in args])
        hit = _CACHE.get(key)
    except (TypeError, AttributeError, RuntimeError):  # unhashable or unknown kind; no CUDA
        _STATS["triton"] += 1
        fn[grid](*args, **kwargs)
        return
    if hit is None or _hooks_installed():
        _STATS["triton"] += 1
        kernel = fn[grid](*args, **kwargs)
        if hit is None and kernel is not None and hasattr(kernel, "packed_metadata"):
            names = tuple(fn.arg_names[len(args):])
            if all(n in kwargs and n not in _OPTIONS for n in names):
                _CACHE[key] = (kernel, names)
        return
    kernel, names = hit
    _STATS["lean"] += 1
    g = tuple(grid)
    kernel.run(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, stream, kernel.function,
               kernel.packed_metadata, None, None, None, *args, *[kwargs[n] for n in names])


def stats() -> dict[str, int]:
    """How many launches took each path in this process (for benches)."""
    return dict(_STATS)
