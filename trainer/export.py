"""PEFT-format export of one job's adapter: adapter_config.json + adapter_model.safetensors with
PEFT's key names, loadable by peft.PeftModel.from_pretrained, vLLM and LoRAX. The config names the
base model by its registered name (never a server path) and holds only fields all three accept."""

from __future__ import annotations

import json
import os
from pathlib import Path

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
    snapshot of its flat tensor) and the adapter_config.json dict, under temp names then renamed."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in weights.items()}
    tmp_w = out / ".adapter_model.safetensors.tmp"
    save_file(tensors, str(tmp_w), metadata={"format": "pt", **(metadata or {})})
    tmp_c = out / ".adapter_config.json.tmp"
    tmp_c.write_text(json.dumps(config, indent=2))
    os.replace(tmp_w, out / "adapter_model.safetensors")
    os.replace(tmp_c, out / "adapter_config.json")
    return out


def load_peft_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of an exported adapter (PEFT key names)."""
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "adapter_model.safetensors"))
