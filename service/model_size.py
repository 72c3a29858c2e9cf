"""A registered base model's parameter count for GET /v1/models, read without loading weights:
the models file's `parameters` when the operator set it, else the shapes in the model directory's
safetensors headers (exact), else computed from its config.json (service.learning_rates)."""

from __future__ import annotations

import json
import math
import struct
from functools import lru_cache
from pathlib import Path

from service.core.registry import BaseModelEntry
from service.learning_rates import parameter_count

MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on a header


def model_parameters(entry: BaseModelEntry) -> int | None:
    """The model's parameters; None when neither the file nor the directory says."""
    if entry.parameters is not None:
        return entry.parameters
    root = Path(entry.path)
    try:
        files = sorted(root.glob("*.safetensors"))
        stamp = tuple((str(f), f.stat().st_mtime_ns) for f in files)
        config = root / "config.json"
        config_stamp = config.stat().st_mtime_ns if config.is_file() else None
    except OSError:
        return None
    return _counted(str(root), stamp, config_stamp)


@lru_cache(maxsize=64)
def _counted(root: str, stamp: tuple[tuple[str, int], ...], config_stamp: int | None) -> int | None:
    # cached by the files' mtimes: a model replaced in place is counted again
    if stamp:
        try:
            return sum(_header_parameters(Path(name)) for name, _ in stamp)
        except (OSError, ValueError, TypeError, struct.error):
            pass
    if config_stamp is None:
        return None
    try:
        config = json.loads((Path(root) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    return parameter_count(config.get("text_config") or config)


def _header_parameters(path: Path) -> int:
    """The elements of every tensor a safetensors file lists (its header only)."""
    with path.open("rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        if size > MAX_HEADER:
            raise ValueError("safetensors header too large")
        table = json.loads(fh.read(size))
    if not isinstance(table, dict):
        raise ValueError("safetensors header is not an object")
    return sum(math.prod(int(d) for d in t["shape"]) for key, t in table.items()
               if key != "__metadata__")
