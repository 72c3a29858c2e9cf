"""The executor recipe, the one for every task: load the base model, build the multi-LoRA engine,
read the data, admit jobs, loop training steps with periodic evaluation, early exit, ranking and
checkpoints. Read it top to bottom in `Executor.run`.

Composed, never branched on: the objective (trainer.objectives: SFT, DPO), the strategy
(trainer.strategy.Strategy: one GPU, or adapter parallelism over P ranks, trainer.parallel).
Control is replicated: every rank holds the whole bookkeeping and changes it only from gathered
numbers in the same order, so every decision is the same on every rank; a job's adapter,
optimizer state and data stream never leave the rank that trains it. Per task (data, queue,
early exit, exports, checkpoints, callbacks) is a `trainer.colocate.TaskRun`.

The executor is the device loop (load, admit, step, observe, evaluate, checkpoint); it owns
components, each one meaning in its own module and reached through public methods, never a
mixin: `roster` (trainer.hosting.TaskRoster: the tasks hosted and ended, the attach / detach
requests taken at step boundaries, each task's passage and guarded work), `memory`
(trainer.memory_plan.MemoryPlan: the memory model, admission, recompute policy, the step's
out-of-memory retry; built once the engine exists) and `clock` (trainer.phase_clock.PhaseClock:
wall seconds by phase). A task and the roster see the executor through Protocols
(trainer.task_parts.TaskExecutor, trainer.hosting.RosterExecutor). trainer.launch starts an executor.
Resuming from state.pt is exact.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from contract.states import TaskOutcome
from kernels.shipped_cache import seed as seed_triton_cache
from trainer import triton_ahead
from trainer.admission import AdmissionController, MemoryModel
from trainer.colocate import TaskRun
from trainer.config import Callbacks, ExecutorConfig
from trainer.data import Example
from trainer.device_room import eval_short, release, spare_bytes
from trainer.evaluation import eval_chunk, eval_chunk_tokens
from trainer.graph_parts import holds_next, set_lasts, steps_left
from trainer.host_pool import POOL
from trainer.hosting import TaskRoster
from trainer.jobs import JobRun, release_host_cache
from trainer.memory_plan import MemoryPlan, allocator_counts
from trainer.objectives import objective_for
from trainer.pairs import PairExample
from trainer.phase_clock import PhaseClock
from trainer.strategy import OneGpu, Strategy
from trainer.task_parts import ExamplePool, StepNumbers
from trainer.varlen import flash_exact, flash_varlen_available

log = logging.getLogger("loraplex.executor")


def process_age(at: float) -> float | None:
    """Seconds from this process's start (the kernel's record of it) to perf_counter time `at`:
    what a node's cold start spends before the executor's load (the interpreter, the imports).
    None where /proc does not tell."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: its start
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return round(uptime - ticks / os.sysconf("SC_CLK_TCK") - (time.perf_counter() - at), 3)


class Executor:
    """One executor: a base model on one GPU set (its strategy), one engine, one admission budget
    and one step loop, hosting the jobs of one task or, on one GPU, of several (see the module
    docstring). With a distributed strategy, call `run` on every rank of the process group.
    The executor's own settings (HOST_FIELDS, the memory budget, max_active_jobs as its job cap,
    profile_cache) are its first task's configuration `cfg`. It is the `TaskExecutor` its tasks use."""

    def __init__(self, cfg: ExecutorConfig, callbacks: Callbacks | None = None,
                 strategy: Strategy | None = None, stop_requested: Callable[[], bool] | None = None,
                 task_id: str | None = None) -> None:
        self.cfg = cfg
        self.objective = objective_for(cfg.method)
        self.strategy: Strategy = strategy or OneGpu()
        self.rank, self.world = self.strategy.rank, self.strategy.world
        self.pool = ExamplePool()  # the engine's train examples: every hosted task's
        # the executor's one file writer (one GPU); None: tasks write in the loop
        self.writer = self.strategy.file_writer(cfg.async_writes, cfg.write_buffer_bytes)
        self.memory: MemoryPlan | None = None  # planned once the engine is built (`_load`)
        self.global_step = 0
        self.loaded_with: set[str] = set()  # the tasks hosted when the model loaded (`_load`)
        self.clock = PhaseClock(self.writer)  # wall seconds by phase
        self._usage_mark = 0.0  # the end of the last step (usage: StepNumbers.gpu_seconds)
        self.roster = TaskRoster(self, cfg)
        self.first = self.roster.make(cfg, callbacks, stop_requested, task_id)
        self.roster.add_first(self.first)

    # the tasks (the roster's), and the first task's view, what a one-task executor was
    @property
    def tasks(self) -> dict[str, TaskRun]:
        """The hosted tasks, in attach order (admission order)."""
        return self.roster.tasks

    @property
    def ended(self) -> dict[str, TaskRun]:
        """The tasks that left, with their outcome."""
        return self.roster.ended

    @property
    def status(self) -> dict[str, dict[str, Any]]:
        return self.first.status

    @property
    def val(self) -> list[Example | PairExample]:
        return self.first.val

    @property
    def stopped(self) -> bool:
        return self.first.stopped

    # what a task reads of the memory plan (TaskExecutor)
    @property
    def admission(self) -> AdmissionController:
        if self.memory is None:
            raise AttributeError("admission: the executor has not loaded its model yet")
        return self.memory.admission

    @property
    def memory_model(self) -> MemoryModel | None:
        return None if self.memory is None else self.memory.model

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Time a phase of the loop (trainer.phase_clock; a task's writes use it too)."""
        return self.clock.phase(name)

    # ----- setup -------------------------------------------------------------------------
    def _load(self) -> None:
        """The executor's part: model, engine, memory model and admission; then its tasks' data."""
        marks = [("start", time.perf_counter())]
        self.loaded_with = set(self.tasks)  # their walls hold this load: their timings show its parts
        from transformers import AutoTokenizer

        marks.append(("imports", time.perf_counter()))
        cfg = self.cfg
        if cfg.attention not in ("auto", "rows") and not (cfg.attention == "varlen" and self.objective.packs_back_to_back):
            raise ValueError(f"attention {cfg.attention!r}: 'auto', 'rows', or 'varlen' for sft")
        device = self.strategy.device(cfg.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        warming = triton_ahead.start(device.type == "cuda", device)  # Triton's key, the first calls: beside the load
        if device.type == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(cfg.cudnn_attention)
            seed_triton_cache()  # the kernels shipped for this GPU kind: none compiles in the task
        marks.append(("device", time.perf_counter()))
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
        marks.append(("tokenizer", time.perf_counter()))
        model = self.strategy.load_model(cfg.model_dir, device, dtype)
        marks.append(("model", time.perf_counter()))
        self.device = device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for task in list(self.tasks.values()):
            self.roster.guarded(task, lambda t=task: t.read(self.tokenizer))
        marks.append(("data", time.perf_counter()))
        warming.join()  # before the engine's probes launch its first Triton kernel
        # built on the first task's examples, as a one-task executor is; then it reads the pool
        self.engine = self.strategy.prepare_engine(self.objective.engine_class(
            model, self.first.train, pad, cfg.targets, cfg.gradient_checkpointing is not False, cfg.backend,
            getattr(torch, cfg.adapter_dtype),
        ), device)
        self.engine.train_examples = self.pool
        self.engine.set_attention(self._attention_mode(device))
        if not cfg.cuda_graphs:
            self.engine.step_graphs = None
        marks.append(("engine", time.perf_counter()))
        self.memory = MemoryPlan(cfg, self.engine, device, self.objective, self.strategy, self.phase,
                                 self._parked_state)
        self.engine.recompute_for = self.memory.recompute_for
        if self.memory.recompute_policy is not None:  # parked states, a stale pool leave before a recompute
            self.memory.recompute_policy = replace(
                self.memory.recompute_policy, spare=lambda: spare_bytes(self.engine, self.tasks.values()),
                release=lambda: release(self.engine, self._spill_parked))
        self.engine.split_for = self.memory.split_for
        if self.engine.step_graphs is not None:  # a capture checks the free memory; near the end, none
            self.engine.step_graphs.capture_need = self.memory.capture_bytes
            self.engine.step_graphs.steps_left = lambda: steps_left(self.engine, self.tasks.values())
            self.engine.step_graphs.set_lasts = lambda: set_lasts(self.engine, self.tasks.values())
            self.engine.pipeline.holds = lambda: holds_next(self.engine, self.tasks.values())
        marks.append(("memory", time.perf_counter()))
        for task in list(self.tasks.values()):
            self.roster.guarded(task, task.open)
        marks.append(("open", time.perf_counter()))
        # where the load's seconds went: transformers' first import, the device and kernel cache, the
        # backbone (its family's modeling module imported on the way), the tasks' data,
        # the engine (its fused blocks' probes, the LoRA layers), the memory plan, the tasks' files
        self.load_parts = {name: round(t - prev, 3) for (_, prev), (name, t) in zip(marks[:-1], marks[1:], strict=True)}
        self.load_parts["process_age_at_load_s"] = process_age(marks[0][1])
        log.info("load parts seconds=%s", json.dumps(self.load_parts))

    def _attention_mode(self, device: torch.device) -> str:
        """cfg.attention, with "auto" resolved for this executor's device, method and GPUs."""
        if self.cfg.attention != "auto":
            return self.cfg.attention
        flash = device.type == "cuda" and self.objective.packs_back_to_back and self.strategy.whole_engine
        if not (flash and flash_varlen_available()):
            return "rows"
        # rows where the flash kernel cannot compute the model's own attention (Gemma-2's
        # soft-cap): the varlen fallback would be exact but slow
        from transformers import AutoConfig

        return "varlen" if flash_exact(AutoConfig.from_pretrained(self.cfg.model_dir)) else "rows"

    # ----- the recipe --------------------------------------------------------------------
    def run(self, linger_s: float = 0.0) -> dict[str, dict[str, Any]]:
        """Train until every hosted task has ended (and, with linger_s, no task attached for
        that long, or `close` was called); returns the first task's jobs' status and re-raises
        the first task's error, as a one-task executor does."""
        try:
            self._loop(linger_s)
        finally:
            self._close_writer()
        if self.first.error is not None:
            raise self.first.error
        return self.first.status

    def serve(self, linger_s: float = math.inf) -> dict[str, dict[str, Any]]:
        """A shared executor's loop: train the tasks that come until `close` (or linger_s with
        none); returns `results()`, every task's outcome (a task's failure raises nothing)."""
        try:
            self._loop(linger_s)
        finally:
            self._close_writer()
        return self.results()

    def _loop(self, linger_s: float) -> None:
        self._usage_mark = self.clock.start()
        with self.phase("load"):
            self._load()
        memory = self.memory
        assert memory is not None
        for task in list(self.tasks.values()):
            self.mark_joined(task, at_start=True)
            self.roster.guarded(task, lambda t=task: self.roster.start(t))
        while True:
            self.roster.boundary()
            with self.phase("admit"):  # attaching (and the parking below): adapter copies
                self._admit()
            if [self.roster.guarded(t, t.finish_done) for t in list(self.tasks.values())].count(True):
                continue  # e.g. a parked job whose warmup was its whole run
            self.roster.end_idle()
            if not self.roster.slots():
                if self.roster.wait_for_work(linger_s):
                    self._usage_mark = time.perf_counter()  # an idle wait is nobody's usage
                    continue
                break
            started = time.perf_counter()
            with self.phase("train"):
                resident = memory.step_start()
                report = memory.train_step() if self.engine.jobs else None
                memory.step_end(resident, report)
                if report is None:  # this rank has no runnable job: join the others' passes
                    self.engine.idle_step()
            now = time.perf_counter()
            self.clock.step_ended(now)
            for task in self.tasks.values():  # each task's own first step, from its arrival
                if task.first_step_s is None and task.placed and task.joined_at is not None:
                    task.first_step_s = now - task.joined_at
                    self.roster.guarded(task, lambda t=task: self.roster.reserve_parking(t))  # off its start
            self.global_step += 1
            for task in self.tasks.values():
                task.global_step += 1
                for slot in task.placed.values():
                    slot.step += 1
            stops = self._observe_train(report, time.perf_counter() - started)
            with self.phase("eval"):
                self.roster.each(TaskRun.evaluate_due)
            with self.phase("admit"):
                self.roster.each(TaskRun.warmup_policy)
            self.roster.each(TaskRun.finish_done)
            for task in list(self.tasks.values()):
                limit = task.cfg.stop_after_steps is not None and task.global_step >= task.cfg.stop_after_steps
                if task.error is None and (stops[task.task_id] or limit):
                    # checkpoint, then stop as if killed: a later run resumes the task here
                    task.stopped = stops[task.task_id]
                    self.roster.end(task, TaskOutcome.PAUSED)
                elif task.files.checkpoint_due or (task.cfg.checkpoint_every
                                                   and task.global_step % task.cfg.checkpoint_every == 0):
                    self.roster.guarded(task, task.files.checkpoint)
            self.strategy.flush()
        self.strategy.flush()

    def _close_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()  # every queued write completes (after a crash too: its files are whole)
        release_host_cache()  # parked states' pinned memory goes back to the host
        POOL.release()

    def mark_joined(self, task: TaskRun, at_start: bool) -> None:
        """Where a task's own timings count from (PhaseClock.mark_joined)."""
        self.clock.mark_joined(task, at_start)

    def timings(self, task: TaskRun | None = None) -> dict[str, Any]:
        """Wall seconds since `run` began, split by phase (trainer.phase_clock; with a task:
        since that task joined), the executor's step count, the recompute setting and the memory
        plan's details (recompute steps, whether the profile was reused, how the model did) and
        the pinned pool's (slices served, missed, chunks pinned on the loop, GB pinned), and on a
        GPU the caching allocator's retries (a full device: cached blocks freed and the allocation
        tried again, a device sync each) and cudaMalloc calls since the process began."""
        # the load by part, for a task whose wall holds the load (not one that joined a warm host)
        parts = {} if task is not None and task.task_id not in self.loaded_with else {
            f"load_part_{k.removesuffix('_s')}": v for k, v in getattr(self, "load_parts", {}).items()}
        return {**self.clock.split(task), "global_step": self.global_step,
                "recompute": self.cfg.gradient_checkpointing, **POOL.counts(), **allocator_counts(getattr(self, "device", None)),
                **(self.memory.timings() if self.memory else {"profile_reused": None}), **parts}

    # ----- tasks coming and going (trainer.hosting.TaskRoster; any thread) -------------------
    def attach_task(self, cfg: ExecutorConfig, callbacks: Callbacks | None = None,
                    stop_requested: Callable[[], bool] | None = None, task_id: str | None = None) -> str:
        """Host another task (any thread may call it, before or while `run` runs): its jobs join
        the engine at the next step boundary, next to the jobs already there. Raises ValueError
        when the task cannot share this executor (another model or step setting, or an id in use)."""
        return self.roster.request_attach(cfg, callbacks, stop_requested, task_id)

    def detach_task(self, task_id: str, outcome: str = TaskOutcome.CANCELLED) -> None:
        """Take a task off at the next step boundary: "cancelled" (its unfinished jobs end
        cancelled) or "paused" (it checkpoints first; a later attach or executor resumes it).
        Only its jobs leave the engine; its admission budget goes to the others' queued jobs."""
        self.roster.request_detach(task_id, outcome)

    def close(self) -> None:
        """Let `run` return once its tasks have ended (it stops waiting for new ones)."""
        self.roster.close()

    def results(self) -> dict[str, dict[str, Any]]:
        """Every task that left: its outcome, its jobs' status and its error (if it failed)."""
        return self.roster.results()

    def capacity(self) -> dict[str, int]:
        """Read-only, from any thread (a shared executor's host reports it): the admission budget
        in rows of one batch item (a job's batch_size unit: a sequence, for DPO a pair), the rows
        no running job holds, and the hosted jobs still queued. Zeros before the model is loaded.
        Snapshots of the loop's dicts (list() of a dict view is atomic under the GIL)."""
        if self.memory is None:
            return {"total_rows": 0, "free_rows": 0, "queued_jobs": 0}
        tasks = list(self.tasks.values())
        used = sum(s.batch_size for t in tasks for s in list(t.placed.values()))
        total = self.memory.admission.max_total_batch()
        return {"total_rows": total, "free_rows": max(0, total - used),
                "queued_jobs": sum(len(t.queue) for t in tasks)}

    def _parked_state(self, job_id: str) -> JobRun | None:
        """A job parked by one of the hosted tasks (the memory plan's state bytes read it)."""
        return next((t.parked[job_id] for t in self.tasks.values() if job_id in t.parked), None)

    # ----- pieces of the loop --------------------------------------------------------------
    def _observe_train(self, report: Any, seconds: float) -> dict[str, bool]:
        """Every rank's step outcome to every rank, then each task's callbacks and exit
        decisions, the same everywhere; per task whether any rank was asked to stop it."""
        local = {} if report is None else {
            j: (report.steps[j], report.losses[j], report.skipped[j], report.grad_norms[j],
                report.metrics.get(j), report.job_tokens.get(j, 0)) for j in report.losses}
        stop = {t.task_id: bool(self.roster.guarded(t, lambda t=t: t.stop_requested is not None
                                              and t.stop_requested())) for t in self.tasks.values()}
        numbers = None if report is None else (report.padded_fraction, report.tokens)
        now = time.monotonic()
        due = {t.task_id: t.cfg.checkpoint_every_s is not None
               and now - t.files.last_checkpoint >= t.cfg.checkpoint_every_s for t in self.tasks.values()}
        parts = self.strategy.gather((local, stop, numbers, due))
        merged = {j: v for part in parts for j, v in part[0].items()}
        measured = [p[2] for p in parts if p[2] is not None]
        slots = self.roster.slots()
        now_wall = time.perf_counter()
        wall, self._usage_mark = now_wall - self._usage_mark, now_wall
        step = StepNumbers(seconds, sum(m[1] for m in measured), sum(s.batch_size for s in slots),
                           sum(m[0] for m in measured) / max(len(measured), 1),
                           sorted(s.batch_size for s in slots), wall * self.world,
                           sum(v[5] for v in merged.values()))
        for task in self.tasks.values():
            task.files.checkpoint_due = bool(parts[0][3][task.task_id])
        self.roster.each(lambda t: t.observe_train(merged, step))
        return {tid: any(p[1][tid] for p in parts) for tid in self.tasks}

    def rank_batch(self, rank: int) -> int:
        return sum(s.batch_size for s in self.roster.slots() if s.owner == rank)

    def _admit(self) -> None:
        """Deterministic admission under the one memory model: tasks in attach order (an earlier
        task's queued jobs go first; a later task's wait while they do not fit, and no running job
        is disturbed), one job at a time to the least-loaded rank whose admission controller
        takes it (the memory model is per rank)."""
        for task in list(self.tasks.values()):
            if task.error is not None:
                continue
            while True:
                slots = self.roster.slots()
                order = sorted(range(self.world), key=lambda r: (
                    self.rank_batch(r), sum(s.owner == r for s in slots), r))
                for r in order:
                    cands = task.candidates(r)
                    running = [s for s in slots if s.owner == r]
                    chosen = self.admission.admit(cands, running) if cands else []
                    if chosen:
                        task.place(chosen[0], r)
                        break
                else:
                    # nothing runs and a queued job does not fit: states parked on the device
                    # (waiting for a ranking that waits for this job) go to the host, then again
                    if slots or not any(task.candidates(r) for r in range(self.world)):
                        break
                    if not self._spill_parked():
                        break

    def eval_shape(self, n_jobs: int, n_examples: int | None = None, floor: int | None = None,
                   lengths: Sequence[int] | None = None) -> tuple[int, int]:
        """(examples per forward, sequences per forward) of an evaluation of n_jobs jobs over
        n_examples (default: the first task's validation set). Given the examples' `lengths`
        (longest first) on one GPU, a forward holds the tokens of a no-grad forward's room now
        (MemoryPlan.eval_tokens); else as many sequences as admission lets a training step hold.
        Never fewer than the eval_batch_size floor."""
        floor = self.cfg.eval_batch_size if floor is None else floor
        tokens = self.memory.eval_tokens() if self.memory is not None and lengths is not None else None
        if tokens is not None:
            assert self.memory is not None and lengths is not None  # as eval_tokens was asked
            return eval_chunk_tokens(n_jobs, lengths, tokens, floor, self.memory.eval_job_tokens())
        n_examples = len(self.first.val) if n_examples is None else n_examples
        budget = max(self.admission.max_total_batch(), floor)
        budget = min(budget, max(1, n_jobs) * max(1, n_examples))
        return eval_chunk(n_jobs, n_examples, budget, floor), budget

    def eval_room(self, tokens: int) -> None:
        """Before an evaluation whose forwards want `tokens`: the states parked on the device go to
        the host where the room is short of them (trainer.device_room.eval_short)."""
        if eval_short(self.memory.eval_tokens() if self.memory is not None else None, tokens):
            self._spill_parked()

    def evaluation(self, run: Callable[[], tuple[Any, int]]) -> Any:
        """An evaluation's forwards (`run`: its result and its largest forward's tokens), watched
        by the memory plan (MemoryPlan.evaluation; out of memory, the hosted tasks' states parked
        on the device may go to the host)."""
        if self.memory is None:
            return run()[0]
        return self.memory.evaluation(run, self._spill_parked)

    def _spill_parked(self) -> bool:
        """Every hosted task's states parked on the device to the host; whether any moved."""
        return any([t.spill_parked() for t in self.tasks.values()])  # a list: every task spills

    def log_state(self, task_id: str, job_id: str, state: str, details: dict) -> None:
        if self.rank == 0:
            log.info("task=%s job=%s state=%s details=%s", task_id, job_id, state, details)
