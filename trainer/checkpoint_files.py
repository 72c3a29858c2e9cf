"""A task's checkpoint on disk: `state.pt` holds the task's own state and names, for each started
job, one immutable file beside it (`job-<job id>-<job step>-<tag>.pt`, the tag one executor run's
random token, so a name is never reused for other bytes), written only when the job trained since
its last file: a parked job is written once, not at every checkpoint.

Write order (`write_checkpoint`): the new job files (temp name, fsync, rename), then state.pt the
same way, then the job files state.pt no longer names are deleted; a kill at any point leaves the
previous state.pt and every file it names. A missing or cut job file makes its state.pt unusable
(`CheckpointIncomplete`), never half a resume. A state.pt of the older format (every job's state
inline) loads as it is. Imports torch only: the worker reads state.pt with it too."""

from __future__ import annotations

import os
import pickle
import re
import secrets
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

STATE_NAME = "state.pt"
JOB_PREFIX = "job-"
FORMAT = 2  # job states in their own files (1: inline in state.pt)


class CheckpointIncomplete(RuntimeError):
    """A state.pt names a job file that is missing or not the size it was written at."""


def new_tag() -> str:
    """One executor run's token in its job files' names."""
    return secrets.token_hex(4)


def job_file_name(job_id: str, step: int, tag: str) -> str:
    return f"{JOB_PREFIX}{re.sub(r'[^A-Za-z0-9_.]', '_', job_id)}-{step}-{tag}.pt"


def job_refs(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The job entries of a state.pt that name a file (none in the older, inline format)."""
    return [d for d in [*state.get("active", []), *state.get("queue", [])] if "file" in d]


def save_checkpoint(path: str | Path, payload: Any) -> Path:
    """torch.save to a temp file, fsync, then rename (and fsync the folder), so a killed
    executor or a lost machine never leaves half a file under the name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_checkpoint(directory: Path, payload: dict[str, Any], jobs: dict[str, Any],
                     save: Callable[[Path, Any], Path] = save_checkpoint) -> Path:
    """The job files in `jobs` (name -> job state), then state.pt naming them (each reference
    given the size of its file, checked there), then the job files it does not name deleted."""
    directory = Path(directory)
    for name, state in jobs.items():
        save(directory / name, state)
    refs = job_refs(payload)
    for ref in refs:
        try:
            ref["bytes"] = (directory / ref["file"]).stat().st_size
        except FileNotFoundError as exc:
            raise CheckpointIncomplete(f"job file {ref['file']} is missing: state.pt not written") from exc
    path = save(directory / STATE_NAME, payload)
    prune(directory, {ref["file"] for ref in refs})
    return path


def prune(directory: Path, keep: set[str]) -> list[str]:
    """Delete the job files (and their leftover temp files) not in keep; the names deleted."""
    gone = []
    for path in Path(directory).glob(f"{JOB_PREFIX}*"):
        if path.name not in keep and path.is_file():
            path.unlink(missing_ok=True)
            gone.append(path.name)
    return gone


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("trainer.jobs", "JobSpec"):  # TrainJob's name before
            from trainer.jobs import TrainJob

            return TrainJob
        return super().find_class(module, name)


_PICKLE = types.SimpleNamespace(__name__="pickle", Unpickler=_Unpickler, load=pickle.load)


def load_state(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """A state.pt or job file as written (references not followed). Our own files (job specs,
    scheduler state are plain python objects): not weights_only; one written by an earlier
    version (a task paused across an upgrade) still loads. mmap: tensors not read."""
    if mmap:
        try:
            return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE,
                              mmap=True)
        except RuntimeError:  # not the zip format that mmap needs
            pass
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)


def verify(directory: str | Path, state: dict[str, Any]) -> None:
    """Raise CheckpointIncomplete unless every job file state names is there, whole (its size)."""
    for ref in job_refs(state):
        path = Path(directory) / ref["file"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointIncomplete(f"checkpoint {Path(directory) / STATE_NAME}: job file "
                                       f"{ref['file']} is missing") from None
        if "bytes" in ref and size != ref["bytes"]:
            raise CheckpointIncomplete(f"checkpoint {Path(directory) / STATE_NAME}: job file "
                                       f"{ref['file']} is {size} bytes, written {ref['bytes']}")


def load_checkpoint(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """A state.pt whose job files are all there (verify); job states stay in their files
    (`resolve_job` reads one)."""
    state = load_state(path, mmap=mmap)
    verify(Path(path).parent, state)
    return state


def resolve_job(directory: str | Path, entry: dict[str, Any]) -> dict[str, Any]:
    """A job's full state from its state.pt entry: read from its file, or inline (older format)."""
    if "file" not in entry:
        return entry
    try:
        return load_state(Path(directory) / entry["file"])
    except Exception as exc:  # a cut or damaged file: the checkpoint is unusable
        raise CheckpointIncomplete(f"job file {entry['file']} cannot be read: {exc}") from exc

