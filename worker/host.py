"""A shared executor process (co-location, docs/architecture.md): ``python -m worker.host --host-dir DIR``
serves one base model on one GPU set and hosts every placement the daemon attaches to it whose
task has the same colocation_key; each placement reports through its own folder exactly as
worker.runner does (spool, artifacts, resume, terminal record: worker.runner.PlacementRun).

The daemon talks to it through DIR:
  inbox/<n>.json  requests, each written atomically (tmp + rename) and taken in name order:
                  {"op": "attach", "placement_dir": ...}: the first builds the executor (its
                  spec is the executor's settings), later ones join it at a step boundary;
                  {"op": "detach", "placement_id": ..., "outcome": "cancelled" | "paused",
                   "reason": why (a paused task's stop record)};
                  {"op": "sample", "dir": ...}: a sample request answered on the idle engine
  lease           touched by the daemon every tick; stale (LORAPLEX_LEASE_TIMEOUT_S): as SIGTERM
  status.json     written here atomically: hosted, ended and refused placements, the admission
                  budget in rows and the rows free (the daemon's heartbeat reports them)
--spare: started by the daemon on a free GPU ahead of any placement (worker.shared_hosts); it
warms up (imports, CUDA context) and waits, state "spare", until the daemon gives it a task.
SIGTERM: every hosted task checkpoints at its step boundary and stops (a retryable "executor
stopped"), and the executor takes no new task. With no task left it lingers
LORAPLEX_EXECUTOR_LINGER_S (60) warm, for a next task of the same model, then exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

from contract.background import BackgroundWorker, Backoff
from contract.protocol import PlacementSpec, colocation_key
from contract.states import TaskOutcome
from worker import sampler
from worker.runner import PlacementRun, StopFlag, open_task, settle


class HostState(StrEnum):
    """A shared executor process's state (its status()["state"]): a spare (started ahead of any
    placement, warmed up: its first attach gives it its model), loading the model, serving tasks,
    stopping (no new task), closed."""

    SPARE = "spare"
    LOADING = "loading"
    SERVING = "serving"
    STOPPING = "stopping"
    CLOSED = "closed"


log = logging.getLogger("loraplex.worker.host")
INBOX_NAME = "inbox"
STATUS_NAME = "status.json"
# a CPU executor's budget is unbounded (no memory model); the report says "plenty", not 2**50
ROWS_CAP = 1 << 20
# what a first task's executor imports when it builds its model (transformers loads these lazily:
# about 6 s of a fresh process on the H200, session 20), imported by a spare while it waits and by
# the node's zygote (worker.zygote) before it forks any executor
WARM_MODULES = ("transformers.modeling_utils", "transformers.integrations.tensor_parallel",
                "transformers.masking_utils", "transformers.generation.utils",
                "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
                "trainer.sampling", "worker.runner", "worker.sampler")


def warm_imports() -> None:
    """The executor's imports (torch, transformers' model-building modules, the engine and its
    kernels) and Triton's one-time key (kernels.triton_warm), none of which touches CUDA."""
    import importlib

    _executor_class()
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # another transformers version: what is not there is not needed
            log.debug("warm-up module missing name=%s", name)
    from kernels import triton_warm

    triton_warm.compute()  # every executor forked from here (or run here) starts with it


def warm_up() -> float:
    """A spare's head start on its first task, in seconds: `warm_imports` and, on a GPU, the CUDA
    context and a cuBLAS handle, so that the first placement pays only its model's load."""
    started = time.perf_counter()
    import torch

    warm_imports()
    if torch.cuda.is_available():
        x = torch.ones(64, 64, device="cuda")
        (x @ x).sum().item()  # the context, a cuBLAS handle and a first sync
    return time.perf_counter() - started


def spec_key(spec: PlacementSpec) -> str:
    return colocation_key(spec.base_model, spec.method, spec.settings.max_seq_len,
                          spec.settings.target_modules)


def write_json(path: Path, data: dict) -> None:
    """Atomically: a reader sees the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def send(directory: Path, request: dict) -> Path:
    """The daemon's side of the inbox: one request file, named after the clock so requests are
    taken in the order they were sent."""
    inbox = directory / INBOX_NAME
    inbox.mkdir(parents=True, exist_ok=True)
    stamp = time.time_ns()
    while (path := inbox / f"{stamp:020d}.json").exists():
        stamp += 1
    write_json(path, request)
    return path


def read_status(directory: Path) -> dict:
    try:
        data = json.loads((directory / STATUS_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class Host:
    """The process's state: the executor, one PlacementRun per attached placement, and the
    control thread that takes the daemon's requests and writes status.json."""

    def __init__(self, directory: Path, lease_timeout_s: float, linger_s: float,
                 poll_s: float = 0.2, make_executor: Callable[..., Any] | None = None,
                 spare: bool = False) -> None:
        self.directory = directory.resolve()
        self.lease_timeout_s, self.linger_s, self.poll_s = lease_timeout_s, linger_s, poll_s
        self.stop = StopFlag(self.directory, lease_timeout_s)  # SIGTERM or a stale host lease
        self.make_executor = make_executor
        self.executor: Any = None
        self.key: str | None = None
        self.gpu_indices: list[int] = []
        self.runs: dict[str, PlacementRun] = {}
        self.bridges: dict[str, Any] = {}
        self.reasons: dict[str, str] = {}  # why a detached task paused
        self.accepted: list[str] = []
        self.ended: dict[str, str] = {}  # placement -> outcome (its terminal record is written)
        self.refused: dict[str, str] = {}  # placement -> why it never joined (it may go elsewhere)
        self.state = HostState.SPARE if spare else HostState.LOADING
        self.warm_s: float | None = None  # a spare's warm-up, in its status
        self._lock = threading.RLock()

    # -- the process ------------------------------------------------------------------------
    def serve(self) -> int:
        """Build the executor from the first request, serve until it has lingered idle, been
        stopped, or failed; every placement accepted gets its terminal record. A spare warms up
        first and then waits for its first request as long as the daemon's lease stays fresh."""
        self.write_status()
        deadline = time.monotonic() + 60  # the daemon writes the first request before the start
        if self.state == HostState.SPARE:
            self.warm_s = warm_up()
            log.info("spare executor warm seconds=%.2f", self.warm_s)
            self.write_status()
            deadline = float("inf")
        while not self.stop() and time.monotonic() < deadline:
            if self.take_requests(first=True):
                break  # the first placement built the executor, or failed alone
            time.sleep(self.poll_s)
        if self.executor is None:
            return self._close(0)
        # a crashed control step is restarted, so stop requests are still applied
        control = BackgroundWorker("host-control", self._control, every_s=self.poll_s,
                                   wait_first=True, logger=log,
                                   backoff=Backoff(self.poll_s, 30.0)).start()
        code = 0
        try:
            self.executor.serve(self.linger_s)
        except BaseException as exc:  # noqa: BLE001 - the executor itself failed: every task ends
            log.exception("shared executor failed key=%s placements=%s", self.key,
                          ",".join(self.hosted()) or "-")
            for placement_id in self.hosted():
                self._end_run(placement_id, TaskOutcome.FAILED, exc)
            code = 1
        control.stop(timeout=10)
        return self._close(code)

    def _close(self, code: int) -> int:
        with self._lock:
            self.state = HostState.CLOSED
            self.take_requests()  # attach requests that came too late are refused
            self.write_status()
        log.info("shared executor exited key=%s code=%d ended=%s", self.key, code,
                 json.dumps(self.ended))
        return code

    def _control(self) -> None:
        if self.stop() and self.state != HostState.STOPPING:
            self.state = HostState.STOPPING
            log.info("shared executor stopping key=%s why=%s placements=%s", self.key,
                     self.stop.reason, ",".join(self.hosted()) or "-")
            for placement_id in self.hosted():
                self.runs[placement_id].stop.set(self.stop.reason)
            self.executor.close()
        self.take_requests()
        self.write_status()

    # -- requests -------------------------------------------------------------------------
    def take_requests(self, first: bool = False) -> bool:
        """Apply the inbox's requests in order (first: stop after the one that built the
        executor); whether any was taken."""
        inbox = self.directory / INBOX_NAME
        try:
            names = sorted(p for p in inbox.iterdir() if p.suffix == ".json"
                           and not p.name.startswith("."))
        except FileNotFoundError:
            return False
        for path in names:
            try:
                request = json.loads(path.read_text())
            except (OSError, ValueError):
                request = {}
            with self._lock:
                if request.get("op") == "attach":
                    self.attach(Path(str(request.get("placement_dir"))))
                elif request.get("op") == "sample":
                    self.sample(Path(str(request.get("dir"))))
                elif request.get("op") == "detach":
                    self.detach(str(request.get("placement_id")), str(request.get("outcome")),
                                str(request.get("reason") or "paused by the service"))
                else:
                    log.warning("host request ignored path=%s", path.name)
                path.unlink(missing_ok=True)
                self.write_status()
            if first:
                break
        return bool(names)

    def attach(self, directory: Path) -> None:
        """One placement joins: its task attaches to the executor (the first one builds it)."""
        placement_id = directory.name
        if self.state in (HostState.STOPPING, HostState.CLOSED):
            self.refused[placement_id] = f"the shared executor is {self.state}"
            return
        try:
            run = PlacementRun(directory, self.lease_timeout_s)
        except (OSError, ValueError) as exc:
            self.refused[placement_id] = f"unreadable placement: {type(exc).__name__}"
            return
        placement_id, spec = run.spec.placement_id, run.spec
        key = spec_key(spec)
        if self.key is not None and (key != self.key or spec.gpu_indices != self.gpu_indices):
            self.refused[placement_id] = f"another model or GPU set: {key} {spec.gpu_indices}"
            run.spool.close()
            return
        try:
            cfg, callbacks, bridge = open_task(
                spec, run.directory, run.reporter,
                on_task_end=lambda outcome, details, p=placement_id: self.task_end(p, outcome))
        except Exception as exc:  # noqa: BLE001 - the placement's own input: it alone fails
            log.exception("placement failed to open placement=%s", placement_id)
            run.failed(exc)
            run.spool.close()
            self.accepted.append(placement_id)
            self.ended[placement_id] = TaskOutcome.FAILED
            return
        if self.executor is None:
            self.state = HostState.LOADING  # a spare no more: its model loads now
            make = self.make_executor or _executor_class()
            self.executor = make(cfg, callbacks, stop_requested=run.stop, task_id=placement_id)
            self.key, self.gpu_indices = key, list(spec.gpu_indices)
        else:
            try:
                self.executor.attach_task(cfg, callbacks, run.stop, task_id=placement_id)
            except ValueError as exc:  # it cannot share (the executor closing, other settings)
                self.refused[placement_id] = str(exc)
                run.spool.close()
                return
        self.runs[placement_id], self.bridges[placement_id] = run, bridge
        self.accepted.append(placement_id)
        log.info("placement attached task=%s placement=%s key=%s hosted=%d", spec.task_id,
                 placement_id, key, len(self.hosted()))

    def detach(self, placement_id: str, outcome: str, reason: str) -> None:
        """Outcome "paused": it checkpoints and stops (the reason goes in its stop record);
        "cancelled": its unfinished jobs end cancelled, with no terminal record."""
        if placement_id not in self.runs or placement_id in self.ended:
            return  # never joined, or gone already: nothing runs
        paused = outcome == TaskOutcome.PAUSED
        if paused:
            self.reasons[placement_id] = reason
        self.executor.detach_task(placement_id,
                                  TaskOutcome.PAUSED if paused else TaskOutcome.CANCELLED)
        log.info("placement detaching placement=%s outcome=%s", placement_id, outcome)

    def sample(self, directory: Path) -> None:
        """Answer a sample request (worker.sampler) with this executor's engine, only while it
        lingers with no task: the executor's loop waits for work and no attach is taken meanwhile
        (this thread takes them). Else its result says it refused, and the request goes back."""
        engine = getattr(self.executor, "engine", None)
        if (self.hosted() or getattr(self.executor, "tasks", None) or engine is None
                or getattr(engine, "jobs", None) or self.state in (HostState.STOPPING, HostState.CLOSED)):
            sampler.write_result(directory, {"refused": "the warm executor was busy"})
            return
        result = sampler.run(directory, engine, self.executor.tokenizer)
        log.info("sample request answered dir=%s rows=%d", directory.name,
                 len(result.get("samples") or ()))

    # -- a task's end (the executor's thread) ---------------------------------------------
    def task_end(self, placement_id: str, outcome: str) -> None:
        task = self.executor.ended.get(placement_id)
        self._end_run(placement_id, outcome, getattr(task, "error", None),
                      getattr(task, "status", {}))

    def _end_run(self, placement_id: str, outcome: str, error: BaseException | None,
                 status: dict | None = None) -> None:
        """The placement's terminal record, as worker.runner writes it: succeeded -> finished,
        paused -> a retryable "executor stopped", failed -> failed; cancelled -> none (the
        service stopped it and takes no more reports)."""
        run, bridge = self.runs[placement_id], self.bridges[placement_id]
        try:
            if outcome == TaskOutcome.SUCCEEDED:
                run.finished(settle(bridge, status or {}, stopped=False))
            elif outcome == TaskOutcome.PAUSED:
                settle(bridge, status or {}, stopped=True)
                run.stopped(run.stop.reason or self.reasons.get(placement_id, "requested"))
            elif outcome == TaskOutcome.FAILED:
                run.failed(error or RuntimeError("the task failed"))
        finally:
            run.spool.close()
            with self._lock:
                self.ended[placement_id] = outcome
                self.write_status()
            log.info("placement left the shared executor task=%s placement=%s outcome=%s",
                     run.spec.task_id, placement_id, outcome)

    # -- status -------------------------------------------------------------------------------
    def hosted(self) -> list[str]:
        with self._lock:
            return [p for p in self.accepted if p in self.runs and p not in self.ended]

    def write_status(self) -> None:
        capacity = {"total_rows": 0, "free_rows": 0, "queued_jobs": 0}
        if self.executor is not None and hasattr(self.executor, "capacity"):
            capacity = self.executor.capacity()
        state = self.state
        if state == HostState.LOADING and capacity["total_rows"] > 0:
            state = self.state = HostState.SERVING
        with self._lock:
            write_json(self.directory / STATUS_NAME, {
                "pid": os.getpid(), "key": self.key, "gpu_indices": self.gpu_indices,
                "state": state, "accepted": list(self.accepted), "hosted": self.hosted(),
                "ended": dict(self.ended), "refused": dict(self.refused),
                "total_rows": min(ROWS_CAP, capacity["total_rows"]),
                "free_rows": min(ROWS_CAP, capacity["free_rows"]),
                "queued_jobs": capacity["queued_jobs"], "warm_s": self.warm_s,
                "updated_at": time.time()})


def _executor_class() -> Callable[..., Any]:
    from trainer.executor import Executor

    return Executor


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.host", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host-dir", type=Path, required=True)
    ap.add_argument("--lease-timeout-s", type=float,
                    default=float(os.environ.get("LORAPLEX_LEASE_TIMEOUT_S", "120")))
    ap.add_argument("--linger-s", type=float,
                    default=float(os.environ.get("LORAPLEX_EXECUTOR_LINGER_S", "60")))
    ap.add_argument("--spare", action="store_true",
                    help="start ahead of any placement: warm up, then wait for the first attach")
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("LORAPLEX_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    host = Host(args.host_dir, args.lease_timeout_s, args.linger_s, spare=args.spare)
    signal.signal(signal.SIGTERM, lambda s, f: host.stop.set("SIGTERM"))
    return host.serve()


if __name__ == "__main__":
    sys.exit(main())
