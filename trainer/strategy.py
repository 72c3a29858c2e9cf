"""How an executor is distributed, as one part the recipe (trainer.executor) is composed with: the
one-GPU strategy here; adapter parallelism (FSDP2 backbone, rank-local adapters) in
trainer.parallel implements the same few methods. A new strategy is one new file.

A strategy answers: which device, how the model is loaded and the engine prepared, how the
ranks exchange the small numbers every rank decides from (`gather`), how callbacks reach the
caller (`callbacks`/`flush`) and how every rank's part of a checkpoint reaches rank 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


class OneGpu:
    """This process alone, on one GPU (or the CPU): nothing to exchange."""

    rank = 0
    world = 1

    def device(self, requested: str) -> torch.device:
        if requested == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(requested)

    def load_model(self, model_dir: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        from transformers import AutoModelForCausalLM

        if device.type == "cuda":
            # straight from the safetensors files onto the GPU: no full copy in host memory first
            return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map={"": device})
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)

    def prepare_engine(self, engine: Any, device: torch.device) -> Any:
        return engine

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (here: just this one)."""
        return [obj]

    def callbacks(self, real: Any) -> Any:
        """The callbacks the recipe calls: here the caller's own, at once."""
        return real

    def flush(self) -> None:
        """End of an executor step: deliver what the callbacks collected (nothing to do here)."""

    def collect_parts(self, out: Path, part: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Every rank's checkpoint part on rank 0 (None on the others)."""
        return [part]
