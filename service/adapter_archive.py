"""Uploaded PEFT adapters (purpose "adapter"): an archive, .tar.gz or .zip, holding
`adapter_config.json` and `adapter_model.safetensors` at its top level or under one folder.

`inspect_adapter` reads the archive without loading a tensor: the config's JSON, the
safetensors header (8-byte little-endian length, then a JSON table of name -> dtype, shape,
data offsets), and checks the adapter is consistent with itself (every lora_A / lora_B pair
of rank `r`, on a module named in `target_modules`). A bad archive raises AdapterError with a
message fit for a 422."""

from __future__ import annotations

import io
import json
import re
import struct
import tarfile
import zipfile
from dataclasses import dataclass, field
from typing import BinaryIO

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
DTYPES = ("F32", "F16", "BF16")
MAX_HEADER = 16 << 20
ADAPTER_PURPOSE = "adapter"
# a decoder layer's place in a module path: "...layers.3.self_attn.q_proj" is layer 3 whether
# the module sits under self_attn or mlp (GPT-2 and Falcon call the list "h", others "blocks")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


class AdapterError(ValueError):
    pass


@dataclass(frozen=True)
class AdapterInfo:
    """What an adapter fixes for the task that starts from it."""
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None
    dtype: str
    # module name (e.g. "q_proj") -> (in_features, out_features)
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    layers: int = 0  # decoder layers with an adapted module
    # every adapted module's path as PEFT names it (base_model.model.<the model's module path>)
    modules: tuple[str, ...] = ()
    use_rslora: bool = False


def _members(src: BinaryIO) -> dict[str, bytes]:
    """The two files' bytes, whichever archive kind; AdapterError when either is missing."""
    head = src.read(4)
    src.seek(0)
    found: dict[str, bytes] = {}
    try:
        if head.startswith(b"PK"):
            with zipfile.ZipFile(src) as zf:
                for info in zf.infolist():
                    base = info.filename.rstrip("/").rsplit("/", 1)[-1]
                    if not info.is_dir() and base in (CONFIG, WEIGHTS) \
                            and info.filename.count("/") <= 1:
                        found[base] = zf.read(info)
        elif head.startswith(b"\x1f\x8b"):
            with tarfile.open(fileobj=src, mode="r:gz") as tf:
                for member in tf:
                    name = member.name.removeprefix("./")
                    base = name.rsplit("/", 1)[-1]
                    if member.isfile() and base in (CONFIG, WEIGHTS) and name.count("/") <= 1:
                        fh = tf.extractfile(member)
                        if fh is not None:
                            found[base] = fh.read()
        else:
            raise AdapterError("not a .tar.gz or .zip archive")
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as exc:
        raise AdapterError(f"unreadable archive: {exc}") from exc
    for name in (CONFIG, WEIGHTS):
        if name not in found:
            raise AdapterError(f"archive has no {name}")
    return found


def _header(blob: bytes) -> dict[str, dict]:
    if len(blob) < 8:
        raise AdapterError(f"{WEIGHTS}: too short for a safetensors header")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > MAX_HEADER or 8 + n > len(blob):
        raise AdapterError(f"{WEIGHTS}: header length {n} is past the file's end")
    try:
        table = json.loads(blob[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{WEIGHTS}: header is not JSON") from exc
    if not isinstance(table, dict):
        raise AdapterError(f"{WEIGHTS}: header is not a JSON object")
    table.pop("__metadata__", None)
    data = len(blob) - 8 - n
    for name, t in table.items():
        ok = (isinstance(t, dict) and isinstance(t.get("shape"), list)
              and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2)
        if not ok or not 0 <= t["data_offsets"][0] <= t["data_offsets"][1] <= data:
            raise AdapterError(f"{WEIGHTS}: tensor {name!r} has a bad header entry")
    return table


def _config(blob: bytes) -> dict:
    try:
        cfg = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{CONFIG}: not valid JSON") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"{CONFIG}: not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{CONFIG}: peft_type {cfg.get('peft_type')!r} is not LORA")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{CONFIG}: r must be a positive integer")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError(f"{CONFIG}: rank_pattern / alpha_pattern are not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets \
            or not all(isinstance(t, str) and t for t in targets):
        raise AdapterError(f"{CONFIG}: target_modules must be a non-empty list of names")
    return cfg


def _layer_of(module: str) -> str:
    """The decoder layer a module belongs to: its layer index where the path has one, else the
    path above the module's own container (a module outside any numbered list)."""
    m = _LAYER.search(module)
    return module[:m.end()] if m else module.rsplit(".", 2)[0]


def inspect_adapter(src: BinaryIO) -> AdapterInfo:
    """Validate an adapter archive and describe it; AdapterError on the first problem."""
    found = _members(src)
    cfg = _config(found[CONFIG])
    table = _header(found[WEIGHTS])
    r, targets = cfg["r"], sorted(set(
        [cfg["target_modules"]] if isinstance(cfg["target_modules"], str)
        else cfg["target_modules"]))
    pairs: dict[str, dict[str, list[int]]] = {}
    dtypes: set[str] = set()
    for name, t in table.items():
        parts = name.split(".")
        if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
            raise AdapterError(f"{WEIGHTS}: tensor {name!r} is not a LoRA A or B weight")
        if t.get("dtype") not in DTYPES:
            raise AdapterError(f"{WEIGHTS}: tensor {name!r} has dtype {t.get('dtype')!r}; "
                               f"supported: {', '.join(DTYPES)}")
        if len(t["shape"]) != 2:
            raise AdapterError(f"{WEIGHTS}: tensor {name!r} is not 2-D")
        dtypes.add(t["dtype"])
        pairs.setdefault(".".join(parts[:-2]), {})[parts[-2]] = t["shape"]
    if not pairs:
        raise AdapterError(f"{WEIGHTS}: holds no tensors")
    if len(dtypes) > 1:
        raise AdapterError(f"{WEIGHTS}: mixes dtypes {sorted(dtypes)}")
    shapes: dict[str, tuple[int, int]] = {}
    layers: set[str] = set()
    for module, ab in sorted(pairs.items()):
        short = module.rsplit(".", 1)[-1]
        if short not in targets:
            raise AdapterError(f"{WEIGHTS}: module {module!r} is not in target_modules")
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{WEIGHTS}: module {module!r} lacks its lora_A or lora_B")
        (ra, fin), (fout, rb) = ab["lora_A"], ab["lora_B"]
        if ra != r or rb != r:
            raise AdapterError(f"{WEIGHTS}: module {module!r} has rank {ra}/{rb}; "
                               f"the config says r={r}")
        if shapes.setdefault(short, (fin, fout)) != (fin, fout):
            raise AdapterError(f"{WEIGHTS}: module {module!r} has shape {(fin, fout)}; "
                               f"other {short} modules have {shapes[short]}")
        layers.add(_layer_of(module))
    missing = sorted(set(targets) - set(shapes))
    if missing:
        raise AdapterError(f"{WEIGHTS}: no weights for target_modules {missing}")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{CONFIG}: lora_alpha must be a number")
    base = cfg.get("base_model_name_or_path")
    return AdapterInfo(rank=r, alpha=float(alpha), target_modules=tuple(targets),
                       base_model=base if isinstance(base, str) else None,
                       dtype=dtypes.pop(), shapes=shapes, layers=len(layers),
                       modules=tuple(sorted(pairs)), use_rslora=cfg.get("use_rslora") is True)


def inspect_bytes(blob: bytes) -> AdapterInfo:
    return inspect_adapter(io.BytesIO(blob))
