"""The backbone onto the GPU at the disk's (or the page cache's) speed: the model is built on the
device from its config, then its tensors, dealt by size to several threads (whatever the shards),
are read straight into the device tensors (a 16 GB backbone took 17 s through `from_pretrained` with weights in the page
cache, one tensor at a time). Where the checkpoint's names do not map one to one onto the model's
state (a family whose loader converts weights, a missing tensor other than a tied head), it falls
back to `from_pretrained`: the same model either way.
"""
from __future__ import annotations

import json
import logging
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


def load_to_device(model_dir: str, device: torch.device, dtype: torch.dtype, threads: int = 8) -> nn.Module | None:
    """The model on `device` with the checkpoint's weights, read in parallel; None where the
    checkpoint does not map onto the model name for name (the caller uses from_pretrained)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    root = Path(model_dir)
    files = shard_files(root)
    if not files:
        return None
    names: dict[Path, list[str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names[f] = list(sf.keys())
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = model.state_dict()
    stored = {n for ns in names.values() for n in ns}
    tied = {k for k in state if k not in stored and _is_tied_head(model, k)}
    if stored - set(state) or set(state) - stored - tied:
        log.info("checkpoint names differ from the model's: loading through from_pretrained")
        del model, state
        return None

    # the tensors dealt to `threads` readers by size (largest first onto the lightest reader): one
    # large file is read by every thread too
    loads: list[list[tuple[Path, str]]] = [[] for _ in range(max(1, threads))]
    sizes = [0] * len(loads)
    for f, n in sorted(((f, n) for f, ns in names.items() for n in ns),
                       key=lambda fn: -state[fn[1]].numel() * state[fn[1]].element_size()):
        k = sizes.index(min(sizes))
        loads[k].append((f, n))
        sizes[k] += state[n].numel() * state[n].element_size()

    def read(items: list[tuple[Path, str]]) -> None:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(stream):
            for f in dict.fromkeys(f for f, _ in items):
                with safe_open(str(f), framework="pt", device="cpu") as sf:
                    for _, n in (item for item in items if item[0] == f):
                        state[n].copy_(sf.get_tensor(n))
        if stream is not None:
            stream.synchronize()

    with torch.no_grad(), ThreadPoolExecutor(max_workers=len(loads)) as pool:
        list(pool.map(read, [items for items in loads if items]))
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
