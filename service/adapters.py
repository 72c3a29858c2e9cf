"""Adapters: the portable adapter_config.json stored for every uploaded adapter (the registered
model name, only fields PEFT, vLLM and LoRAX accept), and downloads of the best job of a task or
any job, as a .tar.gz or .zip archive holding adapter_config.json + adapter_model.safetensors
(what PeftModel.from_pretrained, vLLM's LoRARequest and LoRAX load)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from functools import partial
from typing import Any, BinaryIO, Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.states import TaskState
from service.artifact_keys import blob_key
from service.core.errors import ApiError, conflict, not_found
from service.core.storage import CHUNK, Storage
from service.models import Artifact, Job, Task

# The adapter_config.json fields that PEFT (0.6 and later), vLLM and LoRAX all read, and what
# each must be for the adapter to load in all three (None: any value of the right type).
PORTABLE_FIELDS: dict[str, Any] = {
    "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "r": None,
    "lora_alpha": None, "lora_dropout": None, "target_modules": None, "bias": "none",
    "fan_in_fan_out": False, "init_lora_weights": None, "modules_to_save": None,
    "inference_mode": None, "use_rslora": None,
}
# vLLM serves LoRA on the decoder's linears only (no lm_head / embedding LoRA).
UNPORTABLE_TARGETS = frozenset({"lm_head", "embed_tokens", "wte", "wpe", "embed_out", "embed_in"})
ArchiveFormat = Literal["tar.gz", "zip"]
MEDIA_TYPES = {"tar.gz": "application/gzip", "zip": "application/zip", "tar": "application/x-tar"}


def portable_config(cfg: object, base_model: str) -> dict:
    """The adapter_config.json a tenant downloads: named after the registered base model (never
    the worker's path to it), only PORTABLE_FIELDS, `use_rslora` only when true. ValueError for
    a value no server could load (DoRA, bias, modules_to_save, LoRA on lm_head or embeddings, a
    bad rank / alpha / target list)."""
    if not isinstance(cfg, dict):
        raise ValueError("adapter_config.json must be a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type {cfg.get('peft_type')!r}: only LORA adapters are served")
    r, alpha, targets = cfg.get("r"), cfg.get("lora_alpha"), cfg.get("target_modules")
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
        raise ValueError("r must be a positive integer")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int | float)
                              or alpha <= 0):
        raise ValueError("lora_alpha must be a positive number")
    if targets is not None and (not isinstance(targets, list) or not targets or not all(
            isinstance(t, str) and t for t in targets)):
        raise ValueError("target_modules must be a non-empty list of module names")
    targets = targets or []
    dropout = cfg.get("lora_dropout") or 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ValueError("lora_dropout must be a number in [0, 1)")
    dropout = float(dropout)
    bad = sorted(set(targets) & UNPORTABLE_TARGETS)
    if bad:
        raise ValueError(f"target modules {bad} cannot be served as LoRA by vLLM / LoRAX")
    if cfg.get("use_dora"):
        raise ValueError("DoRA adapters are not served by vLLM")
    if cfg.get("modules_to_save"):
        raise ValueError("modules_to_save must be empty (vLLM loads LoRA weights only)")
    if cfg.get("bias", "none") != "none":
        raise ValueError("bias must be 'none'")
    out = {k: v for k, v in PORTABLE_FIELDS.items() if v is not None}
    out.update({
        "base_model_name_or_path": base_model,
        "lora_dropout": dropout,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    })
    if r is not None:
        out["r"] = r
    if alpha is not None:
        out["lora_alpha"] = int(alpha) if float(alpha).is_integer() else alpha
    if targets:
        out["target_modules"] = sorted(set(targets))
    if cfg.get("use_rslora"):
        out["use_rslora"] = True
    return {k: out[k] for k in PORTABLE_FIELDS if k in out}


def portable_config_file(src: BinaryIO, base_model: str) -> BinaryIO:
    """portable_config of an uploaded adapter_config.json, as a new file; a 422 (param files)
    for one that is not JSON or not portable."""
    src.seek(0)
    try:
        cfg = portable_config(json.loads(src.read()), base_model)
    except ValueError as exc:  # a JSONDecodeError too
        raise ApiError(422, "invalid_adapter", f"adapter_config.json: {exc}", "files") from exc
    return io.BytesIO(json.dumps(cfg, indent=2).encode())


def job_adapter(session: Session, job: Job) -> Artifact:
    artifact = session.scalar(select(Artifact).where(
        Artifact.job_id == job.id, Artifact.kind == "adapter"))
    if artifact is None:
        raise ApiError(404, "adapter_not_found", f"job {job.id!r} has no adapter (state "
                       f"{job.state})", "job_id")
    return artifact


def task_adapter(session: Session, task: Task) -> tuple[Job, Artifact]:
    """The adapter of the task's best job; 409 until the task succeeded."""
    if task.state != TaskState.SUCCEEDED or task.best_job_id is None:
        raise conflict(f"task {task.id!r} is {task.state}; the best adapter exists once it "
                       f"{TaskState.SUCCEEDED}", code="task_not_succeeded")
    job = session.get(Job, task.best_job_id)
    if job is None:
        raise not_found("job", task.best_job_id)
    return job, job_adapter(session, job)


def write_archive(out: BinaryIO, members: list[tuple[str, int, Callable[[], BinaryIO]]],
                  fmt: ArchiveFormat | Literal["tar"]) -> None:
    """Write (name, size, open) members to `out` as a tar, .tar.gz or .zip; the same members give
    the same bytes every time (no timestamps), so a download can resume with a Range request."""
    if fmt == "zip":
        with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for name, _, open_member in members:
                with open_member() as src, zf.open(name, "w") as dst:
                    shutil.copyfileobj(src, dst, CHUNK)
        return
    gz = gzip.GzipFile(fileobj=out, mode="wb", mtime=0, filename="") if fmt == "tar.gz" else None
    with tarfile.open(fileobj=gz or out, mode="w") as tf:
        for name, size, open_member in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode = size, 0o644
            with open_member() as src:
                tf.addfile(info, src)
    if gz is not None:
        gz.close()


def build_archive(storage: Storage, artifact: Artifact, fmt: ArchiveFormat) -> tuple[BinaryIO, int]:
    """The adapter's archive in a temp file (adapters are small next to the model), at its
    start, and its size."""
    tmp = tempfile.TemporaryFile()
    keys = [(f["name"], blob_key(artifact, f)) for f in artifact.files]
    write_archive(tmp, [(name, storage.size(key), partial(storage.open, key))
                        for name, key in keys], fmt)
    size = tmp.tell()
    tmp.seek(0)
    return tmp, size


def archive_etag(artifact: Artifact, fmt: str) -> str:
    """Changes with the adapter's files (a re-upload) and the format."""
    digest = hashlib.sha256(json.dumps([artifact.id, artifact.files, fmt], sort_keys=True,
                                       default=str).encode()).hexdigest()[:32]
    return f'"{digest}"'


def archive_name(job: Job, fmt: ArchiveFormat) -> str:
    return f"adapter-{job.id}.{fmt}"


