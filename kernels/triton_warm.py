"""Triton's one-time cost in a new process, taken off the first step's path.

Before Triton compiles, or finds in its cache, the first kernel of a process, it computes
`triton_key()`: a hash of its own sources and of its compiled library (libtriton.so, ~500 MB on the
GPU image), kept for the process's life (an lru_cache). On the H200 that was 0.36-0.41 s of the first
Triton kernel of every fresh executor process (bench/executor_task.py's kernel loads, session 51:
`_silu_mul_fwd`'s JIT in the fused blocks' probes, on the way to the first step). The same first
launch imports Triton's code generator (bench/first_kernels.py: ~40 modules, 0.15-0.19 s); that
import goes with the key.

- `compute()` fills that cache now: a node's zygote and a spare host call it with their imports
  (`worker.host.warm_imports`), so every executor they fork or serve starts with it.
- The executor fills it on a background worker (`trainer.triton_ahead`; file reads and sha256 let go
  of the GIL) from the moment it has a CUDA device, joined before its engine's first kernel, so the
  backbone's load hides it.

Nothing here touches CUDA (a zygote forks after it) or runs under the interpreter's CPU-only path.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def _key_function() -> Callable[[], str] | None:
    """Triton's `triton_key` (in runtime.cache, or compiler.compiler in older releases), or None."""
    try:
        from triton.runtime import cache
    except ImportError:
        return None
    fn = getattr(cache, "triton_key", None)
    if fn is None:
        try:
            from triton.compiler import compiler
        except ImportError:
            return None
        fn = getattr(compiler, "triton_key", None)
    return fn if callable(fn) and hasattr(fn, "cache_info") else None


def available() -> bool:
    """Whether this Triton has the key to compute (its `triton_key`, an lru_cache)."""
    return _key_function() is not None


def cached() -> bool:
    """Whether this process has Triton's key already (False where Triton or its key is missing)."""
    fn = _key_function()
    return fn is not None and fn.cache_info().currsize > 0


def compute() -> float:
    """Triton's key, computed now where it is not yet, and its code generator imported: the seconds
    it took (0.0 if the key was there)."""
    fn = _key_function()
    if fn is None or fn.cache_info().currsize > 0:
        return 0.0
    started = time.perf_counter()
    try:
        fn()
        # the first launch's specialization imports the code generator and, with it, ~40 modules of
        # Triton's experimental Gluon language (0.15-0.19 s of the first kernel on the H200, session 51)
        importlib.import_module("triton.compiler.code_generator")
    except Exception as exc:  # noqa: BLE001 - Triton then does it at its first compile, as it did
        log.debug("triton key not computed ahead: %s", exc)
    return time.perf_counter() - started
