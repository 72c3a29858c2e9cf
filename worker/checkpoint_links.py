"""A task's checkpoint as a folder of files on this node: state.pt and the job files it names
(trainer.checkpoint_files), linked from one folder to another (the executor's output, an
artifact's folder, a resume) without copying bytes: every file of a checkpoint is immutable (the
executor replaces state.pt and writes each job file once), so a hard link is a snapshot."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

STATE_NAME = "state.pt"


def link_file(src: Path, dst: Path) -> None:
    """dst becomes src's content, atomically: a hard link, a copy across filesystems."""
    tmp = dst.with_name(f".{dst.name}.seed")  # a dot file: never uploaded as an artifact file
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except FileNotFoundError:
        raise
    except OSError:  # another filesystem, or links not allowed
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def named_files(state: Path) -> list[str]:
    """The job files a state.pt names (whether or not they are beside it)."""
    from trainer.checkpoint_files import job_refs, load_state

    return [ref["file"] for ref in job_refs(load_state(state, mmap=True))]


def checkpoint_step(state: Path) -> int:
    """The executor's global_step in a complete state.pt (every job file it names beside it,
    whole); raises for an incomplete or unreadable one."""
    from trainer.checkpoint_files import load_checkpoint

    return int(load_checkpoint(state, mmap=True)["global_step"])


def link_checkpoint(src: Path, dst: Path) -> list[str]:
    """Link src's state.pt and the job files it names into dst; the job files' names. state.pt
    is pinned first (the executor may replace it meanwhile: the files linked are the ones the
    pinned one names) and takes its name in dst last, once every file it names is there.
    FileNotFoundError: a file it names is gone (deleted by a newer checkpoint, or never there);
    trainer.checkpoint_files.CheckpointIncomplete: one is not whole."""
    dst.mkdir(parents=True, exist_ok=True)
    pinned = dst / f".{STATE_NAME}.pinned"
    link_file(src / STATE_NAME, pinned)
    try:
        names = named_files(pinned)
        for name in names:
            link_file(src / name, dst / name)
        os.replace(pinned, dst / STATE_NAME)
    finally:
        pinned.unlink(missing_ok=True)
    checkpoint_step(dst / STATE_NAME)  # every file there, whole
    return names
