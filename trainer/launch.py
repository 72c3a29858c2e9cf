"""Launching an executor: `run_executor` runs one task with the strategy its placement asks for
(this process on one GPU, or `cfg.world_size` spawned ranks with the backbone FSDP2-sharded:
trainer.parallel.AdapterParallel), and `python -m trainer.launch config.json [--nproc P]` runs
one from a JSON file, printing callbacks as JSON lines.

Adapter parallelism: `run_parallel` spawns P ranks (NCCL on CUDA, rank r on cuda:r; gloo on
CPU). Only the calling process sees callbacks: rank 0 forwards them through a queue (in order,
after the barrier that ends each executor step), so the daemon's one spool writer stays in one
process. SIGTERM is the launcher's to turn into a checkpoint-and-stop of every rank.
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from contract.protocol import EarlyExitSettings, EvalSettings, TaskSettings
from trainer.checkpoint import spec_from_dict
from trainer.config import CALLBACK_KINDS, Callbacks, ExecutorConfig
from trainer.executor import Executor
from trainer.parallel import AdapterParallel, free_port, init_rank


class _QueueCallbacks:
    """Rank 0's real callbacks: each one a message to the launching process."""

    def __init__(self, q: Any) -> None:
        self.q = q
        for kind in CALLBACK_KINDS:
            setattr(self, kind, self._make(kind))

    def _make(self, kind: str) -> Callable[..., None]:
        def f(*args: Any) -> None:
            self.q.put(("cb", kind, args))
        return f


def _rank_main(rank: int, world: int, port: int, cfg: ExecutorConfig, q: Any, stop: Any) -> None:
    logging.basicConfig(level=os.environ.get("LORAPLEX_LOG_LEVEL", "INFO").upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s rank={rank} %(message)s")
    # The daemon signals the executor's whole process group: SIGTERM is the launching process's
    # to turn into a checkpoint-and-stop of every rank at the same step (a rank that died on it
    # would leave the others hanging in a collective). SIGINT (Ctrl-C, or the launcher's death,
    # which torch's spawn turns into SIGINT) and a changed parent stop the ranks the same way.
    interrupted = threading.Event()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    parent = os.getppid()
    init_rank(rank, world, port)
    try:
        cb = _QueueCallbacks(q) if rank == 0 else None

        def stop_requested() -> bool:
            return stop.is_set() or interrupted.is_set() or os.getppid() != parent

        status = Executor(cfg, cb, AdapterParallel(), stop_requested=stop_requested).run()
        if rank == 0:
            q.put(("done", status))
    finally:
        dist.destroy_process_group()


def run_parallel(cfg: ExecutorConfig, nproc: int, callbacks: Callbacks | None = None,
                 should_stop: Callable[[], bool] | None = None) -> dict[str, dict[str, Any]]:
    """Train the task on `nproc` ranks of this machine (GPUs 0..nproc-1 of CUDA_VISIBLE_DEVICES)
    and return the jobs' status. Callbacks run here, in this process, in order. When a callback
    raises (e.g. a stop asked from inside one) or should_stop() turns true, every rank checkpoints and
    stops at the end of its current step; the callback's exception is then re-raised here."""
    import torch.multiprocessing as mp

    if nproc < 1:
        raise ValueError("nproc must be >= 1")
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        raise ValueError(f"{nproc} ranks asked for, {torch.cuda.device_count()} GPUs visible")
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    procs = mp.start_processes(_rank_main, args=(nproc, free_port(), cfg, q, stop), nprocs=nproc,
                               join=False, start_method="spawn")
    status: dict[str, dict[str, Any]] | None = None
    error: BaseException | None = None

    def drain(timeout: float) -> None:
        nonlocal status, error
        while True:
            try:
                msg = q.get(timeout=timeout)
            except queue_mod.Empty:
                return
            timeout = 0.0
            if msg[0] == "done":
                status = msg[1]
                continue
            _, kind, args = msg
            if error is None and callbacks is not None:
                try:
                    getattr(callbacks, kind)(*args)
                except BaseException as exc:  # noqa: BLE001 - re-raised once the ranks have stopped
                    error = exc
                    stop.set()

    while True:
        drain(0.2)
        if should_stop is not None and should_stop():
            stop.set()
        if procs.join(timeout=0.05):
            break
    drain(0.0)
    if error is not None:
        raise error
    if status is None:
        raise RuntimeError("adapter-parallel executor ended without a status")
    return status


def run_executor(cfg: ExecutorConfig, callbacks: Callbacks | None = None,
                 should_stop: Callable[[], bool] | None = None) -> dict[str, dict[str, Any]]:
    """Run one task with the strategy its placement asks for: this process on one GPU, or
    `cfg.world_size` ranks (one process per GPU) with the backbone sharded (adapter parallelism).
    Returns every job's final status; when should_stop() turns true, every rank checkpoints at
    the end of its step and returns (`Executor.stopped`)."""
    if cfg.world_size > 1:
        return run_parallel(cfg, cfg.world_size, callbacks, should_stop)
    return Executor(cfg, callbacks, stop_requested=should_stop).run()


def main(argv: list[str] | None = None) -> None:
    """`python -m trainer.launch config.json [--nproc P]`: run one task on this machine,
    printing callbacks as JSON lines."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(description="Run one task's jobs on this machine.")
    parser.add_argument("config", help="JSON file with ExecutorConfig fields; jobs as a list of "
                        "TrainJob dicts, settings as contract.protocol.TaskSettings")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (GPUs); default world_size")
    args = parser.parse_args(argv)
    raw = json.loads(Path(args.config).read_text())
    raw["jobs"] = [spec_from_dict(j) for j in raw["jobs"]]
    if "settings" in raw:  # nested by hand: the plain contract (no pydantic) does not parse
        settings = dict(raw["settings"])
        for name, kind in (("early_exit", EarlyExitSettings), ("eval", EvalSettings)):
            if name in settings:
                settings[name] = kind(**settings[name])
        raw["settings"] = TaskSettings(**settings)
    if args.nproc is not None:
        raw["world_size"] = args.nproc

    def emit(kind: str) -> Callable[..., None]:
        def f(*args: Any) -> None:
            print(json.dumps({"kind": kind, "data": [str(r) if isinstance(r, Path) else r for r in args]},
                             default=str))
            sys.stdout.flush()
        return f

    cb = Callbacks(*(emit(k.removeprefix("on_")) for k in CALLBACK_KINDS))
    status = run_executor(ExecutorConfig(**raw), cb)
    print(json.dumps({"kind": "done", "status": status}))


if __name__ == "__main__":
    main()
