"""Resumable checkpoints of the engine's jobs: adapter weights, AdamW state, LR schedule, data
position, step counts (plus whatever the executor adds; the files: trainer.checkpoint_files); and
the executor's file writing off its step loop: a snapshot at the step boundary (`take_snapshot`)
written by one writer thread (`FileWriter`)."""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from contract.background import BackgroundWorker
from trainer.engine import MultiLoraEngine
from trainer.host_pool import POOL
from trainer.jobs import LEGACY_FIELDS, JobRun, TrainJob

log = logging.getLogger("loraplex.executor")


def job_state_dict(state: JobRun, copy: bool = True) -> dict[str, Any]:
    """Everything needed to continue one job exactly where it stopped (tensors copied to CPU;
    copy=False: the job's live tensors and containers, for `take_snapshot`)."""
    state.settle()  # a parked job's host copies are complete before anything reads them
    live = {
        "spec": asdict(state.spec),
        "adapter": dict(state.adapter.state_dict()),
        "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(),
        "stream": state.stream.state_dict(),
        "step": state.step,
        "skipped_steps": state.skipped_steps,
        "last_loss": state.last_loss,
        "total_steps": state.total_steps,
    }
    return take_snapshot(live).wait() if copy else live


def spec_from_dict(d: dict[str, Any]) -> TrainJob:
    known = {f.name for f in fields(TrainJob)}
    d = {name: v for k, v in d.items() if (name := LEGACY_FIELDS.get(k, k)) in known}
    d["betas"] = tuple(d.get("betas", (0.9, 0.999)))
    return TrainJob(**d)


def restore_job(engine: MultiLoraEngine, d: dict[str, Any]) -> JobRun:
    """Rebuild a job's state on the engine's device from `job_state_dict` output (not attached)."""
    spec = spec_from_dict(d["spec"])
    # the saved weights replace any init: do not read the starting adapter (gone, maybe) again
    state = engine.new_job(replace(spec, init_adapter=None))
    state.spec = spec
    state.adapter.load_state_dict(d["adapter"])
    state.optimizer.load_state_dict(d["optimizer"])
    state.scheduler.load_state_dict(d["scheduler"])
    state.stream.load_state_dict(d["stream"])
    state.step = d["step"]
    state.skipped_steps = d["skipped_steps"]
    state.last_loss = d["last_loss"]
    state.total_steps = d["total_steps"]
    return state


def rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----- snapshots and the writer thread --------------------------------------------------------
def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in obj (dicts, lists and tuples walked)."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


@dataclass
class Snapshot:
    """A copy of some state as it was at one step boundary; `wait` returns it once the copies
    from the GPU (queued on the stream before any later update) have landed."""

    value: Any
    events: list[Any]

    def wait(self) -> Any:
        for event in self.events:
            event.synchronize()
        return self.value


def take_snapshot(obj: Any) -> Snapshot:
    """obj as it is now, safe from the in-place updates of later steps: every tensor copied to
    host memory (a GPU tensor into pinned memory, non_blocking: one event per device to wait
    on, no sync here), dicts, lists and tuples rebuilt, any other value deep-copied (the
    executor's status dicts and monitors change as it trains)."""
    devices: dict[torch.device, None] = {}

    def snap(x: Any) -> Any:
        if torch.is_tensor(x):
            x = x.detach()
            if x.device.type != "cuda":
                return x.clone()
            # pinned ahead of time where the pool has room (trainer.host_pool), else pinned now
            out = POOL.take(x.shape, x.dtype)
            if out is None:
                out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            out.copy_(x, non_blocking=True)
            devices[x.device] = None
            return out
        if isinstance(x, dict):
            out = copy.copy(x)  # its own type (OrderedDict, defaultdict) and attributes
            for k, v in x.items():
                out[k] = snap(v)
            return out
        if type(x) is list:
            return [snap(v) for v in x]
        if type(x) is tuple:
            return tuple(snap(v) for v in x)
        return copy.deepcopy(x)

    value = snap(obj)
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return Snapshot(value, events)


@dataclass(eq=False)
class Write:
    """One queued write of a snapshot: done once its files are complete (or it failed)."""

    task_id: str
    kind: str  # "checkpoint" | "export"
    nbytes: int
    work: Callable[[], None] | None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class FileWriter:
    """An executor's one writer thread: writes run one at a time in the order submitted, each
    writing its files under a temp name then renaming them. The snapshots waiting to be written
    hold at most max_pending_bytes of tensors (one always may): `room` makes the step loop wait
    for the writer rather than pile up snapshots. `busy` counts the writer's seconds by kind.
    The thread is a BackgroundWorker whose step runs the next queued write (woken by a submit);
    a daemon thread: a crashed executor's process still exits (state.pt stays the last complete
    one: the write in flight was to the temp name)."""

    def __init__(self, max_pending_bytes: float = 4 * 2**30) -> None:
        self.max_pending_bytes = max_pending_bytes
        self.busy: dict[str, float] = {"checkpoint": 0.0, "export": 0.0}
        self._queue: deque[Write] = deque()
        self._pending_bytes = 0
        self._cv = threading.Condition()
        self._closing = False  # close(): the step ends the loop once the queue is empty
        self._wake = threading.Event()
        # every_s: a look at the queue now and then besides the wakes (a submit, close, stop)
        self._worker = BackgroundWorker("loraplex-writer", self._write_next, every_s=60.0,
                                        wake=self._wake, logger=log)

    def room(self, nbytes: int) -> None:
        """Wait until a snapshot of nbytes may join the queue."""
        with self._cv:
            while self._queue and self._pending_bytes + nbytes > self.max_pending_bytes:
                self._cv.wait()

    def submit(self, task_id: str, kind: str, nbytes: int, work: Callable[[], None]) -> Write:
        write = Write(task_id, kind, nbytes, work)
        with self._cv:
            self._queue.append(write)
            self._pending_bytes += nbytes
            self._cv.notify_all()
        self._worker.start()  # running: a no-op; closed (or never started): the thread starts
        self._wake.set()
        return write

    def close(self) -> None:
        """Finish every queued write, then stop the thread (a later submit starts another)."""
        with self._cv:
            self._closing = True
        self._wake.set()
        self._worker.join()
        with self._cv:
            self._closing = False

    def _write_next(self) -> bool:
        """The worker's step: the queue's first write, run; True while more may be queued."""
        with self._cv:
            if not self._queue:
                if self._closing:
                    self._worker.stop()  # from inside the step: the loop ends after it
                return False
            write = self._queue[0]
        started = time.perf_counter()
        try:
            write.work()
        except BaseException as exc:  # noqa: BLE001 - the write's task fails, at the loop
            write.error = exc
        with self._cv:
            self._queue.popleft()
            self._pending_bytes -= write.nbytes
            self.busy[write.kind] = self.busy.get(write.kind, 0.0) + time.perf_counter() - started
            write.work = None  # the snapshot's memory goes now
            self._cv.notify_all()
        write.done.set()
        return True
