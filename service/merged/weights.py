"""The merge itself: a base model directory plus a PEFT LoRA adapter directory in, a plain
transformers model directory out (sharded safetensors in the base's dtype, its config, its
tokenizer files). Needs torch, transformers and peft (the service's [train] extra), imported
here only, so the service runs without them until a merge is asked for."""

from __future__ import annotations

import shutil
from pathlib import Path

# Files of a model directory that are not weights or the config: the tokenizer's (every kind
# transformers writes) and the generation defaults, copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
MAX_SHARD_SIZE = "5GB"


class MergeError(Exception):
    """A merge that cannot be done, with a message fit for the tenant (no paths, no traceback)."""


def merge_adapter(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path,
                  max_shard_size: str | int = MAX_SHARD_SIZE) -> str:
    """Merge the adapter into the base weights, W' = W + scaling * B A, the sum in float32 and
    cast back to each weight's own dtype, and save the plain model to out_dir. Returns the
    dtype's name (the base's: the model is loaded with dtype="auto")."""
    try:
        import torch
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise MergeError("merged models need torch, transformers and peft on the service "
                         "(its [train] extra)") from exc
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto")
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        try:
            peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
        except Exception as exc:  # noqa: BLE001 - a key or shape the base does not have
            raise MergeError(f"the adapter does not fit the base model "
                             f"({type(exc).__name__})") from exc
        merged = 0
        for module in peft_model.modules():
            if isinstance(module, LoraLayer):
                merged += _merge_layer(module, torch)
        if merged == 0:
            raise MergeError("the adapter holds no LoRA weights for this base model")
        model = peft_model.unload()  # the base modules back, their weights merged above
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=max_shard_size)
    for name in TOKENIZER_FILES:
        if (base_dir / name).is_file() and not (out_dir / name).exists():
            shutil.copyfile(base_dir / name, out_dir / name)
    return str(dtype).removeprefix("torch.")


def _merge_layer(layer, torch) -> int:  # noqa: ANN001 - peft's LoraLayer, the torch module
    """Fold every active adapter of one LoRA layer into its base weight; how many were folded."""
    weight = layer.get_base_layer().weight
    done = 0
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        if getattr(layer, "use_dora", {}).get(name):
            raise MergeError("DoRA adapters cannot be merged here")
        a = layer.lora_A[name].weight.float()
        b = layer.lora_B[name].weight.float()
        delta = (b @ a) * layer.scaling[name]
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T
        if delta.shape != weight.shape:
            raise MergeError(f"an adapter weight of shape {tuple(delta.shape)} does not fit the "
                             f"base weight of shape {tuple(weight.shape)}")
        weight.data = (weight.data.float() + delta.to(weight.device)).to(weight.dtype)
        done += 1
    return done
