"""An attempt's artifacts in storage: a job's adapter (the PEFT files) and the task's checkpoints,
whose unchanged files are carried from an earlier checkpoint of the task (listed again, pointing at
the blob stored then: no bytes sent or copied). A blob is deleted only once no artifact lists it."""

from __future__ import annotations

import hashlib
import json
import struct
from typing import BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.protocol import ADAPTER_FILES, CARRY_UNAVAILABLE, ArtifactMeta
from service.adapters import portable_config_file
from service.artifact_keys import blob_key, blob_owner, file_key
from service.core.errors import ApiError, conflict, invalid
from service.core.storage import Storage
from service.events import add_event
from service.models import Artifact, Job, new_id
from service.worker_api import fence_report


def _check_name(name: str) -> str:
    if not name or "/" in name or "\\" in name or name in (".", "..") or len(name) > 200:
        raise invalid(f"bad artifact file name {name!r}", param="files")
    return name


def _check_safetensors(src: BinaryIO) -> None:
    src.seek(0)
    head = src.read(8)
    if len(head) < 8:
        raise invalid("adapter_model.safetensors is too short", param="files")
    (n,) = struct.unpack("<Q", head)
    if n > 100 * 1024 * 1024:
        raise invalid("adapter_model.safetensors has an implausible header", param="files")
    try:
        header = json.loads(src.read(n))
    except ValueError as exc:
        raise invalid("adapter_model.safetensors header is not JSON", param="files") from exc
    if not isinstance(header, dict):
        raise invalid("adapter_model.safetensors header is not an object", param="files")
    src.seek(0)


def store_artifact(session: Session, storage: Storage, task_id: str, meta: ArtifactMeta,
                   files: list[tuple[str, BinaryIO]], max_bytes: int) -> Artifact:
    """Store (or replace, same key: a retry) an adapter of a job or a checkpoint of the task,
    reported by the attempt meta.placement_id (fenced). Flushes; the caller commits."""
    task, _ = fence_report(session, task_id, meta.placement_id)
    if not files and not meta.carried:
        raise invalid("no files uploaded", param="files")
    names = [_check_name(n) for n, _ in files]
    if len(set(names)) != len(names):
        raise invalid("duplicate file names", param="files")
    job: Job | None = None
    if meta.job_id is not None:
        job = session.get(Job, meta.job_id)
        if job is None or job.task_id != task.id:
            raise invalid(f"job {meta.job_id!r} is not a job of task {task.id!r}", param="job_id")
    if meta.kind == "adapter":
        if job is None:
            raise invalid("an adapter needs job_id", param="job_id")
        missing = [n for n in ADAPTER_FILES if n not in names]
        if missing:
            raise invalid(f"adapter is missing {', '.join(missing)}", param="files")
        # What tenants download: the registered model name, only fields PEFT/vLLM/LoRAX accept
        files = [(n, portable_config_file(src, task.base_model) if n == "adapter_config.json"
                  else src) for n, src in files]
        blobs = dict(files)
        _check_safetensors(blobs["adapter_model.safetensors"])
        key = f"adapter:{job.id}"  # one adapter per job: a new upload replaces it
    else:
        if meta.step is None and meta.key is None:
            raise invalid("a checkpoint needs step (or key)", param="step")
        key = f"checkpoint:{meta.key if meta.key is not None else meta.step}"
    sizes = _sizes(files)
    if sum(sizes) > max_bytes:
        raise ApiError(413, "artifact_too_large", f"artifact is {sum(sizes)} bytes; the limit "
                       f"is {max_bytes}", "files")
    existing = session.scalar(select(Artifact).where(
        Artifact.task_id == task.id, Artifact.key == key).with_for_update())
    artifact_id = existing.id if existing is not None else new_id("art")
    carried = _carried(session, storage, task.id, meta, set(names))
    listing = _put_files(storage, artifact_id, files, sizes) + carried
    if existing is not None:  # a retry, or a checkpoint of the same step: it replaces the listing
        _drop_unlisted(session, storage, existing, listing)
    artifact = existing or Artifact(id=artifact_id, task_id=task.id, key=key)
    artifact.kind, artifact.job_id, artifact.step = meta.kind, meta.job_id, meta.step
    artifact.files, artifact.meta = listing, meta.meta
    if existing is None:
        session.add(artifact)
        session.flush()
        add_event(session, task.id, f"{meta.kind}_uploaded", f"{meta.kind} {key} stored",
                  job_id=meta.job_id, data={"artifact_id": artifact.id, "step": meta.step})
    session.flush()
    return artifact


def _sizes(files: list[tuple[str, BinaryIO]]) -> list[int]:
    sizes = []
    for _, src in files:
        src.seek(0, 2)
        sizes.append(src.tell())
        src.seek(0)
    return sizes


def _put_files(storage: Storage, artifact_id: str, files: list[tuple[str, BinaryIO]],
               sizes: list[int]) -> list[dict]:
    """Store the files as the artifact's own (artifact_keys.file_key); their listing: name,
    bytes, sha256."""
    listing = []
    for (name, src), size in zip(files, sizes, strict=True):
        digest = hashlib.sha256()
        while block := src.read(1 << 20):
            digest.update(block)
        src.seek(0)
        storage.put(file_key(artifact_id, name), src)
        listing.append({"name": name, "bytes": size, "sha256": digest.hexdigest()})
    return listing


def _carried(session: Session, storage: Storage, task_id: str, meta: ArtifactMeta,
             uploaded: set[str]) -> list[dict]:
    """The listing of the files meta carries from an earlier checkpoint of the task, each
    pointing at the blob that one lists (its own, or the one it carried in turn). The source is
    locked, so a concurrent replacement of it cannot delete a blob this one is about to list."""
    if not meta.carried:
        return []
    if meta.kind != "checkpoint" or meta.carry_from is None:
        raise invalid("only a checkpoint carries files, from carry_from", param="carry_from")
    names = [_check_name(n) for n in meta.carried]
    if len(set(names)) != len(names) or set(names) & uploaded:
        raise invalid("a file carried twice, or carried and uploaded", param="carried")
    src = session.scalar(select(Artifact).where(Artifact.id == meta.carry_from).with_for_update())
    if src is None or src.task_id != task_id or src.kind != "checkpoint":
        raise conflict(f"artifact {meta.carry_from!r} is not a checkpoint of this task",
                       code=CARRY_UNAVAILABLE)
    entries = {f["name"]: f for f in src.files}
    listing = []
    for name in names:
        entry = entries.get(name)
        if entry is None or not storage.exists(blob_key(src, entry)):
            raise conflict(f"checkpoint {src.id!r} holds no file {name!r}", code=CARRY_UNAVAILABLE)
        listing.append({"name": name, "bytes": entry["bytes"], "sha256": entry["sha256"],
                        "blob": blob_key(src, entry)})
    return listing


def _drop_unlisted(session: Session, storage: Storage, artifact: Artifact, listing: list[dict]) -> None:
    """An artifact's listing replaced: delete the blobs it listed before and lists no more,
    unless another artifact still lists them (carried by a later checkpoint, or its owner's)."""
    keep = {blob_key(artifact, e) for e in listing}
    for old in artifact.files:
        blob = blob_key(artifact, old)
        if blob not in keep and not _listed_elsewhere(session, blob, artifact.id):
            storage.delete(blob)


def _listed_elsewhere(session: Session, blob: str, artifact_id: str) -> bool:
    carrier = session.scalar(select(Artifact.id).where(
        Artifact.id != artifact_id, Artifact.files.contains([{"blob": blob}])).limit(1))
    if carrier is not None:
        return True
    owner_id, name = blob_owner(blob)
    owner = session.get(Artifact, owner_id) if owner_id != artifact_id else None
    return owner is not None and any(f["name"] == name and "blob" not in f for f in owner.files)


