"""Resumable checkpoints of the engine's jobs: adapter weights, AdamW state, LR schedule, data
position, step counts (plus whatever the executor adds), written atomically with torch.save."""

from __future__ import annotations

import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from trainer.engine import JobSpec, JobState, MultiLoraEngine


def job_state_dict(state: JobState) -> dict[str, Any]:
    """Everything needed to continue one job exactly where it stopped (tensors on CPU)."""
    return {
        "spec": asdict(state.spec),
        "adapter": {k: v.detach().to("cpu", copy=True) for k, v in state.adapter.state_dict().items()},
        "optimizer": _to_cpu(state.optimizer.state_dict()),
        "scheduler": state.scheduler.state_dict(),
        "stream": state.stream.state_dict(),
        "step": state.step,
        "skipped_steps": state.skipped_steps,
        "last_loss": state.last_loss,
        "total_steps": state.total_steps,
    }


def spec_from_dict(d: dict[str, Any]) -> JobSpec:
    known = {f.name for f in fields(JobSpec)}
    d = {k: v for k, v in d.items() if k in known}
    d["betas"] = tuple(d.get("betas", (0.9, 0.999)))
    return JobSpec(**d)


def restore_job(engine: MultiLoraEngine, d: dict[str, Any]) -> JobState:
    """Rebuild a job's state on the engine's device from `job_state_dict` output (not attached)."""
    state = engine.new_job(spec_from_dict(d["spec"]))
    state.adapter.load_state_dict(d["adapter"])
    state.optimizer.load_state_dict(d["optimizer"])
    state.scheduler.load_state_dict(d["scheduler"])
    state.stream.load_state_dict(d["stream"])
    state.step = d["step"]
    state.skipped_steps = d["skipped_steps"]
    state.last_loss = d["last_loss"]
    state.total_steps = d["total_steps"]
    return state


def rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | Path, payload: dict[str, Any]) -> Path:
    """torch.save to a temp file then rename, so a killed executor never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    # our own file (job specs, scheduler state are plain python objects): not weights_only
    return torch.load(path, map_location="cpu", weights_only=False)


def _to_cpu(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
