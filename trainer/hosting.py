"""The tasks an executor hosts (`TaskRoster`, co-location): which tasks are on it and which have
left (with their outcomes), the attach and detach requests any thread makes and the loop takes at
a step boundary, waiting for work, each task's passage (opened, resumed, its parking reserved
after its first step, ended: last checkpoint or cancellation, samples, timings, its end
announced), and each task's own work guarded so that, where the strategy lets tasks fail alone,
a task's exception ends that task and nothing else.

A component of trainer.executor.Executor (`executor.roster`), split from it by meaning: the
executor is the device loop (load, admit, step, observe), the roster the set of tasks and their
lifecycle on it. What the roster uses of the executor is `RosterExecutor`: what a task uses
(trainer.task_parts.TaskExecutor, on which it builds each `TaskRun`) and the tokenizer, the step
count (a task resuming alone continues the executor's from its own), the task's timings and the
mark where they start."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from contract.protocol import tenant_safe
from contract.states import JOB_LIVE, JobState, TaskOutcome
from trainer.arena import park_room
from trainer.checkpoint_files import STATE_NAME, load_checkpoint
from trainer.colocate import TaskRun
from trainer.config import CALLBACK_KINDS, HOST_FIELDS, Callbacks, ExecutorConfig
from trainer.host_pool import POOL
from trainer.phase_clock import PhaseClock, collecting
from trainer.task_parts import JobSlot, TaskExecutor, fresh
from trainer.task_samples import task_samples, write_samples

log = logging.getLogger("loraplex.executor")


class RosterExecutor(TaskExecutor, Protocol):
    """What the roster uses of its executor (trainer.executor.Executor): what a task uses, and
    the few things of a task's passage that are the executor's own."""

    tokenizer: Any  # the model's tokenizer: a task's data, its samples
    global_step: int  # the executor's steps (a task resuming alone continues them)
    clock: PhaseClock  # its wall by phase: the samples add their parts

    def timings(self, task: TaskRun | None = None) -> dict[str, Any]: ...

    def mark_joined(self, task: TaskRun, at_start: bool) -> None: ...


@dataclass(frozen=True)
class Attach:
    """A request: host this task from the next step boundary."""

    task: TaskRun


@dataclass(frozen=True)
class Detach:
    """A request: take this task off at the next step boundary, cancelled or paused."""

    task_id: str
    outcome: str


class TaskRoster:
    """The tasks of one executor (see the module docstring). `tasks` (hosted, in attach order:
    admission order) and `ended` are the loop's; the requests may come from any thread."""

    def __init__(self, executor: RosterExecutor, cfg: ExecutorConfig) -> None:
        self.executor = executor  # what every TaskRun of this executor is built on
        self.cfg = cfg  # the executor's own (its first task's): a task's HOST_FIELDS must match it
        self.tasks: dict[str, TaskRun] = {}
        self.ended: dict[str, TaskRun] = {}  # tasks that left, with their outcome
        self._requests: list[Attach | Detach] = []  # for the next boundary
        # task id -> (job ids, output_dir) of every task hosted or asked to attach (any thread)
        self._known: dict[str, tuple[set[str], str]] = {}
        self._cv = threading.Condition()
        self.closing = False

    # ----- a task and its guarded work -------------------------------------------------------
    def make(self, cfg: ExecutorConfig, callbacks: Callbacks | None,
             stop_requested: Callable[[], bool] | None, task_id: str | None) -> TaskRun:
        """A task on this executor, its callbacks routed by the strategy and guarded."""
        holder: list[TaskRun] = []
        routed = self.executor.strategy.callbacks(callbacks or Callbacks())
        task = TaskRun(self.executor, cfg, self._guard(routed, holder), task_id or str(cfg.output_dir),
                       stop_requested)
        task.on_end = routed.on_task_end  # unguarded: reached even after the others failed
        holder.append(task)
        return task

    def _guard(self, cb: Callbacks, holder: list[TaskRun]) -> Callbacks:
        """The task's callbacks as the recipe calls them: where tasks fail alone (the strategy's
        `contain`), an exception in one ends its task at the next step boundary and the task
        reports nothing more."""

        def wrap(fn: Callable[..., None]) -> Callable[..., None]:
            def call(*args: Any) -> None:
                self.guarded(holder[0], lambda: fn(*args))
            return call
        return Callbacks(*(wrap(getattr(cb, k)) for k in CALLBACK_KINDS))

    def guarded(self, task: TaskRun, fn: Callable[[], Any]) -> Any:
        """Run a task's own work; where tasks fail alone, its exception fails that task alone
        (None then, and for a task that has failed already)."""
        if task.error is not None:
            return None

        def fail(exc: Exception) -> None:
            log.error("task=%s failed in its own work", task.task_id, exc_info=exc)
            task.error = exc

        return self.executor.strategy.contain(fn, fail)

    def each(self, work: Callable[[TaskRun], Any]) -> None:
        """`work` for every hosted task, each guarded."""
        for task in list(self.tasks.values()):
            self.guarded(task, lambda t=task: work(t))

    def slots(self) -> list[JobSlot]:
        """Every hosted task's started jobs."""
        return [s for t in self.tasks.values() for s in t.placed.values()]

    # ----- coming and going --------------------------------------------------------------------
    def add_first(self, task: TaskRun) -> None:
        """The executor's first task: hosted from the start (no request)."""
        with self._cv:
            self._known[task.task_id] = ({j.job_id for j in task.cfg.jobs}, str(Path(task.cfg.output_dir).resolve()))
        self.tasks[task.task_id] = task

    def request_attach(self, cfg: ExecutorConfig, callbacks: Callbacks | None = None,
                       stop_requested: Callable[[], bool] | None = None, task_id: str | None = None) -> str:
        """Ask to host another task (any thread; see Executor.attach_task); its id. ValueError
        when it cannot share this executor (another model or step setting, or an id in use)."""
        if not self.executor.strategy.hosts_many_tasks:
            raise ValueError("this executor's strategy hosts one task")
        for name in HOST_FIELDS:
            mine, theirs = getattr(self.cfg, name), getattr(cfg, name)
            if name == "model_dir":
                mine, theirs = str(Path(mine).resolve()), str(Path(theirs).resolve())
            if mine != theirs:
                raise ValueError(f"{name}: the task asks for {theirs!r}, this executor has {mine!r}")
        task = self.make(cfg, callbacks, stop_requested, task_id)
        jobs = {j.job_id for j in cfg.jobs}
        with self._cv:
            if self.closing:
                raise ValueError("the executor is closing")
            if task.task_id in self._known:
                raise ValueError(f"task {task.task_id} is already on this executor")
            taken = jobs & set().union(*(ids for ids, _ in self._known.values()))
            if taken:
                raise ValueError(f"job ids already on this executor: {sorted(taken)}")
            out = str(Path(cfg.output_dir).resolve())
            if out in {o for _, o in self._known.values()}:
                raise ValueError("output_dir is another hosted task's")
            self._known[task.task_id] = (jobs, out)
            self._requests.append(Attach(task))
            self._cv.notify_all()
        return task.task_id

    def request_detach(self, task_id: str, outcome: str) -> None:
        """Ask to take a task off (any thread; see Executor.detach_task)."""
        if outcome not in (TaskOutcome.CANCELLED, TaskOutcome.PAUSED):
            raise ValueError(f"outcome must be 'cancelled' or 'paused', not {outcome!r}")
        with self._cv:
            self._requests.append(Detach(task_id, outcome))
            self._cv.notify_all()

    def pending(self) -> list[Attach | Detach]:
        """The requests not yet taken (a snapshot)."""
        with self._cv:
            return list(self._requests)

    def close(self) -> None:
        """No new task: the loop ends once its tasks have ended."""
        with self._cv:
            self.closing = True
            self._cv.notify_all()

    def wait_for_work(self, linger_s: float) -> bool:
        """No job runs: wait up to linger_s for a request (until `close`); whether one came.
        When none came, the roster closes in the same breath, so no attach can slip in unseen."""
        deadline = time.monotonic() + linger_s
        with self._cv:
            while not self._requests and not self.closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, 1.0))
            if not self._requests:
                self.closing = True
            return bool(self._requests)

    # ----- a task's passage (the loop's thread) ----------------------------------------------
    def boundary(self) -> None:
        """Between steps: files written meanwhile are announced, failed tasks leave, then the
        attach / detach requests made since the last boundary take effect, in order."""
        for task in list(self.tasks.values()):
            task.files.settle()
            if task.error is not None:
                self.end(task, TaskOutcome.FAILED)
        with self._cv:
            requests, self._requests = self._requests, []
        for request in requests:
            if isinstance(request, Attach):
                task = request.task
                self.tasks[task.task_id] = task
                self.executor.mark_joined(task, at_start=False)
                self.guarded(task, lambda t=task: self.open(t))
                self.guarded(task, lambda t=task: self.start(t))
                if task.error is not None:
                    self.end(task, TaskOutcome.FAILED)
            elif request.task_id in self.tasks:
                task = self.tasks[request.task_id]
                task.stopped = request.outcome == TaskOutcome.PAUSED
                self.end(task, request.outcome)

    def open(self, task: TaskRun) -> None:
        """A task that joins a loaded executor: its data read, its part of the pool opened."""
        task.read(self.executor.tokenizer)
        task.open()

    def start(self, task: TaskRun) -> None:
        """Resume the task from its own state.pt if it has one; fail its jobs that never fit."""
        state_path = task.out / STATE_NAME
        if state_path.exists():
            alone = list(self.tasks) == [task.task_id] and self.executor.global_step == 0
            task.files.resume(load_checkpoint(state_path), restore_rng=alone)
            if alone:
                self.executor.global_step = task.global_step
        task.fail_unschedulable()

    def reserve_parking(self, task: TaskRun) -> None:
        """After the task's first step (trainer.host_pool): pin, in the background, host memory
        for the snapshots its writes take and, where configurations are queued (they need the
        room: trainer.warmup_hold.park), for the states they may park beyond what the device
        keeps (parks stay on the device while PARK_RESERVE of it stays free); within the pool's
        limit (PinnedPool.target_for), only on a GPU. With nothing queued a park stays on the
        device: pinning 36 GB beside an H200 search's steps slowed two of them by 3 s."""
        eng = self.executor.engine
        if eng.device.type != "cuda" or len(task.cfg.jobs) <= 1:
            return
        per_rank = eng.params_per_rank
        item = eng.adapter_dtype.itemsize
        queued = bool(fresh(task.queue))
        states = sum(3 * item * per_rank * j.lora_rank for j in task.cfg.jobs) if queued else 0  # weights + 2 moments
        free, total = torch.cuda.mem_get_info(eng.device)
        # and the snapshots of checkpoints and exports waiting for the writer thread
        POOL.reserve(POOL.target_for(states - max(0.0, park_room(free, total)), task.cfg.write_buffer_bytes),
                     largest=item * per_rank * max(j.lora_rank for j in task.cfg.jobs))  # one tensor of a park

    def end_idle(self) -> None:
        """A task with nothing placed and nothing queued is done; when nothing is placed at all,
        nothing queued can start either (admission just ran on an empty executor)."""
        running = bool(self.slots())
        for task in list(self.tasks.values()):
            if not running or (not task.placed and not task.queue):
                task.fail_stranded()
                self.end(task, TaskOutcome.SUCCEEDED)

    def end(self, task: TaskRun, outcome: str) -> None:
        """Take the task off the executor. Finished or paused: its last checkpoint first."""
        executor = self.executor
        if task.error is not None:
            outcome = TaskOutcome.FAILED
        if outcome in (TaskOutcome.SUCCEEDED, TaskOutcome.PAUSED):
            self.guarded(task, lambda: task.files.checkpoint(last=True))
        elif outcome == TaskOutcome.CANCELLED:
            for job_id, st in task.status.items():
                if st["state"] in JOB_LIVE:
                    self.guarded(task, lambda j=job_id: task.set_state(j, JobState.CANCELLED, {}))
        rows = None
        if outcome == TaskOutcome.SUCCEEDED and task.error is None:
            # the samples read the best adapters (a file, or the snapshot its write is writing:
            # trainer.task_files.pending_best), so they decode while the writer goes on with the
            # last exports and checkpoint; they are announced after every file of the task
            rows = self._samples(task)
        task.files.settle(wait=True)  # its files complete and announced first (a pause's checkpoint)
        if rows and task.error is None:
            self._announce_samples(task, rows)
        if outcome in (TaskOutcome.SUCCEEDED, TaskOutcome.PAUSED):  # the task's own, not the executor's
            self.guarded(task, lambda: task.cb.on_event("", "timings", executor.timings(task)))
        task.release()
        task.close()
        task.outcome = TaskOutcome.FAILED if task.error is not None else outcome
        self.tasks.pop(task.task_id, None)
        self.ended[task.task_id] = task
        with self._cv:
            self._known.pop(task.task_id, None)
        end = {"error": self.results()[task.task_id]["error"], "global_step": task.global_step}
        # the task has left: where tasks fail alone, its failing on_task_end ends nothing more
        executor.strategy.contain(lambda: task.on_end(task.outcome, end),
                              lambda exc: log.error("task=%s on_task_end failed", task.task_id, exc_info=exc))
        if executor.rank == 0:
            log.info("task=%s left the executor outcome=%s global_step=%d", task.task_id,
                     task.outcome, executor.global_step)

    def _samples(self, task: TaskRun) -> list[dict[str, Any]] | None:
        """The completions the task ends with (trainer.task_samples), from its leading adapters and
        the base model, before it lets go of the backbone. One GPU: an adapter-parallel task ends
        without them. A failure is the samples' alone: logged and announced, the task succeeds."""
        executor = self.executor
        if not executor.strategy.whole_engine or not task.cfg.settings.samples.enabled:
            return None
        from trainer.sampling import generate

        parts: dict[str, float] = {}  # the phase's split, reported in the timings (samples_part_*)
        try:
            with executor.phase("samples"), collecting(parts):
                return task_samples(task, executor.engine, executor.tokenizer, generate, parts)
        except Exception as exc:  # noqa: BLE001 - the training succeeded; its samples did not
            self._samples_failed(task, exc)
            return None
        finally:
            executor.clock.add_parts("samples", parts)

    def _announce_samples(self, task: TaskRun, rows: list[dict[str, Any]]) -> None:
        """The samples' file and event, once the task's other files are complete and announced."""
        try:
            write_samples(task.out, rows)
            task.cb.on_event("", "samples", {"samples": rows})
        except Exception as exc:  # noqa: BLE001 - as above: the samples' failure alone
            self._samples_failed(task, exc)

    @staticmethod
    def _samples_failed(task: TaskRun, exc: BaseException) -> None:
        log.error("task=%s samples failed", task.task_id, exc_info=exc)
        task.cb.on_event("", "samples_failed", {"error": tenant_safe(str(exc))})

    def results(self) -> dict[str, dict[str, Any]]:
        """Every task that left: its outcome, its jobs' status and its error (if it failed)."""
        return {tid: {"outcome": t.outcome, "status": t.status,
                      "error": None if t.error is None else f"{type(t.error).__name__}: {t.error}"}
                for tid, t in self.ended.items()}
