"""Executor processes of this node: each leads its own session (a signal reaches its children),
and an adopted pid counts as ours only while its command line names its folder."""

from __future__ import annotations

import os
import signal
from pathlib import Path

# Touched every tick while the executor runs: an executor whose daemon is gone for good
# (node timed out, task moved elsewhere) sees it go stale and stops instead of reporting on.
LEASE_NAME = "lease"


def kill_group(pid: int | None, sig: signal.Signals) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, sig)  # an executor leads its own session: its children go too
    except ProcessLookupError:
        pass


def touch(path: Path) -> None:
    try:
        os.utime(path)
    except FileNotFoundError:
        path.touch()


def alive(pid: int, directory: Path) -> bool:
    """Whether pid is still our executor (and not a recycled pid of something else)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":
        return False
    return str(directory).encode() in cmdline


def describe(code: int | str) -> str:
    if isinstance(code, str):
        return "its process gone (daemon restarted while it ran)"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def tail(path: Path, max_bytes: int = 4000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - max_bytes))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""

