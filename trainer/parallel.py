"""Adapter parallelism, the executor half: the distribution strategy of the one recipe
(trainer.executor) over P processes, one per GPU, the backbone FSDP2-sharded across them
(trainer.parallel_engine), each rank training its own disjoint set of the task's jobs, and the
process group's setup. Any objective (SFT, DPO) runs on it. trainer.launch.run_parallel spawns
the ranks; callbacks fire on rank 0, after the barrier that ends each executor step.

Lockstep: each executor step every rank runs one backbone forward + backward (a rank with no
runnable job an idle pass over one pad token), each evaluation the same number of forwards
(padded with idle forwards), and extra passes (DPO's reference log-probs) are agreed by an
all-reduce, so FSDP's all-gathers pair up. Backfill comes first: a rank whose job exited takes a
queued job at the next admission; only when nothing is left for it does it idle. An idle rank
does not slow the others (it joins the all-gathers they need anyway, with a 1-token pass: the
(b) rows at batch 1 of bench/results/adapter_parallel_h200x2.md run exactly that); shrinking the
placement would reshard the backbone onto fewer GPUs mid-task, impossible when the model needs
all P to fit, and worth it only if the scheduler had work for the freed GPU.

Checkpoints: each rank writes its jobs' states (those that trained since the last checkpoint;
DPO reference numbers) as a part, rank 0 writes their job files and the one `state.pt` naming
them (with every job's owner), which the runner uploads as for one GPU. Resume on the same P keeps every job on its rank; on another P (or from a one-GPU
state.pt) the jobs are dealt to the least-loaded ranks.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.checkpoint import FileWriter
from trainer.checkpoint_files import save_checkpoint
from trainer.config import CALLBACK_KINDS, Callbacks
from trainer.parallel_engine import shard_engine

log = logging.getLogger("loraplex.parallel")


class AdapterParallel:
    """One rank of an initialised process group (see the module docstring): callbacks fire on
    rank 0 only, after the barrier that ends each executor step."""

    whole_engine = False  # each rank holds 1/P of the backbone
    hosts_many_tasks = False  # one task: every rank must decide alike, so a failure is everyone's

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

    def file_writer(self, async_writes: bool, buffer_bytes: float) -> FileWriter | None:
        return None  # the ranks write their parts in the loop, at the same step

    def contain(self, work: Callable[[], Any], on_error: Callable[[Exception], None]) -> Any:
        return work()  # ranks must decide alike: an exception ends the task on every rank


# ----- the process group ------------------------------------------------------------------------
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
