"""Adapter parallelism, the executor half: the distribution strategy of the one recipe
(trainer.executor) over P processes, one per GPU, the backbone FSDP2-sharded across them
(trainer.parallel_engine), each rank training its own disjoint set of the task's jobs, and the
launcher that spawns the ranks. Any objective (SFT, DPO) runs on it.

Launch: `run_parallel(cfg, nproc, callbacks, should_stop)` (what `trainer.executor.run_executor`
calls when the placement has more than one GPU) spawns P ranks (NCCL on CUDA, rank r on cuda:r;
gloo on CPU) and returns the jobs' final status. Only the calling process sees callbacks: rank 0
forwards them through a queue (in order, and file announcements only after the owning rank has
written the files, at the barrier that ends each executor step), so the daemon's one spool writer
stays in one process.

Lockstep: each executor step every rank runs one backbone forward + backward (a rank with no
runnable job an idle pass over one pad token), each evaluation the same number of forwards
(padded with idle forwards), and extra passes (DPO's reference log-probs) are agreed by an
all-reduce, so FSDP's all-gathers pair up. Backfill comes first: a rank whose job exited takes a
queued job at the next admission; only when nothing is left for it does it idle. An idle rank
does not slow the others (it joins the all-gathers they need anyway, with a 1-token pass: the
(b) rows at batch 1 of bench/results/adapter_parallel_h200x2.md run exactly that); shrinking the
placement would reshard the backbone onto fewer GPUs mid-task, impossible when the model needs
all P to fit, and worth it only if the scheduler had work for the freed GPU.

Checkpoints: each rank writes its jobs' states (and DPO reference numbers) as a part, rank 0
merges them into the one `state.pt` (with every job's owner), which the runner uploads as for
one GPU. Resume on the same P keeps every job on its rank; on another P (or from a one-GPU
state.pt) the jobs are dealt to the least-loaded ranks.
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.checkpoint import save_checkpoint
from trainer.executor import CALLBACK_KINDS, Callbacks, Executor, ExecutorConfig
from trainer.parallel_engine import shard_engine

log = logging.getLogger("loraplex.parallel")


class AdapterParallel:
    """One rank of an initialised process group (see the module docstring): callbacks fire on
    rank 0 only, after the barrier that ends each executor step."""

    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.real_cb: Any = None
        self.deferred: list[tuple[str, tuple]] = []

    def device(self, requested: str) -> torch.device:
        cuda = torch.cuda.is_available() and requested in ("auto", "cuda")
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def load_model(self, model_dir: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
        from transformers import AutoModelForCausalLM

        # every rank reads the checkpoint to host memory; FSDP keeps 1/P of it on the GPU
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)

    def prepare_engine(self, engine: Any, device: torch.device) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return shard_engine(engine, init_device_mesh(device.type, (self.world,)), device)

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def callbacks(self, real: Any) -> Callbacks:
        self.real_cb = real if self.rank == 0 else None
        return Callbacks(*(self._deferrer(k) for k in CALLBACK_KINDS))

    def _deferrer(self, kind: str) -> Callable[..., None]:
        def f(*args: Any) -> None:
            if self.real_cb is not None:
                self.deferred.append((kind, args))
        return f

    def flush(self) -> None:
        """Barrier, then rank 0 fires the callbacks collected since the last one (by then every
        owner has written the adapter files they announce)."""
        dist.barrier()
        pending, self.deferred = self.deferred, []
        for kind, args in pending:
            getattr(self.real_cb, kind)(*args)

    def collect_parts(self, out: Path, part: dict[str, Any]) -> list[dict[str, Any]] | None:
        path = out / f"state.rank{self.rank}.pt"
        save_checkpoint(path, part)
        dist.barrier()
        parts = None
        if self.rank == 0:
            parts = [torch.load(out / f"state.rank{r}.pt", map_location="cpu", weights_only=False)
                     for r in range(self.world)]
        dist.barrier()  # nobody rewrites its part before rank 0 has read it
        path.unlink()
        return parts


# ----- launching ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int, port: int) -> torch.device:
    """init_process_group on localhost (NCCL and cuda:rank on CUDA, gloo on CPU); the device."""
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        backend, device = "nccl", torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        backend, device = "gloo", torch.device("cpu")
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, **kw)
    return device


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
