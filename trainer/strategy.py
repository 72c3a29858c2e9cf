"""How an executor is distributed, one part the recipe (trainer.executor) is composed with: the
`Strategy` protocol and the one-GPU strategy here; adapter parallelism (FSDP2 backbone,
rank-local adapters) in trainer.parallel. A new strategy is one new file; the recipe never asks
which one it holds, only the questions below.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from trainer.checkpoint import FileWriter

log = logging.getLogger("loraplex.executor")


class Strategy(Protocol):
    """What the recipe asks of its distribution."""

    rank: int
    world: int
    # the engine whole in this process: it may pack sequences back to back (varlen attention)
    # and switch activation recompute per step from a memory model measured here
    whole_engine: bool
    # several tasks on one executor (co-location), each failing alone
    hosts_many_tasks: bool

    def device(self, requested: str) -> torch.device: ...
    def load_model(self, model_dir: str, device: torch.device, dtype: torch.dtype) -> nn.Module: ...
    def prepare_engine(self, engine: Any, device: torch.device) -> Any: ...
    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order: the small numbers every rank decides from."""
    def callbacks(self, real: Any) -> Any:
        """The callbacks the recipe calls, reaching the caller's `real` ones."""
    def flush(self) -> None:
        """End of an executor step: deliver what the callbacks collected."""
    def collect_parts(self, out: Path, part: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Every rank's checkpoint part on rank 0 (None on the others)."""
    def file_writer(self, async_writes: bool, buffer_bytes: float) -> FileWriter | None:
        """The writer thread for checkpoints and exports, or None: written in the loop."""
    def contain(self, work: Callable[[], Any], on_error: Callable[[Exception], None]) -> Any:
        """Run a task's own work; where tasks fail alone, its exception goes to on_error."""


class OneGpu:
    """This process alone, on one GPU (or the CPU): nothing to exchange."""

    rank = 0
    world = 1
    whole_engine = True
    hosts_many_tasks = True

    def device(self, requested: str) -> torch.device:
        if requested == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(requested)

    def load_model(self, model_dir: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        from transformers import AutoModelForCausalLM

        from trainer.fast_load import load_to_device

        if device.type == "cuda":
            # every shard read by its own thread straight into the device tensors (trainer.fast_load)
            model = load_to_device(model_dir, device, dtype)
            if model is not None:
                return model
            return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map={"": device})
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)

    def prepare_engine(self, engine: Any, device: torch.device) -> Any:
        return engine

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def callbacks(self, real: Any) -> Any:
        return real  # the caller's own, at once

    def flush(self) -> None:
        return None

    def collect_parts(self, out: Path, part: dict[str, Any]) -> list[dict[str, Any]] | None:
        return [part]

    def file_writer(self, async_writes: bool, buffer_bytes: float) -> FileWriter | None:
        return FileWriter(buffer_bytes) if async_writes else None

    def contain(self, work: Callable[[], Any], on_error: Callable[[Exception], None]) -> Any:
        """A task's exception is its own: it fails that task alone (None returned)."""
        try:
            return work()
        except Exception as exc:  # noqa: BLE001 - the task's, not the executor's
            on_error(exc)
            return None
