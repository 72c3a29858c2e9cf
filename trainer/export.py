"""PEFT-format export of one job's adapter: adapter_config.json + adapter_model.safetensors with
PEFT's key names, loadable by peft.PeftModel.from_pretrained, vLLM and LoRAX. The config names the
base model by its registered name (never a server path) and holds only fields all three accept."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from trainer.multilora import JobAdapter

# Modules an adapter must not target to load everywhere: vLLM serves LoRA on the decoder's
# linears only (no lm_head / embedding LoRA, modules_to_save must be None), and LoRAX follows it.
UNPORTABLE_TARGETS = frozenset({"lm_head", "embed_tokens", "wte", "wpe", "embed_out", "embed_in"})


def model_label(base_model: str) -> str:
    """What adapter_config.json names the base model by: the registered name, never a server
    path. Given a path (a local model directory), only its last component."""
    text = str(base_model).rstrip("/\\")
    if "/" in text or "\\" in text:
        looks_like_path = text.startswith(("/", ".", "~")) or ":\\" in text or Path(text).exists()
        if looks_like_path:
            return text.replace("\\", "/").rsplit("/", 1)[-1]
    return text


def peft_config_dict(adapter: JobAdapter, targets: list[str], base_model: str = "") -> dict:
    """The adapter_config.json of a LoRA adapter, in the fields PEFT (0.6 and later), vLLM and
    LoRAX all read: rank, alpha, targets, no bias, no modules_to_save, no DoRA; `use_rslora` only
    when set (older PEFT has no such field, and its default is False)."""
    bad = sorted(set(targets) & UNPORTABLE_TARGETS)
    if bad:
        raise ValueError(f"target modules {bad} cannot be served as LoRA by vLLM / LoRAX")
    alpha = adapter.alpha
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_label(base_model),
        "r": adapter.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    if adapter.use_rslora:
        cfg["use_rslora"] = True
    return cfg


def export_peft(
    adapter: JobAdapter, out_dir: str | Path, targets: list[str], base_model: str = "",
    dtype: torch.dtype | None = None, metadata: dict[str, str] | None = None,
) -> Path:
    """Write the adapter to out_dir atomically (files land under temp names, then rename)."""
    return write_peft(adapter.peft_state_dict(), peft_config_dict(adapter, targets, base_model),
                      out_dir, dtype, metadata)


def write_peft(
    weights: dict[str, torch.Tensor], config: dict, out_dir: str | Path,
    dtype: torch.dtype | None = None, metadata: dict[str, str] | None = None,
) -> Path:
    """The files of an export: `weights` (PEFT key names, e.g. `JobAdapter.peft_state_dict` of a
    snapshot of its flat tensor) and the adapter_config.json dict, under temp names then renamed.
    The weights go through save_safetensors, not safetensors' save_file: this runs on the
    executor's writer thread, which must keep up with the exports (its queue is bounded) while the
    training loop holds the GIL most of the time."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp_w = out / ".adapter_model.safetensors.tmp"
    save_safetensors(weights, tmp_w, {"format": "pt", **(metadata or {})}, dtype=dtype)
    tmp_c = out / ".adapter_config.json.tmp"
    tmp_c.write_text(json.dumps(config, indent=2))
    os.replace(tmp_w, out / "adapter_model.safetensors")
    os.replace(tmp_c, out / "adapter_config.json")
    return out


EXPORT_FILES = ("adapter_model.safetensors", "adapter_config.json")  # what write_peft leaves in a folder


def link_files(src: str | Path, dst: str | Path) -> Path:
    """dst's export files as src's (the same weights exported twice: a job's final adapter at the
    step of its best): each a hard link where src and dst share a file system, else a copy; under
    a temp name, then renamed, as write_peft does. A later write of src replaces its files by
    rename, so dst keeps what it got."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in EXPORT_FILES:
        tmp = dst / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.link(src / name, tmp)
        except OSError:
            shutil.copyfile(src / name, tmp)
        os.replace(tmp, dst / name)
    return dst


# The safetensors format's dtype names (its README); any other torch dtype is refused rather than
# written under a name a reader would misread.
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def save_safetensors(
    tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `tensors` as a safetensors file (8-byte little-endian header length, JSON header, then
    the data), each tensor's bytes handed to the file straight from its memory.

    Why not safetensors.torch.save_file: releases of it that turn every tensor into Python bytes
    first (`_tobytes`) copy the whole export once more, holding the GIL; newer ones (0.8 here)
    write from the tensors' pointers, but need contiguous tensors, and making PEFT's lora_B views
    (transposed views of the adapter's flat tensor) contiguous with torch, one call per tensor on
    the writer thread, gives the GIL away and waits for it back hundreds of times per export.
    Here the bytes are cut from each storage by numpy (transposed ones copied, one tensor at a
    time, at most _COPIES_HELD bytes of copies waiting), and os.writev hands them to the file
    with the GIL released. A tensor on another device or to be converted to `dtype` (None: its
    own) is moved by torch, one at a time. Tensors are laid out by element size, largest first, so
    each one starts aligned to its element size (the header is padded with spaces to keep the data
    8-byte aligned), which readers that mmap the file count on."""
    if sys.byteorder != "little":
        raise RuntimeError("save_safetensors writes the host's bytes as they are: little-endian only")
    meta = dict(metadata or {})
    bad_meta = [k for k, v in meta.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad_meta:
        raise ValueError(f"safetensors metadata must map str to str; not so for {bad_meta}")
    plan = []  # (name, tensor, target dtype), in the file's order
    for name, t in tensors.items():
        if name == "__metadata__":
            raise ValueError("a tensor cannot be named __metadata__ (the header's metadata key)")
        want = dtype or t.dtype
        if want not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {want} has no safetensors name "
                             f"(supported: {sorted(str(d) for d in SAFETENSORS_DTYPES)})")
        if t.is_sparse or t.layout != torch.strided:
            raise ValueError(f"tensor {name!r}: only dense tensors can be written ({t.layout})")
        plan.append((name, t, want))
    plan.sort(key=lambda p: (-p[2].itemsize, p[0]))
    header: dict[str, dict] = {"__metadata__": meta} if meta else {}
    offset = 0
    for name, t, want in plan:
        nbytes = t.numel() * want.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[want], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    # Torch calls (detach, view, contiguous: their bindings release the GIL) and writes each hand
    # the GIL over, and the writer thread then waits to get it back behind a training loop that
    # holds it, up to the switch interval (5 ms): so no torch call per tensor on the common path,
    # and few writev calls of many buffers each.
    storages: dict[tuple[int, int], np.ndarray] = {}
    pending: list = [len(text).to_bytes(8, "little"), text]
    copied = 0  # bytes of copies among `pending`
    with open(path, "wb", buffering=0) as f:
        for _, t, want in plan:
            if t.numel() == 0:
                continue
            if t.device.type == "cpu" and t.dtype == want:
                data = _bytes_of(t, storages)
                copied += 0 if t.is_contiguous() else data.nbytes
            else:  # another device or dtype: torch makes the copy
                data = _bytes_of(t.detach().to("cpu", want).contiguous(), {})
                copied += data.nbytes
            pending.append(data)
            if copied >= _COPIES_HELD or len(pending) >= _IOV_MAX:
                _write_all(f.fileno(), pending)
                pending, copied = [], 0
        _write_all(f.fileno(), pending)
        if f.tell() != 8 + len(text) + offset:
            raise OSError(f"{path}: wrote {f.tell()} bytes, the header promises {8 + len(text) + offset}")
    return Path(path)


def load_peft_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of an exported adapter (PEFT key names)."""
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "adapter_model.safetensors"))


def _iov_max() -> int:
    """How many buffers one writev takes (Linux: 1024; -1 from sysconf means no stated limit)."""
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        return 16
    return 1024 if n < 1 else min(n, 1024)


_IOV_MAX = _iov_max()


# At most this many bytes of tensors copied for the file (transposed or converted) wait for a write:
# copies go one tensor at a time, never a second copy of the whole export.
_COPIES_HELD = 64 << 20
_SAME_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bytes_of(t: torch.Tensor, storages: dict[tuple[int, int], np.ndarray]) -> np.ndarray:
    """The bytes of CPU tensor `t` in C order: a slice of its storage's bytes when it is
    contiguous, else a copy numpy gathers from them through t's strides (elements moved as
    unsigned ints of their size, so bfloat16 and float8, which numpy lacks, go the same way).
    A storage's bytes (a uint8 numpy view of it) are made once, kept in `storages`."""
    st = t.untyped_storage()
    key = (st.data_ptr(), st.nbytes())
    whole = storages.get(key)
    if whole is None:
        whole = storages[key] = torch.empty(0, dtype=torch.uint8).set_(st).numpy()
    size = t.element_size()
    begin = t.storage_offset() * size
    if t.is_contiguous():
        return whole[begin:begin + t.numel() * size]
    extent = 1 + sum((n - 1) * step for n, step in zip(t.shape, t.stride(), strict=True))
    elems = whole[begin:begin + extent * size].view(_SAME_SIZE[size])
    src = np.lib.stride_tricks.as_strided(elems, tuple(t.shape), tuple(step * size for step in t.stride()))
    return np.ascontiguousarray(src).reshape(-1).view(np.uint8)


def _write_all(fd: int, buffers: list) -> None:
    """Write the buffers in order, resuming after a partial write (Linux writes at most ~2 GiB a
    call); a single os.write at a time where the platform has no writev."""
    views = [v for v in map(memoryview, buffers) if v.nbytes]
    i = 0
    while i < len(views):
        n = os.writev(fd, views[i:i + _IOV_MAX]) if hasattr(os, "writev") else os.write(fd, views[i])
        if n <= 0:
            raise OSError(f"write to fd {fd} made no progress")
        while i < len(views) and n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        if n:
            views[i] = views[i][n:]
