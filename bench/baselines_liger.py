"""Liger-Kernel for the strong sequential baseline (c2, c3 of bench/baselines.py): loaded once
(installed, or from a wheel in the repository's .whl/), applied to one Llama instance at a time,
and turned off for the process, with the reason kept, where it cannot run."""

from __future__ import annotations

import contextlib
import glob
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
LIGER: dict[str, Any] = {"module": None, "status": "not loaded", "version": None}


def load_liger(dev: torch.device, wheel_dir: Path | None = None, enabled: bool = True) -> str:
    """Import Liger-Kernel: installed, else from the newest liger_kernel-*.whl of wheel_dir (the
    repository's ignored .whl/ by default, unpacked once to a temp dir and put on sys.path). Its
    kernels are Triton GPU kernels: on a CPU it is absent. Returns (and keeps) a status line."""
    if not enabled:
        return _liger_status(None, "absent: turned off (--no-liger)")
    if dev.type != "cuda":
        return _liger_status(None, "absent: CPU run (Liger's kernels are Triton GPU kernels)")
    wheels = sorted(glob.glob(str((wheel_dir or REPO / ".whl") / "liger_kernel-*.whl")))
    try:
        import liger_kernel  # noqa: F401 - installed (pip install --no-deps of the wheel)
    except ImportError:
        if not wheels:
            return _liger_status(None, f"absent: not installed and no wheel in {wheel_dir or REPO / '.whl'}")
        target = Path(tempfile.gettempdir()) / "loraplex_liger" / Path(wheels[-1]).stem
        if not (target / "liger_kernel").is_dir():
            with zipfile.ZipFile(wheels[-1]) as z:
                z.extractall(target)
        sys.path.insert(0, str(target))
    try:
        import liger_kernel.transformers as lt
    except Exception as exc:  # noqa: BLE001 - any import failure means: run without it
        return _liger_status(None, f"absent: import failed ({type(exc).__name__}: {exc})")
    try:
        LIGER["version"] = version("liger-kernel")
    except PackageNotFoundError:
        LIGER["version"] = Path(wheels[-1]).name.split("-")[1] if wheels else "?"
    return _liger_status(lt, f"applied: liger-kernel {LIGER['version']} (RMSNorm, RoPE, SwiGLU, fused linear CE)")


def _liger_status(module: Any, status: str) -> str:
    LIGER["module"], LIGER["status"] = module, status
    return status


def liger_failed(exc: BaseException) -> None:
    """Liger imported but its patched model failed: the arms run without it, and say why."""
    _liger_status(None, f"absent: its patched forward failed ({type(exc).__name__}: {exc})"[:300])


@contextlib.contextmanager
def liger_llama(model: torch.nn.Module) -> Iterator[bool]:
    """Liger's Llama patch on this model instance (its RMSNorm and MLP modules, its forward with
    the fused linear cross-entropy) and, for the duration, in transformers' Llama module (RoPE is
    a module-level function there); the module-level names are restored on exit, so only this
    model instance stays patched. Yields whether Liger is on."""
    lt = LIGER["module"]
    if lt is None or getattr(model.config, "model_type", None) != "llama":
        yield False
        return
    from transformers.models.llama import modeling_llama as ml

    saved = {k: getattr(ml, k) for k in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")}
    try:
        lt.apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                       fused_linear_cross_entropy=True, model=model)
        yield True
    finally:
        for k, v in saved.items():
            setattr(ml, k, v)
