"""The executor recipe, the one for every task: load the base model, build the multi-LoRA engine,
read the data, admit jobs, loop training steps with periodic evaluation, early exit, ranking and
checkpoints. Read it top to bottom in `Executor.run`.

Composed, never branched on: the objective (trainer.objectives: SFT, DPO), the strategy
(trainer.strategy.Strategy: one GPU, or adapter parallelism over P ranks, trainer.parallel).
Control is replicated: every rank holds the whole bookkeeping and changes it only from gathered
numbers in the same order, so every decision is the same on every rank; a job's adapter,
optimizer state and data stream never leave the rank that trains it. Per task (data, queue,
early exit, exports, checkpoints, callbacks) is a `trainer.colocate.TaskRun`; tasks attach and
detach at step boundaries (trainer.hosting); the memory model and admission are
trainer.memory_plan's; trainer.launch starts an executor. Resuming from state.pt is exact.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from contract.states import TaskOutcome
from kernels.shipped_cache import seed as seed_triton_cache
from trainer.admission import MemoryModel, RecomputePolicy
from trainer.colocate import TaskRun
from trainer.config import Callbacks, ExecutorConfig
from trainer.data import Example
from trainer.evaluation import eval_chunk
from trainer.host_pool import POOL
from trainer.hosting import TaskHosting
from trainer.jobs import release_host_cache
from trainer.memory_plan import MemoryPlanning
from trainer.objectives import objective_for
from trainer.pairs import PairExample
from trainer.strategy import OneGpu, Strategy
from trainer.task_parts import ExamplePool, JobSlot, StepNumbers
from trainer.varlen import flash_exact, flash_varlen_available

log = logging.getLogger("loraplex.executor")

PHASES = ("load", "profile", "train", "eval", "checkpoint", "export", "admit", "init", "park", "resume",
          "samples")


class Executor(TaskHosting, MemoryPlanning):
    """One executor: a base model on one GPU set (its strategy), one engine, one admission budget
    and one step loop, hosting the jobs of one task or, on one GPU, of several (see the module
    docstring). With a distributed strategy, call `run` on every rank of the process group.
    The executor's own settings (HOST_FIELDS, the memory budget, max_active_jobs as its job cap,
    profile_cache) are its first task's configuration `cfg`."""

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
        self.tasks: dict[str, TaskRun] = {}  # hosted tasks, in attach order (admission order)
        self.ended: dict[str, TaskRun] = {}  # tasks that left, with their outcome
        self._inbox: list[tuple[str, Any]] = []  # attach / detach requests for the next boundary
        # task id -> (job ids, output_dir) of every task hosted or asked to attach (any thread)
        self._known: dict[str, tuple[set[str], str]] = {}
        self._cv = threading.Condition()
        self._closing = False
        self.global_step = 0
        self.memory_model: MemoryModel | None = None
        # wall seconds by phase (each phase without the phases nested in it; "idle" is the rest)
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._nested: list[float] = []
        self.started_at: float | None = None
        self._usage_mark = 0.0  # the end of the last step (usage: StepNumbers.gpu_seconds)
        self.first_step_s: float | None = None  # executor start -> end of the first step
        self.profile_reused: bool | None = None
        self.recompute_policy: RecomputePolicy | None = None
        self.corrections = {}  # recompute on/off -> the memory model corrected online (one GPU)
        self.memory_retries = self.memory_replays = 0
        self.recompute_steps = {"on": 0, "off": 0}
        self.first = self._make_task(cfg, callbacks, stop_requested, task_id)
        self._known[self.first.task_id] = ({j.job_id for j in cfg.jobs}, str(Path(cfg.output_dir).resolve()))
        self.tasks[self.first.task_id] = self.first

    # the first task's view, what a one-task executor was
    @property
    def status(self) -> dict[str, dict[str, Any]]:
        return self.first.status

    @property
    def val(self) -> list[Example | PairExample]:
        return self.first.val

    @property
    def stopped(self) -> bool:
        return self.first.stopped

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self._nested.append(0.0)
        try:
            yield
        finally:
            inner = self._nested.pop()
            elapsed = time.perf_counter() - t0
            self.phases[name] += elapsed - inner
            if self._nested:
                self._nested[-1] += elapsed

    # ----- setup -------------------------------------------------------------------------
    def _load(self) -> None:
        """The executor's part: model, engine, memory model and admission; then its tasks' data."""
        from transformers import AutoTokenizer

        cfg = self.cfg
        if cfg.attention not in ("auto", "rows") and not (cfg.attention == "varlen" and self.objective.packs_back_to_back):
            raise ValueError(f"attention {cfg.attention!r}: 'auto', 'rows', or 'varlen' for sft")
        device = self.strategy.device(cfg.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if device.type == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(cfg.cudnn_attention)
            seed_triton_cache()  # the kernels shipped for this GPU kind: none compiles in the task
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
        model = self.strategy.load_model(cfg.model_dir, device, dtype)
        self.device = device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for task in list(self.tasks.values()):
            self._guarded(task, lambda t=task: t.read(self.tokenizer))
        # built on the first task's examples, as a one-task executor is; then it reads the pool
        self.engine = self.strategy.prepare_engine(self.objective.engine_class(
            model, self.first.train, pad, cfg.targets, cfg.gradient_checkpointing is not False, cfg.backend,
            getattr(torch, cfg.adapter_dtype),
        ), device)
        self.engine.train_examples = self.pool
        self.engine.set_attention(self._attention_mode(device))
        if not cfg.cuda_graphs:
            self.engine.step_graphs = None
        self._plan_memory(device)
        for task in list(self.tasks.values()):
            self._guarded(task, task.open)

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
        self.started_at = self._usage_mark = time.perf_counter()
        with self.phase("load"):
            self._load()
        for task in list(self.tasks.values()):
            self.mark_joined(task, at_start=True)
            self._guarded(task, lambda t=task: self._start(t))
        while True:
            self._boundary()
            with self.phase("admit"):  # attaching (and the parking below): adapter copies
                self._admit()
            if [self._guarded(t, t.finish_done) for t in list(self.tasks.values())].count(True):
                continue  # e.g. a parked job whose warmup was its whole run
            self._end_idle_tasks()
            if not self._slots():
                if self._wait_for_work(linger_s):
                    self._usage_mark = time.perf_counter()  # an idle wait is nobody's usage
                    continue
                break
            started = time.perf_counter()
            with self.phase("train"):
                resident = self._step_memory_start()
                report = self._train_step() if self.engine.jobs else None
                self._count_recompute()
                self._step_memory_end(resident, report)
                if report is None:  # this rank has no runnable job: join the others' passes
                    self.engine.idle_step()
            now = time.perf_counter()
            if self.first_step_s is None:
                self.first_step_s = now - self.started_at
            for task in self.tasks.values():  # each task's own first step, from its arrival
                if task.first_step_s is None and task.placed and task.joined_at is not None:
                    task.first_step_s = now - task.joined_at
                    self._guarded(task, lambda t=task: self._reserve_parking(t))  # off its start
            self.global_step += 1
            for task in self.tasks.values():
                task.global_step += 1
                for slot in task.placed.values():
                    slot.step += 1
            stops = self._observe_train(report, time.perf_counter() - started)
            with self.phase("eval"):
                self._each(TaskRun.evaluate_due)
            with self.phase("admit"):
                self._each(TaskRun.warmup_policy)
            self._each(TaskRun.finish_done)
            for task in list(self.tasks.values()):
                limit = task.cfg.stop_after_steps is not None and task.global_step >= task.cfg.stop_after_steps
                if task.error is None and (stops[task.task_id] or limit):
                    # checkpoint, then stop as if killed: a later run resumes the task here
                    task.stopped = stops[task.task_id]
                    self._end_task(task, TaskOutcome.PAUSED)
                elif task.global_step % task.cfg.checkpoint_every == 0 or task.checkpoint_due:
                    self._guarded(task, task.checkpoint)
            self.strategy.flush()
        self.strategy.flush()

    def _each(self, work: Callable[[TaskRun], Any]) -> None:
        for task in list(self.tasks.values()):
            self._guarded(task, lambda t=task: work(t))

    def _slots(self) -> list[JobSlot]:
        return [s for t in self.tasks.values() for s in t.placed.values()]

    def _end_idle_tasks(self) -> None:
        """A task with nothing placed and nothing queued is done; when nothing is placed at all,
        nothing queued can start either (admission just ran on an empty executor)."""
        running = bool(self._slots())
        for task in list(self.tasks.values()):
            if not running or (not task.placed and not task.queue):
                self._end_task(task, TaskOutcome.SUCCEEDED)

    def _close_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()  # every queued write completes (after a crash too: its files are whole)
        release_host_cache()  # parked states' pinned memory goes back to the host
        POOL.release()

    def _writer_busy(self) -> dict[str, float]:
        return dict(self.writer.busy) if self.writer else dict.fromkeys(("checkpoint", "export"), 0.0)

    def mark_joined(self, task: TaskRun, at_start: bool) -> None:
        """Where a task's own timings count from: the executor's start for the tasks it started
        with (their wall includes the load), else now (a task that joins a warm host)."""
        task.joined_at = self.started_at if at_start else time.perf_counter()
        task.phases_at_join = {} if at_start else {**self.phases, **{
            f"writer_{k}": v for k, v in self._writer_busy().items()}}

    def timings(self, task: TaskRun | None = None) -> dict[str, Any]:
        """Wall seconds since `run` began, split by phase (idle: everything else: bookkeeping,
        callbacks, admission), the first step's time and whether the memory profile was reused.
        With a task: the same since that task joined (the executor's start for the tasks it
        started with), its own first step, and the host's wall beside it (host_wall, seconds)."""
        now = time.perf_counter()
        host_wall = 0.0 if self.started_at is None else now - self.started_at
        since = {} if task is None else task.phases_at_join
        phases = {k: v - since.get(k, 0.0) for k, v in self.phases.items()}
        writer = {k: v - since.get(f"writer_{k}", 0.0) for k, v in self._writer_busy().items()}
        wall = host_wall if task is None or task.joined_at is None else now - task.joined_at
        first = self.first_step_s if task is None else task.first_step_s
        busy = sum(phases.values())
        extra = {} if task is None else {"host_wall": host_wall}  # seconds; a detail, not a phase
        return {"wall_s": wall, **{f"{k}_s": v for k, v in phases.items()},
                "idle_s": max(0.0, wall - busy), "first_step_s": first, **extra,
                # the writer thread's seconds (beside the loop's: checkpoint_s / export_s are
                # the loop's snapshots and waits for the writer)
                **{f"writer_{k}_s": v for k, v in writer.items()},
                "profile_reused": self.profile_reused, "global_step": self.global_step,
                # activation recompute: the setting and how many steps ran with and without it
                "recompute": self.cfg.gradient_checkpointing, "recompute_steps": self.recompute_steps["on"],
                "no_recompute_steps": self.recompute_steps["off"], **self._memory_check()}

    # ----- pieces of the loop --------------------------------------------------------------
    def _observe_train(self, report: Any, seconds: float) -> dict[str, bool]:
        """Every rank's step outcome to every rank, then each task's callbacks and exit
        decisions, the same everywhere; per task whether any rank was asked to stop it."""
        local = {} if report is None else {
            j: (report.steps[j], report.losses[j], report.skipped[j], report.grad_norms[j],
                report.metrics.get(j), report.job_tokens.get(j, 0)) for j in report.losses}
        stop = {t.task_id: bool(self._guarded(t, lambda t=t: t.stop_requested is not None
                                              and t.stop_requested())) for t in self.tasks.values()}
        numbers = None if report is None else (report.padded_fraction, report.tokens)
        now = time.monotonic()
        due = {t.task_id: t.cfg.checkpoint_every_s is not None
               and now - t.last_checkpoint >= t.cfg.checkpoint_every_s for t in self.tasks.values()}
        parts = self.strategy.gather((local, stop, numbers, due))
        merged = {j: v for part in parts for j, v in part[0].items()}
        measured = [p[2] for p in parts if p[2] is not None]
        slots = self._slots()
        now_wall = time.perf_counter()
        wall, self._usage_mark = now_wall - self._usage_mark, now_wall
        step = StepNumbers(seconds, sum(m[1] for m in measured), sum(s.batch_size for s in slots),
                           sum(m[0] for m in measured) / max(len(measured), 1),
                           sorted(s.batch_size for s in slots), wall * self.world,
                           sum(v[5] for v in merged.values()))
        for task in self.tasks.values():
            task.checkpoint_due = bool(parts[0][3][task.task_id])
        self._each(lambda t: t.observe_train(merged, step))
        return {tid: any(p[1][tid] for p in parts) for tid in self.tasks}

    def rank_batch(self, rank: int) -> int:
        return sum(s.batch_size for s in self._slots() if s.owner == rank)

    def _admit(self) -> None:
        """Deterministic admission under the one memory model: tasks in attach order (an earlier
        task's queued jobs go first; a later task's wait while they do not fit, and no running job
        is disturbed), one job at a time to the least-loaded rank whose admission controller
        takes it (the memory model is per rank)."""
        for task in list(self.tasks.values()):
            if task.error is not None:
                continue
            while True:
                slots = self._slots()
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
                    break

    def eval_shape(self, n_jobs: int, n_examples: int | None = None, floor: int | None = None
                   ) -> tuple[int, int]:
        """(examples per forward, sequences per forward) of an evaluation of n_jobs jobs over
        n_examples (default: the first task's validation set): one forward holds as many
        sequences as admission lets a training step hold (a no-grad forward needs less than the
        step it was sized for), never fewer than the eval_batch_size floor."""
        floor = self.cfg.eval_batch_size if floor is None else floor
        n_examples = len(self.first.val) if n_examples is None else n_examples
        budget = max(self.admission.max_total_batch(), floor)
        budget = min(budget, max(1, n_jobs) * max(1, n_examples))
        return eval_chunk(n_jobs, n_examples, budget, floor), budget

    def log_state(self, task_id: str, job_id: str, state: str, details: dict) -> None:
        if self.rank == 0:
            log.info("task=%s job=%s state=%s details=%s", task_id, job_id, state, details)
