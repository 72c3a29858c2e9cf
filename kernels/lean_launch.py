"""A lean launch path for Triton kernels (issue 40: "give whatever stays eager a lean launch path").

Triton's `JITFunction.run` binds and specializes every argument, builds a cache key string and
looks the kernel up at every launch. A capture of a step graph, an eager step and an evaluation's
first passes launch ~2,200 tuned kernels from Python (bench/results/session44_h200.md), so that
per-launch work is host time a capture or an eager step waits on. `launch(fn, grid, args, kwargs)`
does what `fn[grid](*args, **kwargs)` does, but after the first launch of a specialization it
calls the compiled kernel's launcher directly, keyed by what Triton specializes on, or finer:

- a tensor: its dtype and whether its data pointer is 16-byte aligned;
- an int: whether it is 1, whether 16 divides it, whether it fits 32 bits and whether it needs 64 unsigned
  ones (Triton's i32/i64/u64);
- a bool or a float: its type and value; None; the constexpr and option keyword arguments' values;
- the function, the current CUDA device.

Anything else (an argument of another kind, an unhashable keyword value, launch hooks installed,
Triton's debug or instrumentation modes, the interpreter, a callable grid, a kernel with pre-run hooks
or whose trailing parameters are not all constexprs the keywords name) takes Triton's own path. $LORAPLEX_LEAN_LAUNCH=0 turns the lean path off (the side-by-side baseline).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

ENABLED = os.environ.get("LORAPLEX_LEAN_LAUNCH", "1") != "0" and os.environ.get("TRITON_INTERPRET", "0") != "1"
_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_pdl",
                      "debug", "sanitize_overflow"})
# (function, device, keywords, argument specs) -> (compiled kernel, names of the keyword parameters in order)
_CACHE: dict[tuple, tuple[Any, tuple[str, ...]]] = {}
# at most this many specializations are kept per kernel (a float argument that changed every call would
# otherwise grow the cache: its value is in the key); past it, that kernel's new ones take Triton's path
MAX_ENTRIES = 1024
_KEPT: dict[Any, int] = {}
_STATS = {"lean": 0, "triton": 0}


def _specs(args: Sequence[object]) -> list[object]:
    """What Triton specializes each argument on (or finer); TypeError for a kind it does not cover.
    One loop, no call per argument: this runs at every launch."""
    out = []
    add = out.append
    for a in args:
        t = type(a)
        if t is int:
            add((a == 1, a % 16 == 0, -2147483648 <= a < 2147483648, a >= 9223372036854775808))
        elif isinstance(a, torch.Tensor):
            add((a.dtype, a.data_ptr() % 16 == 0))
        elif a is None or t is bool or t is float:
            add((t, a))
        else:
            raise TypeError(t.__name__)
    return out


_KNOBS: list = []  # triton.knobs, once found


def _installed(hook: object) -> bool:
    """Whether a launch hook does anything: Triton 3.6 keeps an empty HookChain there, not None."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def _triton_only() -> bool:
    """Whether this launch must take Triton's path: launch hooks that do something (a profiler's),
    or Triton's debug or instrumentation modes (they change what Triton compiles)."""
    if not _KNOBS:
        try:
            from triton import knobs
        except ImportError:  # a Triton without knobs: nothing to honour
            return False
        _KNOBS.append(knobs)
    knobs = _KNOBS[0]
    rt = knobs.runtime
    return (_installed(rt.launch_enter_hook) or _installed(rt.launch_exit_hook) or bool(rt.debug)
            or bool(getattr(knobs.compilation, "instrumentation_mode", "")))


def _device_and_stream() -> tuple[int, int]:
    device = torch._C._cuda_getDevice()
    return device, torch._C._cuda_getCurrentRawStream(device)


def _keyword_names(fn: Any, n_args: int, kwargs: dict[str, object]) -> tuple[str, ...] | None:
    """The parameters after the positional arguments, in order, where every one is a constexpr the
    keywords name (their values are then in the key as Triton keys constexprs); None otherwise (a
    non-constexpr keyword, one left to its default, a pre-run hook: not cached)."""
    if getattr(fn, "pre_run_hooks", None):
        return None
    names = tuple(fn.arg_names[n_args:])
    params = getattr(fn, "params", None)
    constexpr = all(p.is_constexpr for p in params[n_args:]) if params is not None else True
    if not constexpr or not all(n in kwargs and n not in _OPTIONS for n in names):
        return None
    return names


def launch(fn: Any, grid: Sequence[int], args: Sequence[object], kwargs: dict[str, object]) -> None:
    """`fn[grid](*args, **kwargs)` for a CUDA launch, through the compiled kernel's launcher once
    Triton has launched this specialization (see the module docstring). `grid`: a tuple (a callable
    grid takes Triton's path)."""
    if not ENABLED or callable(grid):
        fn[grid](*args, **kwargs)
        return
    try:
        device, stream = _device_and_stream()
        key = (fn, device, *kwargs.items(), *_specs(args))
        hit = _CACHE.get(key)
    except (TypeError, AttributeError, RuntimeError):  # unhashable or unknown kind; no CUDA
        _STATS["triton"] += 1
        fn[grid](*args, **kwargs)
        return
    if hit is None or _triton_only():
        _STATS["triton"] += 1
        kernel = fn[grid](*args, **kwargs)
        if hit is None and kernel is not None and hasattr(kernel, "packed_metadata"):
            names = _keyword_names(fn, len(args), kwargs)
            if names is not None and _KEPT.get(fn, 0) < MAX_ENTRIES:
                _CACHE[key] = (kernel, names)
                _KEPT[fn] = _KEPT.get(fn, 0) + 1
        return
    kernel, names = hit
    _STATS["lean"] += 1
    n = len(grid)
    kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, kernel.function,
               kernel.packed_metadata, None, None, None, *args, *[kwargs[k] for k in names])


def stats() -> dict[str, int]:
    """How many launches took each path in this process (for benches)."""
    return dict(_STATS)
