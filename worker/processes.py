"""Executor processes of this node: each leads its own session (a signal reaches its children),
and an adopted pid counts as ours only while its command line names its folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

# Touched every tick while the executor runs: an executor whose daemon is gone for good
# (node timed out, task moved elsewhere) sees it go stale and stops instead of reporting on.
LEASE_NAME = "lease"
REPO_ROOT = Path(__file__).resolve().parents[1]


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



# cuBLAS's fixed workspaces (4 MiB x 8), set in every GPU process a node starts: what a repeatable
# decode needs (trainer.sampling.repeatable) and must be there before a process's first cuBLAS call
CUBLAS_WORKSPACE = ":4096:8"


def node_caches(cache_dir: Path) -> dict[str, str]:
    """What every executor of a node keeps across processes, under the daemon's work directory
    (an operator's own setting wins): Triton's compiled kernels (a new process loads them, it does
    not compile them again) and the stored memory models (trainer.admission's profile cache)."""
    return {"TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR") or str(cache_dir / "triton"),
            "LORAPLEX_PROFILE_CACHE": os.environ.get("LORAPLEX_PROFILE_CACHE")
            or str(cache_dir / "memory_profiles.json")}


def spawn(module: str, flag: str, directory: Path, gpu_indices: list[int], log_name: str,
          extra: Sequence[str] = (), *, cuda: bool, cache_dir: Path | None = None) -> subprocess.Popen:
    """``python -m module flag directory *extra`` on these GPUs (cuda False: a CPU node's slots,
    no GPU visible), leading its own session, logging to directory/log_name; with cache_dir, the
    node's caches there (`node_caches`)."""
    env = dict(os.environ)
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        env.update(node_caches(cache_dir))
    gpus = ",".join(str(g) for g in gpu_indices)
    env["CUDA_VISIBLE_DEVICES"] = gpus if cuda else ""
    if cuda:  # samples repeat run to run (trainer.sampling.repeatable); an operator's value wins
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    env["LORAPLEX_SLOTS"] = gpus
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", module, flag, str(directory), *extra]
    with open(directory / log_name, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                cwd=directory)
