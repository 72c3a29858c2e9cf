"""The backbone onto the GPU at the disk's (or the page cache's) speed: the model is built on the
device from its config, then its tensors, dealt by size to several threads (whatever the shards),
are read by pread from the shard files (the safetensors header parsed here: no intermediate host tensor, no page
faults on mapped pages) into two pinned buffers per reader and copied asynchronously to the device tensors (a 16 GB backbone took 17 s through `from_pretrained` with
weights in the page cache, one tensor at a time; 9 s read tensor by tensor into pageable memory, then copied). Where the checkpoint's names do not map one to one onto the model's
state (a family whose loader converts weights, a missing tensor other than a tied head), it falls
back to `from_pretrained`: the same model either way.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger("loraplex.executor")


def shard_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files (its index's, or the single file), [] if none."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    return [single] if single.exists() else []


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
STAGE_BYTES = 32 << 20  # each reader's two pinned staging buffers


def read_header(path: Path) -> tuple[int, dict[str, dict]]:
    """(where the data starts, {name: {"dtype", "shape", "data_offsets"}}) of a safetensors file."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def read_into(fd: int, out: Any, offset: int) -> None:
    """Fill `out` (a writable buffer) with the file's bytes from offset: pread, the kernel's one copy
    from the page cache (no page faults on mapped pages, no intermediate buffer)."""
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise EOFError("the checkpoint file ends before its tensors do")
        done += n


class _Stager:
    """One reader's path from the file to a device tensor: on CUDA through two pinned buffers in
    turn (read from the page cache by pread, then an asynchronous copy to the device on the
    reader's stream, the next chunk's read overlapping it); on the CPU straight into the tensor
    (staged there only when asked: the same chunks, for tests)."""

    def __init__(self, device: torch.device, stage_bytes: int, staged: bool | None = None) -> None:
        cuda = device.type == "cuda"
        self.staged = cuda if staged is None else staged
        self.stream = torch.cuda.Stream(device) if cuda and self.staged else None
        self.bufs = ([torch.empty(stage_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
                     if self.staged else [])
        self.views = [buf.numpy() for buf in self.bufs]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def copy(self, dst: torch.Tensor, fd: int, offset: int) -> None:
        """dst's bytes (a contiguous uint8 view) read from the file at offset."""
        if not self.staged:
            read_into(fd, dst.detach().numpy(), offset)
            return
        size = self.bufs[0].numel()
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for off in range(0, dst.numel(), size):
                m = min(size, dst.numel() - off)
                k, self.turn = self.turn, self.turn ^ 1
                if self.events[k] is not None:
                    self.events[k].synchronize()  # its previous chunk has left for the device
                read_into(fd, self.views[k][:m], offset + off)
                dst[off:off + m].copy_(self.bufs[k][:m], non_blocking=self.stream is not None)
                if self.stream is not None:
                    self.events[k] = torch.cuda.Event()
                    self.events[k].record(self.stream)

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


def load_to_device(model_dir: str, device: torch.device, dtype: torch.dtype, threads: int = 8,
                   stage_bytes: int = STAGE_BYTES, staged: bool | None = None) -> nn.Module | None:
    """The model on `device` with the checkpoint's weights, read in parallel from the shard
    files (through pinned staging buffers to a GPU); None where the checkpoint does not map onto
    the model name for name and shape for shape (the caller uses from_pretrained)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = Path(model_dir)
    files = shard_files(root)
    if not files:
        return None
    headers = {f: read_header(f) for f in files}
    where = {n: f for f, (_, h) in headers.items() for n in h}
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = model.state_dict()
    tied = {k for k in state if k not in where and _is_tied_head(model, k)}
    if set(where) - set(state) or set(state) - set(where) - tied or any(
            list(headers[f][1][n]["shape"]) != list(state[n].shape)
            or headers[f][1][n]["dtype"] not in SAFETENSORS_DTYPES for n, f in where.items()):
        log.info("checkpoint names differ from the model's: loading through from_pretrained")
        del model, state
        return None

    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    for fd in fds.values():
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)  # read ahead while the readers start

    def offset(n: str) -> int:
        base, header = headers[where[n]]
        return base + header[n]["data_offsets"][0]

    # the tensors dealt to `threads` readers by size (largest first onto the lightest reader): one
    # large file is read by every thread too
    loads: list[list[str]] = [[] for _ in range(max(1, threads))]
    sizes = [0] * len(loads)
    for n in sorted(where, key=lambda n: -state[n].numel() * state[n].element_size()):
        k = sizes.index(min(sizes))
        loads[k].append(n)
        sizes[k] += state[n].numel() * state[n].element_size()

    def read(names: list[str]) -> None:
        stager = _Stager(device, stage_bytes, staged)
        for n in names:
            dst, fd = state[n], fds[where[n]]
            stored = SAFETENSORS_DTYPES[headers[where[n]][1][n]["dtype"]]
            if stored == dst.dtype and dst.is_contiguous():
                stager.copy(dst.view(-1).view(torch.uint8), fd, offset(n))
            else:  # another dtype than the model's: read, then converted by copy_ (rare)
                start, stop = headers[where[n]][1][n]["data_offsets"]
                raw = torch.empty(stop - start, dtype=torch.uint8)
                read_into(fd, raw.numpy(), offset(n))
                dst.copy_(raw.view(stored).view(dst.shape))
        stager.finish()

    try:
        with torch.no_grad(), ThreadPoolExecutor(max_workers=len(loads)) as pool:
            list(pool.map(read, [names for names in loads if names]))
    finally:
        for fd in fds.values():
            os.close(fd)
    if tied:
        model.tie_weights()
    if (root / "generation_config.json").exists():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    model.eval()
    return model


def _is_tied_head(model: nn.Module, key: str) -> bool:
    out = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    return (out is not None and emb is not None and key.endswith("weight") and
            out.weight is emb.weight and key.startswith("lm_head"))
