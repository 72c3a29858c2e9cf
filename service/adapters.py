"""Adapter downloads: the best job of a task or any job, as a .tar.gz or .zip archive holding
adapter_config.json + adapter_model.safetensors (what PeftModel.from_pretrained loads)."""

from __future__ import annotations

import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import ApiError, conflict, not_found
from service.models import Artifact, Job, Task
from service.storage import CHUNK, Storage

ArchiveFormat = Literal["tar.gz", "zip"]
MEDIA_TYPES = {"tar.gz": "application/gzip", "zip": "application/zip"}


def job_adapter(session: Session, job: Job) -> Artifact:
    artifact = session.scalar(select(Artifact).where(
        Artifact.job_id == job.id, Artifact.kind == "adapter"))
    if artifact is None:
        raise ApiError(404, "adapter_not_found", f"job {job.id!r} has no adapter (state "
                       f"{job.state})", "job_id")
    return artifact


def task_adapter(session: Session, task: Task) -> tuple[Job, Artifact]:
    """The adapter of the task's best job; 409 until the task succeeded."""
    if task.state != "succeeded" or task.best_job_id is None:
        raise conflict(f"task {task.id!r} is {task.state}; the best adapter exists once it "
                       "succeeded", code="task_not_succeeded")
    job = session.get(Job, task.best_job_id)
    if job is None:
        raise not_found("job", task.best_job_id)
    return job, job_adapter(session, job)


def build_archive(storage: Storage, artifact: Artifact, fmt: ArchiveFormat) -> Iterator[bytes]:
    """Write the archive to a temp file (adapters are small next to the model) and stream it."""
    tmp = tempfile.TemporaryFile()
    if fmt == "zip":
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for f in artifact.files:
                with zf.open(f["name"], "w") as out:
                    for block in storage.iter_bytes(f"artifacts/{artifact.id}/{f['name']}"):
                        out.write(block)
    else:
        with tarfile.open(fileobj=tmp, mode="w:gz") as tf:
            for f in artifact.files:
                key = f"artifacts/{artifact.id}/{f['name']}"
                info = tarfile.TarInfo(f["name"])
                info.size = storage.size(key)
                info.mode = 0o644
                with storage.open(key) as src:
                    tf.addfile(info, src)
    tmp.seek(0)

    def _stream() -> Iterator[bytes]:
        with tmp:
            while block := tmp.read(CHUNK):
                yield block

    return _stream()


def archive_name(job: Job, fmt: ArchiveFormat) -> str:
    return f"adapter-{job.id}.{fmt}"


