"""Executor processes of this node: each leads its own session (a signal reaches its children),
forked by the node's zygote where it has one ready (worker.zygote) or execed, and an adopted pid
counts as ours only while its command line, or the zygote's note in its folder, names it."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from worker.zygote import MARKER_NAME, Zygote, read_exit, start_ticks, stat_fields

log = logging.getLogger("loraplex.worker.processes")
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


def _proc_fields(pid: int) -> tuple[bytes, list[str]] | None:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    fields = stat_fields(pid)
    return None if fields is None else (cmdline, fields)


def _noted(pid: int, fields: list[str], directory: Path) -> bool:
    """Whether the folder's note (a zygote's child) names pid and this process's start time."""
    try:
        note = json.loads((directory / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return note.get("pid") == pid and note.get("start") == start_ticks(fields)


def _running(pid: int, proc: tuple[bytes, list[str]] | None, directory: Path) -> bool:
    """Whether `_proc_fields(pid)` is our executor, running: not a zombie, and its command line
    names its folder, or (a zygote's child, whose command line is the zygote's) the folder's note
    names pid and its start time (not a recycled pid of something else)."""
    return (proc is not None and proc[1][0] != "Z"
            and (str(directory).encode() in proc[0] or _noted(pid, proc[1], directory)))


def alive(pid: int, directory: Path) -> bool:
    """Whether pid is still our executor (`_running`)."""
    return _running(pid, _proc_fields(pid), directory)


def exit_code_of(pid: int | None, directory: Path) -> int | str | None:
    """An executor's exit status when it is not our Popen child (adopted, or a zygote's child):
    None while it runs (or, a zygote's child, until the zygote has noted its end), the status its
    zygote noted, else "lost" (another daemon's child, or its zygote died before noting it)."""
    if pid is None:
        return "lost"
    proc = _proc_fields(pid)  # looked at before the note: a zygote notes a status before it reaps
    if _running(pid, proc, directory):
        return None
    code = read_exit(directory, pid)
    if code is None and proc is not None and proc[1][0] == "Z" and _noted(pid, proc[1], directory):
        return None  # ended, its zygote about to note it
    return "lost" if code is None else code


class ForkedProcess:
    """A zygote's child as its daemon holds it: Popen's pid, poll() (`exit_code_of`) and wait()."""

    def __init__(self, pid: int, directory: Path) -> None:
        self.pid, self.directory = pid, directory
        self.returncode: int | str | None = None

    def poll(self) -> int | str | None:
        if self.returncode is None:
            self.returncode = exit_code_of(self.pid, self.directory)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | str:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return code


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


def process_env(gpu_indices: Sequence[int], *, cuda: bool, cache_dir: Path | None = None) -> dict[str, str]:
    """The environment of a node's process on these GPUs (cuda False: a CPU node's slots, no GPU
    visible); with cache_dir, the node's caches there (`node_caches`)."""
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
    return env


def spawn(module: str, flag: str, directory: Path, gpu_indices: list[int], log_name: str,
          extra: Sequence[str] = (), *, cuda: bool, cache_dir: Path | None = None,
          zygote: Zygote | None = None) -> subprocess.Popen | ForkedProcess:
    """``python -m module flag directory *extra`` on these GPUs (`process_env`), leading its own
    session, logging to directory/log_name: forked by the node's zygote when it has one ready
    (worker.zygote: the imports already done), else a new interpreter."""
    env = process_env(gpu_indices, cuda=cuda, cache_dir=cache_dir)
    args = [flag, str(directory), *extra]
    if zygote is not None:
        pid = zygote.spawn(module, args, env, directory, directory / log_name)
        if pid is not None:
            return ForkedProcess(pid, directory)
    with open(directory / log_name, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", module, *args], env=env,
                                stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=directory)


class NodeZygote:
    """The daemon's zygote (worker.zygote), kept: started once the node knows whether it has GPUs
    (mode "auto": on a GPU node; "on", "off"), started again after it dies, with a growing pause
    after each death in a row (a broken environment does not start one every tick)."""

    def __init__(self, mode: str, work_dir: Path) -> None:
        self.mode, self.work_dir = mode, work_dir
        self.zygote: Zygote | None = None
        self.failures, self.after = 0, 0.0

    def tend(self, cuda: bool) -> None:
        if self.mode == "off" or (self.mode == "auto" and not cuda):
            return
        if self.zygote is not None:
            if self.zygote.alive():
                self.zygote.ready()
                return
            self.failures += 1
            self.after = time.monotonic() + min(600.0, 5.0 * 2 ** self.failures)
            log.warning("zygote died code=%s failures=%d", self.zygote.proc.poll(), self.failures)
            self.zygote = None
        if time.monotonic() >= self.after:
            env = process_env([], cuda=cuda, cache_dir=self.work_dir / "cache")
            self.zygote = Zygote(env, self.work_dir, self.work_dir / "zygote.log")
            log.info("zygote started pid=%d", self.zygote.proc.pid)

    def current(self) -> Zygote | None:
        """The zygote once it is ready to fork, else None (the caller execs)."""
        if self.zygote is not None and self.zygote.ready():
            self.failures = 0
            return self.zygote
        return None

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
