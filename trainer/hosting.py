"""The executor's tasks (co-location): how tasks attach and detach while the loop runs, at step
boundaries, each with its callbacks guarded so that, where the strategy lets tasks fail alone, a
task's exception ends that task and nothing else. A part of trainer.executor.Executor."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from contract.protocol import tenant_safe
from contract.states import JOB_LIVE, JobState, TaskOutcome
from trainer.arena import park_room
from trainer.checkpoint_files import load_checkpoint
from trainer.colocate import TaskRun
from trainer.config import CALLBACK_KINDS, HOST_FIELDS, Callbacks, ExecutorConfig
from trainer.host_pool import POOL, host_memory_bytes
from trainer.task_samples import task_samples, write_samples

log = logging.getLogger("loraplex.executor")


class TaskHosting:
    """Attach, detach and end tasks; the mixin of trainer.executor.Executor that holds its
    `tasks`, `ended`, `_inbox`, `_known`, `_cv` and `_closing`."""

    tasks: dict[str, TaskRun]
    ended: dict[str, TaskRun]
    _inbox: list[tuple[str, Any]]
    _known: dict[str, tuple[set[str], str]]
    _cv: threading.Condition
    _closing: bool

    def _make_task(self, cfg: ExecutorConfig, callbacks: Callbacks | None,
                   stop_requested: Callable[[], bool] | None, task_id: str | None) -> TaskRun:
        holder: list[TaskRun] = []
        routed = self.strategy.callbacks(callbacks or Callbacks())
        task = TaskRun(self, cfg, self._guard(routed, holder), task_id or str(cfg.output_dir),
                       stop_requested)
        task.on_end = routed.on_task_end  # unguarded: reached even after the others failed
        holder.append(task)
        return task

    def _fail(self, task: TaskRun) -> Callable[[Exception], None]:
        def fail(exc: Exception) -> None:
            log.error("task=%s failed in its own work", task.task_id, exc_info=exc)
            task.error = exc
        return fail

    def _guard(self, cb: Callbacks, holder: list[TaskRun]) -> Callbacks:
        """The task's callbacks as the recipe calls them: where tasks fail alone (the strategy's
        `contain`), an exception in one ends its task at the next step boundary and the task
        reports nothing more."""

        def wrap(fn: Callable[..., None]) -> Callable[..., None]:
            def call(*args: Any) -> None:
                self._guarded(holder[0], lambda: fn(*args))
            return call
        return Callbacks(*(wrap(getattr(cb, k)) for k in CALLBACK_KINDS))

    def _guarded(self, task: TaskRun, fn: Callable[[], Any]) -> Any:
        """Run a task's own work; where tasks fail alone, its exception fails that task alone."""
        if task.error is not None:
            return None
        return self.strategy.contain(fn, self._fail(task))

    def attach_task(self, cfg: ExecutorConfig, callbacks: Callbacks | None = None,
                    stop_requested: Callable[[], bool] | None = None, task_id: str | None = None) -> str:
        """Host another task (any thread may call it, before or while `run` runs): its jobs join
        the engine at the next step boundary, next to the jobs already there. Raises ValueError
        when the task cannot share this executor (another model or step setting, or an id in use)."""
        if not self.strategy.hosts_many_tasks:
            raise ValueError("this executor's strategy hosts one task")
        for name in HOST_FIELDS:
            mine, theirs = getattr(self.cfg, name), getattr(cfg, name)
            if name == "model_dir":
                mine, theirs = str(Path(mine).resolve()), str(Path(theirs).resolve())
            if mine != theirs:
                raise ValueError(f"{name}: the task asks for {theirs!r}, this executor has {mine!r}")
        task = self._make_task(cfg, callbacks, stop_requested, task_id)
        jobs = {j.job_id for j in cfg.jobs}
        with self._cv:
            if self._closing:
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
            self._inbox.append(("attach", task))
            self._cv.notify_all()
        return task.task_id

    def detach_task(self, task_id: str, outcome: str = TaskOutcome.CANCELLED) -> None:
        """Take a task off at the next step boundary: "cancelled" (its unfinished jobs end
        cancelled) or "paused" (it checkpoints first; a later attach or executor resumes it).
        Only its jobs leave the engine; its admission budget goes to the others' queued jobs."""
        if outcome not in (TaskOutcome.CANCELLED, TaskOutcome.PAUSED):
            raise ValueError(f"outcome must be 'cancelled' or 'paused', not {outcome!r}")
        with self._cv:
            self._inbox.append(("detach", (task_id, outcome)))
            self._cv.notify_all()

    def close(self) -> None:
        """Let `run` return once its tasks have ended (it stops waiting for new ones)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()

    def results(self) -> dict[str, dict[str, Any]]:
        """Every task that left: its outcome, its jobs' status and its error (if it failed)."""
        return {tid: {"outcome": t.outcome, "status": t.status,
                      "error": None if t.error is None else f"{type(t.error).__name__}: {t.error}"}
                for tid, t in self.ended.items()}

    def capacity(self) -> dict[str, int]:
        """Read-only, from any thread (a shared executor's host reports it): the admission budget
        in rows of one batch item (a job's batch_size unit: a sequence, for DPO a pair), the rows
        no running job holds, and the hosted jobs still queued. Zeros before the model is loaded.
        Snapshots of the loop's dicts (list() of a dict view is atomic under the GIL)."""
        admission = getattr(self, "admission", None)
        if admission is None:
            return {"total_rows": 0, "free_rows": 0, "queued_jobs": 0}
        tasks = list(self.tasks.values())
        used = sum(s.batch_size for t in tasks for s in list(t.placed.values()))
        total = admission.max_total_batch()
        return {"total_rows": total, "free_rows": max(0, total - used),
                "queued_jobs": sum(len(t.queue) for t in tasks)}

    def _open(self, task: TaskRun) -> None:
        task.read(self.tokenizer)
        task.open()

    def _start(self, task: TaskRun) -> None:
        """Resume the task from its own state.pt if it has one; fail its jobs that never fit."""
        state_path = task.out / "state.pt"
        if state_path.exists():
            alone = list(self.tasks) == [task.task_id] and self.global_step == 0
            task.resume(load_checkpoint(state_path), restore_rng=alone)
            if alone:
                self.global_step = task.global_step
        task.fail_unschedulable()

    def _samples(self, task: TaskRun) -> None:
        """The completions the task ends with (trainer.task_samples), from its leading adapters and
        the base model, before it lets go of the backbone. One GPU: an adapter-parallel task ends
        without them. A failure is the samples' alone: logged and announced, the task succeeds."""
        if not self.strategy.whole_engine or not task.cfg.settings.samples.enabled:
            return
        from trainer.sampling import generate

        try:
            with self.phase("samples"):
                rows = task_samples(task, self.engine, self.tokenizer, generate)
            if rows:
                write_samples(task.out, rows)
                task.cb.on_event("", "samples", {"samples": rows})
        except Exception as exc:  # noqa: BLE001 - the training succeeded; its samples did not
            log.exception("task=%s samples failed", task.task_id)
            task.cb.on_event("", "samples_failed", {"error": tenant_safe(str(exc))})

    def _reserve_parking(self, task: TaskRun) -> None:
        """After the task's first step (trainer.host_pool): pin, in the background, host memory
        for the states its configurations may park beyond what the device keeps (parks stay on
        the device while PARK_RESERVE of it stays free) and for the snapshots its writes take;
        at most a quarter of the host's memory, only on a GPU."""
        eng = self.engine
        if eng.device.type != "cuda" or len(task.cfg.jobs) <= 1:
            return
        per_rank = eng.params_per_rank
        item = eng.adapter_dtype.itemsize
        states = sum(3 * item * per_rank * j.lora_rank for j in task.cfg.jobs)  # weights + 2 moments
        free, total = torch.cuda.mem_get_info(eng.device)
        need = max(0, states - max(0, int(park_room(free, total))))
        # and the snapshots of checkpoints and exports waiting for the writer thread
        need += int(task.cfg.write_buffer_bytes)
        POOL.reserve(min(need + POOL.pinned_bytes, host_memory_bytes() // 4))

    def _end_task(self, task: TaskRun, outcome: str) -> None:
        """Take the task off this executor. Finished or paused: its last checkpoint first."""
        if task.error is not None:
            outcome = TaskOutcome.FAILED
        if outcome in (TaskOutcome.SUCCEEDED, TaskOutcome.PAUSED):
            self._guarded(task, task.checkpoint)
        elif outcome == TaskOutcome.CANCELLED:
            for job_id, st in task.status.items():
                if st["state"] in JOB_LIVE:
                    self._guarded(task, lambda j=job_id: task.set_state(j, JobState.CANCELLED, {}))
        task.settle(wait=True)  # its files complete and announced first (a pause's checkpoint)
        if outcome == TaskOutcome.SUCCEEDED and task.error is None:
            self._samples(task)
        if outcome in (TaskOutcome.SUCCEEDED, TaskOutcome.PAUSED):  # the task's own, not the host's
            self._guarded(task, lambda: task.cb.on_event("", "timings", self.timings(task)))
        task.release()
        task.close()
        task.outcome = TaskOutcome.FAILED if task.error is not None else outcome
        self.tasks.pop(task.task_id, None)
        self.ended[task.task_id] = task
        with self._cv:
            self._known.pop(task.task_id, None)
        end = {"error": self.results()[task.task_id]["error"], "global_step": task.global_step}
        # the task has left: where tasks fail alone, its failing on_task_end ends nothing more
        self.strategy.contain(lambda: task.on_end(task.outcome, end),
                              lambda exc: log.error("task=%s on_task_end failed", task.task_id, exc_info=exc))
        if self.rank == 0:
            log.info("task=%s left the executor outcome=%s global_step=%d", task.task_id,
                     task.outcome, self.global_step)

    def _boundary(self) -> None:
        """Between steps: files written meanwhile are announced, failed tasks leave, then the
        attach / detach requests take effect."""
        for task in list(self.tasks.values()):
            task.settle()
            if task.error is not None:
                self._end_task(task, TaskOutcome.FAILED)
        with self._cv:
            inbox, self._inbox = self._inbox, []
        for kind, arg in inbox:
            if kind == "attach":
                self.tasks[arg.task_id] = arg
                self.mark_joined(arg, at_start=False)
                self._guarded(arg, lambda t=arg: self._open(t))
                self._guarded(arg, lambda t=arg: self._start(t))
                if arg.error is not None:
                    self._end_task(arg, TaskOutcome.FAILED)
            elif arg[0] in self.tasks:
                task = self.tasks[arg[0]]
                task.stopped = arg[1] == TaskOutcome.PAUSED
                self._end_task(task, arg[1])

    def _wait_for_work(self, linger_s: float) -> bool:
        """No job runs: wait up to linger_s for a task to attach (until `close`). When none came,
        the executor closes in the same breath, so no attach_task can slip in unseen."""
        deadline = time.monotonic() + linger_s
        with self._cv:
            while not self._inbox and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, 1.0))
            if not self._inbox:
                self._closing = True
            return bool(self._inbox)
