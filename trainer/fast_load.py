"""The backbone onto the GPU at the disk's (or the page cache's) speed: the model is built on the
device from its config, then its tensors, dealt by size to several threads (whatever the shards),
are copied from the mapped shard files (the safetensors header read here: no intermediate host tensor) through
two pinned buffers per reader to the device tensors (a 16 GB backbone took 17 s through `from_pretrained` with
weights in the page cache, one tensor at a time; 9 s read tensor by tensor into pageable memory, then copied). Where the checkpoint's names do not map one to one onto the model's
state (a family whose loader converts weights, a missing tensor other than a tied head), it falls
back to `from_pretrained`: the same model either way.
"""
from __future__ import annotations

import contextlib
import json
import logging
import mmap
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


class _Stager:
    """One reader's path from the file's mapped pages to a device tensor: on CUDA through two
    pinned buffers in turn (a copy from the page cache, then an asynchronous copy to the device on
    the reader's stream, the next chunk's host copy overlapping it); on the CPU directly (staged
    there only when asked: the same chunks, for tests)."""

    def __init__(self, device: torch.device, stage_bytes: int, staged: bool | None = None) -> None:
        cuda = device.type == "cuda"
        self.staged = cuda if staged is None else staged
        self.stream = torch.cuda.Stream(device) if cuda and self.staged else None
        self.bufs = ([torch.empty(stage_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
                     if self.staged else [])
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst's bytes from src's (uint8, as many)."""
        if not self.staged:
            dst.copy_(src)
            return
        size = self.bufs[0].numel()
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for off in range(0, src.numel(), size):
                m = min(size, src.numel() - off)
                k, self.turn = self.turn, self.turn ^ 1
                if self.events[k] is not None:
                    self.events[k].synchronize()  # its previous chunk has left for the device
                self.bufs[k][:m].copy_(src[off:off + m])
                dst[off:off + m].copy_(self.bufs[k][:m], non_blocking=self.stream is not None)
                if self.stream is not None:
                    self.events[k] = torch.cuda.Event()
                    self.events[k].record(self.stream)

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


def load_to_device(model_dir: str, device: torch.device, dtype: torch.dtype, threads: int = 8,
                   stage_bytes: int = STAGE_BYTES, staged: bool | None = None) -> nn.Module | None:
    """The model on `device` with the checkpoint's weights, read in parallel from the mapped shard
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

    maps, views = {}, {}
    for f in files:  # one private mapping per file (written by no one: nothing is copied)
        with open(f, "rb") as fh:
            maps[f] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        if hasattr(mmap, "MADV_WILLNEED"):
            maps[f].madvise(mmap.MADV_WILLNEED)  # read ahead while the readers start
        views[f] = torch.frombuffer(maps[f], dtype=torch.uint8)

    def source(n: str) -> torch.Tensor:
        f = where[n]
        base, header = headers[f]
        start, stop = header[n]["data_offsets"]
        return views[f][base + start: base + stop]

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
            dst, src = state[n], source(n)
            stored = SAFETENSORS_DTYPES[headers[where[n]][1][n]["dtype"]]
            if stored == dst.dtype and dst.is_contiguous():
                stager.copy(dst.view(-1).view(torch.uint8), src)
            else:  # another dtype than the model's: converted by copy_ (rare: bf16 models, bf16 files)
                dst.copy_(src.view(stored).view(dst.shape))
        stager.finish()

    try:
        with torch.no_grad(), ThreadPoolExecutor(max_workers=len(loads)) as pool:
            list(pool.map(read, [names for names in loads if names]))
    finally:
        views.clear()
        for m in maps.values():
            try:
                m.close()
            except BufferError:  # a view still referenced (an error's traceback): the GC unmaps it
                pass
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
