"""The executor recipe, the one for every task: load the base model, build the multi-LoRA engine,
read the data, admit jobs, loop training steps with periodic evaluation, early exit, ranking and
checkpoints. Read it top to bottom in `Executor.run`.

It is composed of two independent parts: the objective is the engine's class (MultiLoraEngine for
SFT, DpoEngine for DPO), the distribution is the strategy (trainer.strategy.OneGpu, or
trainer.parallel.AdapterParallel: the backbone FSDP2-sharded over P ranks, each rank training its
own jobs). The recipe is written for P ranks; on one GPU P = 1. Control is replicated: every rank
holds the whole task's bookkeeping (queue, the owner of every job, statuses, every job's
early-exit monitor, the ranking) and changes it only from gathered numbers in the same order, so
every decision is the same on every rank without being sent; a job's adapter, optimizer state
and data stream never leave the rank that trains it. Everything reaches the outside world
through `Callbacks` (rank 0's), and resuming from `output_dir/state.pt` is exact.

What is per executor lives here (model, engine, strategy, memory model and admission, the step
loop); what is per task (data, validation set, queue, early exit and ranking, exports,
checkpoints, callbacks, its stop flag) is a `trainer.colocate.TaskRun`. `Executor(cfg).run()`
hosts one task; on one GPU, `attach_task` / `detach_task` add and remove further tasks on the same
base model while it runs (co-location): they take effect at the next step boundary, and a task's
failure (an exception in its callbacks or its own work) ends that task alone.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from contract.protocol import EarlyExitSettings, EvalSettings
from contract.states import JOB_LIVE
from trainer.admission import (
    AdmissionController,
    MemoryModel,
    RecomputePolicy,
    fit_memory_model,
    load_profile,
    profile_key,
    profile_memory,
    store_profile,
)
from trainer.checkpoint import FileWriter, load_checkpoint
from trainer.colocate import ExamplePool, JobSlot, StepNumbers, TaskRun
from trainer.data import Example
from trainer.dpo import DpoEngine
from trainer.engine import MultiLoraEngine
from trainer.evaluation import eval_chunk
from trainer.jobs import JobSpec, release_host_cache
from trainer.pairs import PairExample
from trainer.strategy import OneGpu
from trainer.varlen import flash_exact, flash_varlen_available

log = logging.getLogger("loraplex.executor")

JobConfig = JobSpec  # one configuration of the task's search space


def _noop(*_: Any) -> None:
    return None


@dataclass
class Callbacks:
    """What the executor reports; every callable gets the job id first."""

    on_train_loss: Callable[[str, int, float], None] = _noop  # job, step, loss
    on_eval: Callable[[str, int, float], None] = _noop  # job, step, val loss
    on_job_state: Callable[[str, str, dict], None] = _noop  # job, state, details
    on_adapter: Callable[[str, str, Path], None] = _noop  # job, "best" | "final", directory
    on_event: Callable[[str, str, dict], None] = _noop  # job ("" = task), message, fields
    # job, step, "train" | "val", extra numbers of that point beside the loss (SFT val: mean
    # token_accuracy; DPO: reward accuracy and margin); called just BEFORE the on_train_loss /
    # on_eval of the same point
    on_metrics: Callable[[str, int, str, dict], None] = _noop
    # no job id: the fields of contract.protocol.ThroughputReport but the placement (measured
    # tokens/s over the steps since the last report, the batch mix, the memory model)
    on_throughput: Callable[[dict], None] = _noop
    # no job id: the task left the executor, its last call: the outcome (succeeded | failed |
    # cancelled | paused) and {"error": "Type: message" or None, "global_step": its steps}; made
    # even when the task's own callbacks failed (what a co-located task's runner waits for)
    on_task_end: Callable[[str, dict], None] = _noop
    # job, step, its exact sequence tokens of that step (trainer.engine.sequence_tokens), its
    # share of the executor's GPU-seconds (StepNumbers.gpu_seconds); called just BEFORE the
    # on_train_loss of the same point: the job's usage
    on_usage: Callable[[str, int, int, float], None] = _noop


@dataclass
class ExecutorConfig:
    """One task on one executor: base model, data, jobs and the policies around them."""

    model_dir: str
    train_file: str
    output_dir: str
    jobs: list[JobSpec]
    val_file: str | None = None
    val_fraction: float = 0.1
    split_seed: int = 0
    max_seq_len: int = 512
    eval: EvalSettings = field(default_factory=lambda: EvalSettings(eval_every_steps=10,
                                                                    eval_max_samples=None))
    # the fewest validation examples of one evaluation forward; a forward holds as many
    # sequences as a training step may (the admitted budget), so evaluation runs at full width
    eval_batch_size: int = 8
    checkpoint_every: int = 50  # executor steps between checkpoints ...
    checkpoint_every_s: float | None = None  # ... or seconds since the last one, first reached
    targets: tuple[str, ...] | None = None  # None: the model family's defaults
    # activation recompute: True always, False never, "auto" where a step needs it (one CUDA GPU
    # with measured memory models: a step whose batch fits without recompute runs without it;
    # elsewhere always, as True)
    gradient_checkpointing: bool | str = "auto"
    device: str = "auto"
    backend: str = "auto"
    adapter_dtype: str = "float32"
    max_active_jobs: int | None = None
    max_tokens_per_step: int | None = None  # admission budget without a memory model (CPU)
    memory_model: tuple[float, float] | None = None  # (k0, k1) from a profiling run
    memory_budget_bytes: float | None = None
    # JSON file of measured memory models, keyed by model, max_seq_len, GPU kind, torch version
    # and the other inputs of a profile: a node measures once and every later executor reuses it
    profile_cache: str | None = None
    # SDPA's cuDNN backend (torch's default). It plans anew for every new (rows, length) shape:
    # ~10 ms of host time per attention call on variable-length packed steps; without it the
    # masked (packed) attention runs on the memory-efficient kernel, slower on wide steps. On
    # H100 the whole task was faster with it (bench/results/task_e2e_h100.md), so it stays on.
    cudnn_attention: bool = True
    # the engine's packing and attention (MultiLoraEngine.set_attention): "rows" (each job's
    # sequences in its own padded rows, block mask), "varlen" (sequences back to back in one row,
    # attention by sequence bounds: no padding; SFT only) or "auto": varlen where torch's flash
    # varlen kernel runs (CUDA, SFT, one GPU), else rows. On H100 varlen took a 32-configuration
    # task from 105.5 s to 42.5 s (bench/results/task_e2e_h100.md)
    attention: str = "auto"
    early_exit: EarlyExitSettings = field(default_factory=EarlyExitSettings)
    stop_after_steps: int | None = None  # stop (as if killed) after this many executor steps
    # one GPU: checkpoints and exports are snapshots written by a writer thread while training
    # goes on (trainer.colocate: announced once complete); False: written in the step loop.
    # write_buffer_bytes bounds the snapshots waiting (the loop waits beyond it; one always may)
    async_writes: bool = True
    write_buffer_bytes: float = 4 * 2**30
    method: str = "sft"  # sft | dpo (preference pairs; JobSpec.beta per job)
    world_size: int = 1  # GPUs of the placement; > 1: adapter parallelism (FSDP2 backbone)


CALLBACK_KINDS = tuple(f.name for f in fields(Callbacks))
PHASES = ("load", "profile", "train", "eval", "checkpoint", "export", "admit", "init", "park", "resume")

# what a task must share with the executor it joins: the backbone, the engine and the step
HOST_FIELDS = ("model_dir", "method", "max_seq_len", "targets", "gradient_checkpointing", "device",
               "backend", "adapter_dtype", "world_size", "cudnn_attention", "attention")
TASK_OUTCOMES = ("succeeded", "failed", "cancelled", "paused")


class Executor:
    """One executor: a base model on one GPU set (its strategy), one engine, one admission budget
    and one step loop, hosting the jobs of one task or, on one GPU, of several (see the module
    docstring). With a distributed strategy, call `run` on every rank of the process group.
    The executor's own settings (HOST_FIELDS, the memory budget, max_active_jobs as its job cap,
    profile_cache) are its first task's configuration `cfg`."""

    def __init__(self, cfg: ExecutorConfig, callbacks: Callbacks | None = None,
                 strategy: Any = None, stop_requested: Callable[[], bool] | None = None,
                 task_id: str | None = None) -> None:
        self.cfg = cfg
        self.strategy = strategy or OneGpu()
        self.rank, self.world = self.strategy.rank, self.strategy.world
        self.pool = ExamplePool()  # the engine's train examples: every hosted task's
        # the executor's one file writer (one GPU); None: tasks write in the loop
        self.writer = FileWriter(cfg.write_buffer_bytes) if cfg.async_writes and self.world == 1 else None
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

    # ----- tasks on this executor ------------------------------------------------------------
    def _make_task(self, cfg: ExecutorConfig, callbacks: Callbacks | None,
                   stop_requested: Callable[[], bool] | None, task_id: str | None) -> TaskRun:
        holder: list[TaskRun] = []
        callbacks = callbacks or Callbacks()
        task = TaskRun(self, cfg, self.strategy.callbacks(self._guard(callbacks, holder)),
                       task_id or str(cfg.output_dir), stop_requested)
        # on one GPU the task's end reaches its own callback even after its others failed
        task.on_end = task.cb.on_task_end if self.world > 1 else callbacks.on_task_end
        holder.append(task)
        return task

    def _guard(self, cb: Callbacks, holder: list[TaskRun]) -> Callbacks:
        """The task's callbacks as the recipe calls them: on one GPU an exception in one ends its
        task alone (at the next step boundary) and the task reports nothing more."""
        if self.world > 1:
            return cb  # ranks must decide alike: rank 0's callbacks fail in the launcher

        def wrap(fn: Callable[..., None]) -> Callable[..., None]:
            def call(*args: Any) -> None:
                task = holder[0]
                if task.error is not None:
                    return
                try:
                    fn(*args)
                except Exception as exc:  # noqa: BLE001 - the task's, not the executor's
                    task.error = exc
            return call
        return Callbacks(*(wrap(getattr(cb, k)) for k in CALLBACK_KINDS))

    def _guarded(self, task: TaskRun, fn: Callable[[], Any]) -> Any:
        """Run a task's own work; on one GPU its exception fails that task alone."""
        if task.error is not None:
            return None
        if self.world > 1:
            return fn()
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - the task's, not the executor's
            log.exception("task=%s failed in its own work", task.task_id)
            task.error = exc
            return None

    def attach_task(self, cfg: ExecutorConfig, callbacks: Callbacks | None = None,
                    stop_requested: Callable[[], bool] | None = None, task_id: str | None = None) -> str:
        """Host another task (any thread may call it, before or while `run` runs): its jobs join
        the engine at the next step boundary, next to the jobs already there. Raises ValueError
        when the task cannot share this executor (another model or step setting, or an id in use)."""
        if self.world > 1:
            raise ValueError("an adapter-parallel executor hosts one task")
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

    def detach_task(self, task_id: str, outcome: str = "cancelled") -> None:
        """Take a task off at the next step boundary: "cancelled" (its unfinished jobs end
        cancelled) or "paused" (it checkpoints first; a later attach or executor resumes it).
        Only its jobs leave the engine; its admission budget goes to the others' queued jobs."""
        if outcome not in ("cancelled", "paused"):
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

    def _end_task(self, task: TaskRun, outcome: str) -> None:
        """Take the task off this executor. Finished or paused: its last checkpoint first."""
        if task.error is not None:
            outcome = "failed"
        if outcome in ("succeeded", "paused"):
            self._guarded(task, task.checkpoint)
        elif outcome == "cancelled":
            for job_id, st in task.status.items():
                if st["state"] in JOB_LIVE:
                    self._guarded(task, lambda j=job_id: task.set_state(j, "cancelled", {}))
        task.settle(wait=True)  # its files complete and announced first (a pause's checkpoint)
        if outcome in ("succeeded", "paused"):
            self._guarded(task, lambda: task.cb.on_event("", "timings", self.timings()))
        task.release()
        task.close()
        task.outcome = "failed" if task.error is not None else outcome
        self.tasks.pop(task.task_id, None)
        self.ended[task.task_id] = task
        with self._cv:
            self._known.pop(task.task_id, None)
        try:
            task.on_end(task.outcome, {"error": self.results()[task.task_id]["error"],
                                       "global_step": task.global_step})
        except Exception:  # noqa: BLE001 - the task has left; the executor goes on
            if self.world > 1:
                raise
            log.exception("task=%s on_task_end failed", task.task_id)
        if self.rank == 0:
            log.info("task=%s left the executor outcome=%s global_step=%d", task.task_id,
                     task.outcome, self.global_step)

    def _boundary(self) -> None:
        """Between steps: files written meanwhile are announced, failed tasks leave, then the
        attach / detach requests take effect."""
        for task in list(self.tasks.values()):
            task.settle()
            if task.error is not None:
                self._end_task(task, "failed")
        with self._cv:
            inbox, self._inbox = self._inbox, []
        for kind, arg in inbox:
            if kind == "attach":
                self.tasks[arg.task_id] = arg
                self._guarded(arg, lambda t=arg: self._open(t))
                self._guarded(arg, lambda t=arg: self._start(t))
                if arg.error is not None:
                    self._end_task(arg, "failed")
            elif arg[0] in self.tasks:
                task = self.tasks[arg[0]]
                task.stopped = arg[1] == "paused"
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

    # ----- setup -------------------------------------------------------------------------
    def _load(self) -> None:
        """The executor's part: model, engine, memory model and admission; then its tasks' data."""
        from transformers import AutoTokenizer

        cfg = self.cfg
        if cfg.method not in ("sft", "dpo"):
            raise ValueError(f"unknown method {cfg.method!r}; expected 'sft' or 'dpo'")
        if cfg.attention not in ("auto", "rows", "varlen") or (cfg.attention == "varlen" and cfg.method == "dpo"):
            raise ValueError(f"attention {cfg.attention!r}: 'auto', 'rows', or 'varlen' for sft")
        device = self.strategy.device(cfg.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if device.type == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(cfg.cudnn_attention)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
        model = self.strategy.load_model(cfg.model_dir, device, dtype)
        self.device = device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for task in list(self.tasks.values()):
            self._guarded(task, lambda t=task: t.read(self.tokenizer))
        engine_cls = DpoEngine if cfg.method == "dpo" else MultiLoraEngine
        # built on the first task's examples, as a one-task executor is; then it reads the pool
        self.engine = self.strategy.prepare_engine(engine_cls(
            model, self.first.train, pad, cfg.targets, cfg.gradient_checkpointing is not False, cfg.backend,
            getattr(torch, cfg.adapter_dtype),
        ), device)
        self.engine.train_examples = self.pool
        self.engine.set_attention(self._attention_mode(device))
        if device.type == "cuda" and cfg.max_tokens_per_step is None:
            budget = cfg.memory_budget_bytes or torch.cuda.get_device_properties(device).total_memory
            with self.phase("profile"):
                mm = MemoryModel(*cfg.memory_model) if cfg.memory_model else self._stored_memory_model()
            # ranks measure slightly different peaks; all must decide alike: take the largest
            fits = self.strategy.gather((mm.k0, mm.k1))
            self.memory_model = MemoryModel(max(f[0] for f in fits), max(f[1] for f in fits))
            self.admission = AdmissionController(self.memory_model, budget, cfg.max_seq_len,
                                                 max_jobs=cfg.max_active_jobs)
            if cfg.gradient_checkpointing == "auto" and self.world == 1 and not cfg.memory_model:
                with self.phase("profile"):
                    self.recompute_policy = self._recompute_policy()
        else:
            # a DPO batch item is a pair: two sequences of up to max_seq_len tokens
            per_item = cfg.max_seq_len * (2 if cfg.method == "dpo" else 1)
            self.admission = AdmissionController.from_token_budget(
                cfg.max_tokens_per_step or 1 << 60, per_item, cfg.max_active_jobs)
        for task in list(self.tasks.values()):
            self._guarded(task, task.open)


    def probe_step(self, total_batch: int) -> None:
        """One full training step of a throwaway job of the largest rank at `total_batch`
        sequences of max_seq_len tokens (DPO: pairs of two such sequences, responses trained
        on their second half, reference pass included); leaves the engine as it found it."""
        eng, cfg = self.engine, self.cfg
        g = torch.Generator().manual_seed(0)
        vocab = eng.model.get_input_embeddings().num_embeddings
        rows = torch.randint(0, vocab, (total_batch, cfg.max_seq_len), generator=g).tolist()
        probe: list = [Example(tuple(ids), tuple(ids)) for ids in rows]
        if isinstance(eng, DpoEngine):
            half = cfg.max_seq_len // 2
            probe = [PairExample(Example(tuple(ids), (-100,) * half + tuple(ids[half:])),
                                 Example(tuple(ids[::-1]), (-100,) * half + tuple(ids[::-1][half:])))
                     for ids in rows]
        saved, eng.train_examples = eng.train_examples, probe
        try:
            eng.attach(JobSpec("__probe__", rank=max(j.rank for j in cfg.jobs), lr=0.0,
                               batch_size=total_batch, max_steps=1))
            parked = {j: eng.detach(j) for j in list(eng.jobs) if j != "__probe__"}
            try:
                eng.step()
            finally:
                eng.detach("__probe__")
                for state in parked.values():
                    eng.attach(state)
        finally:
            eng.train_examples = saved
            if isinstance(eng, DpoEngine):
                eng.forget_reference(probe)

    def _profile_memory_model(self, batches: tuple[int, ...] = (1, 2, 4)) -> MemoryModel:
        # peak memory at a few total batches -> M(B) = k0 + k1 * B * L (DESIGN.md, technique 3)
        points = profile_memory(self.probe_step, batches, self.cfg.max_seq_len)
        return fit_memory_model(points)

    def _recompute_policy(self) -> RecomputePolicy | None:
        """The memory model without activation recompute (stored or measured at 1 and 2
        sequences), as the policy that turns recompute off for steps it predicts to fit; None
        where it cannot be measured (e.g. 2 sequences do not fit without recompute)."""
        eng = self.engine
        eng.set_recompute(False)
        try:
            without = self._stored_memory_model(recompute=False)
        except (ValueError, RuntimeError) as e:
            log.info("no memory model without recompute (%s): recompute stays on", e)
            return None
        finally:
            eng.set_recompute(True)
        return RecomputePolicy(without, self.admission.limit_bytes, self.cfg.max_seq_len)

    def _choose_recompute(self) -> None:
        """Before a step: recompute on or off for its total batch (RecomputePolicy); counted."""
        if self.recompute_policy is not None:
            total = sum(s.batch_size for s in self._slots())
            self.engine.set_recompute(self.recompute_policy.recompute(total))
        self.recompute_steps["on" if self.engine.gradient_checkpointing else "off"] += 1

    def _attention_mode(self, device: torch.device) -> str:
        """cfg.attention, with "auto" resolved for this executor's device, method and GPUs."""
        if self.cfg.attention != "auto":
            return self.cfg.attention
        flash = device.type == "cuda" and self.cfg.method == "sft" and self.world == 1
        if not (flash and flash_varlen_available()):
            return "rows"
        # rows where the flash kernel cannot compute the model's own attention (Gemma-2's
        # soft-cap): the varlen fallback would be exact but slow
        from transformers import AutoConfig

        return "varlen" if flash_exact(AutoConfig.from_pretrained(self.cfg.model_dir)) else "rows"

    def profile_key(self, recompute: bool = True) -> str:
        """What this executor's memory profile depends on (see trainer.admission.profile_key)."""
        cfg, eng = self.cfg, self.engine
        config = Path(cfg.model_dir) / "config.json"
        try:
            config_text = config.read_text()
        except OSError:
            config_text = None
        gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return profile_key(
            model_dir=str(Path(cfg.model_dir).resolve()), model_config=config_text,
            seq_len=cfg.max_seq_len, gpu=gpu, torch=torch.__version__, method=cfg.method,
            targets=sorted(eng.targets), gradient_checkpointing=recompute,
            adapter_dtype=cfg.adapter_dtype, backend=cfg.backend, ranks=self.world,
            max_lora_rank=max(j.rank for j in cfg.jobs), attention=eng.attention)

    def _stored_memory_model(self, recompute: bool = True) -> MemoryModel:
        """The node's stored profile for this key, or a fresh measurement that is then stored
        (without recompute: measured at 1 and 2 sequences, its activations are large)."""
        key = self.profile_key(recompute)
        stored = load_profile(self.cfg.profile_cache, key)
        # every rank must agree to reuse: one that lacks it (a torn read) makes all measure
        reuse = all(self.strategy.gather(stored is not None))
        # reused only if every profile this executor needs was stored
        self.profile_reused = reuse if recompute else bool(self.profile_reused) and reuse
        if reuse:
            return stored
        mm = self._profile_memory_model((1, 2, 4) if recompute else (1, 2))
        fits = self.strategy.gather((mm.k0, mm.k1))  # stored as the ranks will decide: the largest
        if self.rank == 0:
            store_profile(self.cfg.profile_cache, key,
                          MemoryModel(max(f[0] for f in fits), max(f[1] for f in fits)))
        return mm

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
                self._choose_recompute()
                report = self.engine.step() if self.engine.jobs else None
                if report is None:  # this rank has no runnable job: join the others' passes
                    self.engine.idle_step()
            if self.first_step_s is None:
                self.first_step_s = time.perf_counter() - self.started_at
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
                    self._end_task(task, "paused")
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
                self._end_task(task, "succeeded")

    def _close_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()  # every queued write completes (after a crash too: its files are whole)
        release_host_cache()  # parked states' pinned memory goes back to the host

    def timings(self) -> dict[str, Any]:
        """Wall seconds since `run` began, split by phase (idle: everything else: bookkeeping,
        callbacks, admission), the first step's time and whether the memory profile was reused."""
        wall = 0.0 if self.started_at is None else time.perf_counter() - self.started_at
        busy = sum(self.phases.values())
        return {"wall_s": wall, **{f"{k}_s": v for k, v in self.phases.items()},
                "idle_s": max(0.0, wall - busy), "first_step_s": self.first_step_s,
                # the writer thread's seconds (beside the loop's: checkpoint_s / export_s are
                # the loop's snapshots and waits for the writer)
                **{f"writer_{k}_s": v for k, v in (self.writer.busy if self.writer else
                                                   dict.fromkeys(("checkpoint", "export"), 0.0)).items()},
                "profile_reused": self.profile_reused, "global_step": self.global_step,
                # activation recompute: the setting and how many steps ran with and without it
                "recompute": self.cfg.gradient_checkpointing, "recompute_steps": self.recompute_steps["on"],
                "no_recompute_steps": self.recompute_steps["off"]}

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


def run_executor(cfg: ExecutorConfig, callbacks: Callbacks | None = None,
                 should_stop: Callable[[], bool] | None = None) -> dict[str, dict[str, Any]]:
    """Run one task with the strategy its placement asks for: this process on one GPU, or
    `cfg.world_size` ranks (one process per GPU) with the backbone sharded (adapter parallelism).
    Returns every job's final status; when should_stop() turns true, every rank checkpoints at
    the end of its step and returns (`Executor.stopped`)."""
    if cfg.world_size > 1:
        from trainer.parallel import run_parallel

        return run_parallel(cfg, cfg.world_size, callbacks, should_stop)
    return Executor(cfg, callbacks, stop_requested=should_stop).run()


def main(argv: list[str] | None = None) -> None:
    """`python -m trainer.executor config.json [--nproc P]`: run one task on this machine,
    printing callbacks as JSON lines."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(description="Run one task's jobs on this machine.")
    parser.add_argument("config", help="JSON file with ExecutorConfig fields; jobs as a list of JobSpec dicts")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (GPUs); default world_size")
    args = parser.parse_args(argv)
    raw = json.loads(Path(args.config).read_text())
    raw["jobs"] = [JobSpec(**{**j, "betas": tuple(j.get("betas", (0.9, 0.999)))}) for j in raw["jobs"]]
    if "early_exit" in raw:
        raw["early_exit"] = EarlyExitSettings(**raw["early_exit"])
    if "eval" in raw:
        raw["eval"] = EvalSettings(**raw["eval"])
    if "targets" in raw:
        raw["targets"] = tuple(raw["targets"])
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
