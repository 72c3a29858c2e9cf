"""PEFT-format export of one job's adapter: adapter_config.json + adapter_model.safetensors with
PEFT's key names, loadable by peft.PeftModel.from_pretrained (and by vLLM / LoRAX)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from trainer.multilora import JobAdapter


def peft_config_dict(adapter: JobAdapter, targets: list[str], base_model: str = "") -> dict:
    """The adapter_config.json of a LoRA adapter (fields PEFT needs; the rest take defaults)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": adapter.use_rslora,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def export_peft(
    adapter: JobAdapter, out_dir: str | Path, targets: list[str], base_model: str = "",
    dtype: torch.dtype | None = None, metadata: dict[str, str] | None = None,
) -> Path:
    """Write the adapter to out_dir atomically (files land under temp names, then rename)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in adapter.peft_state_dict().items()
    }
    tmp_w = out / ".adapter_model.safetensors.tmp"
    save_file(tensors, str(tmp_w), metadata={"format": "pt", **(metadata or {})})
    tmp_c = out / ".adapter_config.json.tmp"
    tmp_c.write_text(json.dumps(peft_config_dict(adapter, targets, base_model), indent=2))
    os.replace(tmp_w, out / "adapter_model.safetensors")
    os.replace(tmp_c, out / "adapter_config.json")
    return out


def load_peft_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of an exported adapter (PEFT key names)."""
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "adapter_model.safetensors"))
