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
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from service.protocol import EarlyExitSettings, EvalSettings
from trainer.admission import (
    AdmissionController,
    MemoryModel,
    fit_memory_model,
    load_profile,
    profile_key,
    profile_memory,
    store_profile,
)
from trainer.checkpoint import (
    job_state_dict,
    load_checkpoint,
    restore_job,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from trainer.data import (
    Example,
    PairExample,
    read_jsonl,
    split_validation,
    tokenize_all,
    tokenize_pairs,
)
from trainer.dpo import DpoEngine
from trainer.early_exit import ExitDecision, JobMonitor, WarmupRanking
from trainer.engine import JobSpec, JobState, MultiLoraEngine, eval_chunk, eval_forwards
from trainer.export import export_peft
from trainer.strategy import OneGpu

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
    # job, step, "train" | "val", extra numbers of that point beside the loss (DPO: reward
    # accuracy and margin); called just BEFORE the on_train_loss / on_eval of the same point
    on_metrics: Callable[[str, int, str, dict], None] = _noop
    # no job id: the fields of service.protocol.ThroughputReport but the placement (measured
    # tokens/s over the steps since the last report, the batch mix, the memory model)
    on_throughput: Callable[[dict], None] = _noop


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
    gradient_checkpointing: bool = True
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
    early_exit: EarlyExitSettings = field(default_factory=EarlyExitSettings)
    stop_after_steps: int | None = None  # stop (as if killed) after this many executor steps
    method: str = "sft"  # sft | dpo (preference pairs; JobSpec.beta per job)
    world_size: int = 1  # GPUs of the placement; > 1: adapter parallelism (FSDP2 backbone)


CALLBACK_KINDS = tuple(f.name for f in fields(Callbacks))
PHASES = ("load", "profile", "train", "eval", "checkpoint", "export", "admit")


@dataclass
class JobSlot:
    """A started job as every rank knows it: its owner rank and its step count (the JobState
    itself lives on the owner only)."""

    job_id: str
    owner: int
    batch_size: int
    step: int
    total_steps: int

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps


@dataclass
class _Window:
    """Training throughput since the last report: steps, seconds, real tokens, samples."""

    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    samples: int = 0
    padded: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)  # the mix trained at the last step


class Executor:
    """Runs all jobs of one task to completion; see the module docstring. With a distributed
    strategy, call `run` on every rank of the initialised process group."""

    def __init__(self, cfg: ExecutorConfig, callbacks: Callbacks | None = None,
                 strategy: Any = None, stop_requested: Callable[[], bool] | None = None) -> None:
        self.cfg = cfg
        self.strategy = strategy or OneGpu()
        self.rank, self.world = self.strategy.rank, self.strategy.world
        self.cb = self.strategy.callbacks(callbacks or Callbacks())
        self.stop_requested = stop_requested
        self.stopped = False
        self.out = Path(cfg.output_dir)
        self.status: dict[str, dict[str, Any]] = {
            j.job_id: {"state": "pending", "exit_reason": None} for j in cfg.jobs
        }
        self.monitors = {j.job_id: JobMonitor(cfg.early_exit) for j in cfg.jobs}
        ranked = cfg.early_exit.enabled and len(cfg.jobs) > 1
        self.ranking = WarmupRanking([j.job_id for j in cfg.jobs], cfg.early_exit.keep_fraction) if ranked else None
        self.queue: list[JobSpec | JobSlot] = list(cfg.jobs)  # never started, then parked
        self.placed: dict[str, JobSlot] = {}  # running jobs of every rank, in placement order
        self.parked: dict[str, JobState] = {}  # this rank's parked jobs (on CPU)
        self.global_step = 0
        self.last_eval: dict[str, int] = {}
        self.window = _Window()
        self.memory_model: MemoryModel | None = None
        self.last_checkpoint = time.monotonic()
        self.checkpoint_due = False  # by time, as rank 0's clock says (every rank alike)
        # wall seconds by phase (each phase without the phases nested in it; "idle" is the rest)
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._nested: list[float] = []
        self.started_at: float | None = None
        self.first_step_s: float | None = None  # executor start -> end of the first step
        self.profile_reused: bool | None = None

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
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
        from transformers import AutoTokenizer

        cfg = self.cfg
        if cfg.method not in ("sft", "dpo"):
            raise ValueError(f"unknown method {cfg.method!r}; expected 'sft' or 'dpo'")
        device = self.strategy.device(cfg.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if device.type == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(cfg.cudnn_attention)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
        model = self.strategy.load_model(cfg.model_dir, device, dtype)
        self.device = device
        tokenize = tokenize_pairs if cfg.method == "dpo" else tokenize_all
        train = tokenize(self.tokenizer, read_jsonl(cfg.train_file), cfg.max_seq_len)
        if cfg.val_file:
            val = tokenize(self.tokenizer, read_jsonl(cfg.val_file), cfg.max_seq_len)
        else:
            train, val = split_validation(train, cfg.val_fraction, cfg.split_seed)
        if not train or not val:
            raise ValueError("no trainable examples left after tokenisation/truncation")
        cap = cfg.eval.eval_max_samples
        # the same first N for every job and evaluation, in order of length: an evaluation
        # forward then packs sequences of like length (a mean over tokens ignores the order)
        self.val = sorted(val[:cap] if cap else val, key=_length, reverse=True)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        engine_cls = DpoEngine if cfg.method == "dpo" else MultiLoraEngine
        self.engine = self.strategy.prepare_engine(engine_cls(
            model, train, pad, cfg.targets, cfg.gradient_checkpointing, cfg.backend,
            getattr(torch, cfg.adapter_dtype),
        ), device)
        if isinstance(self.engine, DpoEngine):
            # the validation pairs' reference log-probs once, in the evaluation's chunks, so no
            # evaluation needs a pass the other ranks do not make
            for lo in range(0, len(self.val), cfg.eval_batch_size):
                self.engine.ensure_reference(self.val[lo : lo + cfg.eval_batch_size])
        if device.type == "cuda" and cfg.max_tokens_per_step is None:
            budget = cfg.memory_budget_bytes or torch.cuda.get_device_properties(device).total_memory
            with self._phase("profile"):
                mm = MemoryModel(*cfg.memory_model) if cfg.memory_model else self._stored_memory_model()
            # ranks measure slightly different peaks; all must decide alike: take the largest
            fits = self.strategy.gather((mm.k0, mm.k1))
            self.memory_model = MemoryModel(max(f[0] for f in fits), max(f[1] for f in fits))
            self.cb.on_event("", "memory_model", {"k0": self.memory_model.k0, "k1": self.memory_model.k1,
                                                  "budget_bytes": budget, "ranks": self.world})
            self.admission = AdmissionController(self.memory_model, budget, cfg.max_seq_len,
                                                 max_jobs=cfg.max_active_jobs)
        else:
            # a DPO batch item is a pair: two sequences of up to max_seq_len tokens
            per_item = cfg.max_seq_len * (2 if cfg.method == "dpo" else 1)
            self.admission = AdmissionController.from_token_budget(
                cfg.max_tokens_per_step or 1 << 60, per_item, cfg.max_active_jobs)
        self.cb.on_event("", "executor_loaded", {"train": len(train), "val": len(self.val),
                                                 "device": str(device), "ranks": self.world})

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

    def _profile_memory_model(self) -> MemoryModel:
        # peak memory at a few total batches -> M(B) = k0 + k1 * B * L (DESIGN.md, technique 3)
        points = profile_memory(self.probe_step, (1, 2, 4), self.cfg.max_seq_len)
        return fit_memory_model(points)

    def profile_key(self) -> str:
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
            targets=sorted(eng.targets), gradient_checkpointing=cfg.gradient_checkpointing,
            adapter_dtype=cfg.adapter_dtype, backend=cfg.backend, ranks=self.world,
            max_lora_rank=max(j.rank for j in cfg.jobs))

    def _stored_memory_model(self) -> MemoryModel:
        """The node's stored profile for this key, or a fresh measurement that is then stored."""
        key = self.profile_key()
        stored = load_profile(self.cfg.profile_cache, key)
        # every rank must agree to reuse: one that lacks it (a torn read) makes all measure
        reuse = all(self.strategy.gather(stored is not None))
        self.profile_reused = reuse
        if reuse:
            return stored
        mm = self._profile_memory_model()
        fits = self.strategy.gather((mm.k0, mm.k1))  # stored as the ranks will decide: the largest
        if self.rank == 0:
            store_profile(self.cfg.profile_cache, key,
                          MemoryModel(max(f[0] for f in fits), max(f[1] for f in fits)))
        return mm

    # ----- the recipe --------------------------------------------------------------------
    def run(self) -> dict[str, dict[str, Any]]:
        self.started_at = time.perf_counter()
        with self._phase("load"):
            self._load()
        state_path = self.out / "state.pt"
        if state_path.exists():
            self._resume(load_checkpoint(state_path))
        for job_id in self.admission.unschedulable([q for q in self.queue if isinstance(q, JobSpec)]):
            self.queue = [q for q in self.queue if q.job_id != job_id]
            self._set_state(job_id, "failed", {"error": "does not fit the executor's memory even alone"})
            if self.ranking is not None:
                self.ranking.exit(job_id)
        while True:
            with self._phase("admit"):  # attaching (and the parking below): adapter copies
                self._admit()
            done = [j for j, s in self.placed.items() if s.done]
            for job_id in done:  # e.g. a parked job whose warmup was its whole run
                self._finish(job_id)
            if done:
                continue
            if not self.placed:
                break
            started = time.perf_counter()
            with self._phase("train"):
                report = self.engine.step() if self.engine.jobs else None
                if report is None:  # this rank has no runnable job: join the others' passes
                    self.engine.idle_step()
            if self.first_step_s is None:
                self.first_step_s = time.perf_counter() - self.started_at
            self.global_step += 1
            for slot in self.placed.values():
                slot.step += 1
            stop = self._observe_train(report, time.perf_counter() - started)
            with self._phase("eval"):
                self._evaluate_due()
            with self._phase("admit"):
                self._warmup_policy()
            for job_id in [j for j, s in self.placed.items() if s.done]:
                self._finish(job_id)
            limit = self.cfg.stop_after_steps is not None and self.global_step >= self.cfg.stop_after_steps
            if stop or limit:  # checkpoint, then stop as if killed: a later run resumes here
                self.stopped = stop
                self._checkpoint()
                self._report_timings()
                self.strategy.flush()
                return self.status
            if self.global_step % self.cfg.checkpoint_every == 0 or self.checkpoint_due:
                self._checkpoint()
            self.strategy.flush()
        self._checkpoint()
        self._report_timings()
        self.strategy.flush()
        return self.status

    def timings(self) -> dict[str, Any]:
        """Wall seconds since `run` began, split by phase (idle: everything else: bookkeeping,
        callbacks, admission), the first step's time and whether the memory profile was reused."""
        wall = 0.0 if self.started_at is None else time.perf_counter() - self.started_at
        busy = sum(self.phases.values())
        return {"wall_s": wall, **{f"{k}_s": v for k, v in self.phases.items()},
                "idle_s": max(0.0, wall - busy), "first_step_s": self.first_step_s,
                "profile_reused": self.profile_reused, "global_step": self.global_step}

    def _report_timings(self) -> None:
        self.cb.on_event("", "timings", self.timings())

    # ----- pieces of the loop --------------------------------------------------------------
    def _observe_train(self, report: Any, seconds: float) -> bool:
        """Every rank's step outcome to every rank, then the same callbacks and exit decisions
        everywhere; True when any rank was asked to stop."""
        local = {} if report is None else {
            j: (report.steps[j], report.losses[j], report.skipped[j], report.grad_norms[j],
                report.metrics.get(j)) for j in report.losses}
        stop = bool(self.stop_requested is not None and self.stop_requested())
        numbers = None if report is None else (report.padded_fraction, report.tokens)
        every_s = self.cfg.checkpoint_every_s
        due = every_s is not None and time.monotonic() - self.last_checkpoint >= every_s
        parts = self.strategy.gather((local, stop, numbers, due))
        self.checkpoint_due = bool(parts[0][3])
        merged = {j: v for part in parts for j, v in part[0].items()}
        measured = [p[2] for p in parts if p[2] is not None]
        w = self.window
        w.steps += 1
        w.seconds += seconds
        w.tokens += sum(m[1] for m in measured)
        w.samples += sum(s.batch_size for s in self.placed.values())
        w.batch_sizes = sorted(s.batch_size for s in self.placed.values())
        w.padded.append(sum(m[0] for m in measured) / max(len(measured), 1))
        for job_id in list(self.placed):
            step, loss, skipped, norm, metrics = merged[job_id]
            if metrics:
                self.cb.on_metrics(job_id, step, "train", metrics)
            self.cb.on_train_loss(job_id, step, loss)
            if skipped:
                self.cb.on_event(job_id, "update_skipped", {"step": step, "loss": loss, "grad_norm": norm})
            decision = self.monitors[job_id].observe_train(step, loss)
            if decision is not None:
                self._exit(job_id, decision)
        return any(p[1] for p in parts)

    def _rank_batch(self, rank: int) -> int:
        return sum(s.batch_size for s in self.placed.values() if s.owner == rank)

    def _admit(self) -> None:
        """Deterministic admission: one job at a time to the least-loaded rank whose admission
        controller takes it (the memory model is per rank); a parked job returns to its own rank
        only, and during warmup only never-started jobs rotate in."""
        ranking_open = self.ranking is not None and self.ranking.result is None
        while True:
            order = sorted(range(self.world), key=lambda r: (
                self._rank_batch(r), sum(s.owner == r for s in self.placed.values()), r))
            for r in order:
                cands = [q for q in self.queue if isinstance(q, JobSpec) or (q.owner == r and not ranking_open)]
                running = [s for s in self.placed.values() if s.owner == r]
                chosen = self.admission.admit(cands, running) if cands else []
                if chosen:
                    self._place(chosen[0], r)
                    break
            else:
                return

    def _place(self, job_id: str, rank: int) -> None:
        item = next(q for q in self.queue if q.job_id == job_id)
        self.queue.remove(item)
        resumed = isinstance(item, JobSlot)
        slot = item if resumed else JobSlot(job_id, rank, item.batch_size, 0,
                                            item.total_steps(len(self.engine.train_examples)))
        self.placed[job_id] = slot
        if rank == self.rank:
            self.engine.attach(self.parked.pop(job_id) if resumed else item)
        if self.status[job_id]["state"] != "running":
            self._set_state(job_id, "running", {"resumed": resumed, "rank": rank})

    def _cadence_due(self, s: JobSlot) -> bool:
        """Whether the job's last step crossed an evaluation point: every eval_every_samples
        samples it trained on (steps x batch size), else every eval_every_steps of its steps."""
        every = getattr(self.cfg.eval, "eval_every_samples", None)
        if every:
            return (s.step * s.batch_size) // every > ((s.step - 1) * s.batch_size) // every
        return s.step % self.cfg.eval.eval_every_steps == 0

    def eval_shape(self, n_jobs: int) -> tuple[int, int]:
        """(examples per forward, sequences per forward) of an evaluation of n_jobs jobs: one
        forward holds as many sequences as admission lets a training step hold (a no-grad
        forward needs less than the step it was sized for), never fewer than eval_batch_size."""
        floor = self.cfg.eval_batch_size
        budget = max(self.admission.max_total_batch(), floor)
        budget = min(budget, max(1, n_jobs) * max(1, len(self.val)))
        return eval_chunk(n_jobs, len(self.val), budget, floor), budget

    def _evaluate_due(self) -> None:
        due = []
        for job_id, s in self.placed.items():
            warm_end = self._warmup_len(s) if self._in_warmup(job_id) else -1
            if self._cadence_due(s) or s.done or s.step == warm_end:
                if self.last_eval.get(job_id) != s.step:
                    due.append(job_id)
        if not due:
            return

        def plan(r: int) -> tuple[list[str], int, int]:
            ids = [j for j in due if self.placed[j].owner == r]
            return (ids, *self.eval_shape(len(ids)))

        forwards = max(eval_forwards(len(ids), len(self.val), bs, cap)
                       for ids, bs, cap in map(plan, range(self.world)))
        mine, bs, cap = plan(self.rank)
        local = self.engine.evaluate_metrics(self.val, bs, mine, cap, forwards=forwards)
        numbers = {j: v for part in self.strategy.gather(local) for j, v in part.items()}
        for job_id in due:
            s, m = self.placed[job_id], numbers[job_id]
            val = m["loss"]  # DPO: the validation DPO loss, for the same detectors
            self.last_eval[job_id] = s.step
            extra = {k: v for k, v in m.items() if k != "loss"}
            if extra:
                self.cb.on_metrics(job_id, s.step, "val", extra)
            self.cb.on_eval(job_id, s.step, val)
            mon = self.monitors[job_id]
            decision = mon.observe_eval(s.step, val)
            if mon.last_eval_was_best:
                self._export(job_id, "best")
            if decision is not None:
                self._exit(job_id, decision)

    def _warmup_len(self, s: JobSlot) -> int:
        return self.cfg.early_exit.warmup_steps(s.total_steps)

    def _in_warmup(self, job_id: str) -> bool:
        return self.ranking is not None and job_id in self.ranking.waiting

    def _warmup_policy(self) -> None:
        if self.ranking is None or self.ranking.result is not None:
            return
        fresh_waiting = any(isinstance(q, JobSpec) for q in self.queue)
        for job_id, s in list(self.placed.items()):
            if self._in_warmup(job_id) and s.step >= self._warmup_len(s):
                mon = self.monitors[job_id]
                self.ranking.report(job_id, mon.eval_val[-1] if mon.eval_val else math.inf)
                if fresh_waiting:  # rotate: park it on its rank so a queued configuration gets its warmup
                    self.queue.append(self.placed.pop(job_id))
                    if s.owner == self.rank:
                        self.parked[job_id] = self.engine.detach(job_id, park_device="cpu")
                    self.cb.on_event(job_id, "parked_after_warmup", {"step": s.step, "rank": s.owner})
        if self.ranking.ready:
            keep, evict = self.ranking.decide()
            self.cb.on_event("", "warmup_ranking", {"keep": keep, "evict": evict})
            for job_id in evict:
                self._exit(job_id, ExitDecision("underperforming", {"kept": keep}))

    def _exit(self, job_id: str, decision: ExitDecision) -> None:
        if self.status[job_id]["state"] in ("exited", "completed", "failed"):
            return
        slot = self.placed.pop(job_id, None)
        if slot is not None and slot.owner == self.rank:
            self.engine.detach(job_id)
        self.parked.pop(job_id, None)
        self.queue = [q for q in self.queue if q.job_id != job_id]
        if self._in_warmup(job_id):
            self.ranking.exit(job_id)
        self.status[job_id]["exit_reason"] = decision.reason
        self._set_state(job_id, "exited", {"exit_reason": decision.reason, **decision.details})

    def _finish(self, job_id: str) -> None:
        slot = self.placed.pop(job_id)
        state = self.engine.detach(job_id) if slot.owner == self.rank else None
        self._export(job_id, "final", state, owner=slot.owner)
        self._set_state(job_id, "completed", {"steps": slot.step, "best_val": self.monitors[job_id].best_val})

    def _export(self, job_id: str, kind: str, state: JobState | None = None, owner: int | None = None) -> None:
        with self._phase("export"):
            self._export_now(job_id, kind, state, owner)

    def _export_now(self, job_id: str, kind: str, state: JobState | None, owner: int | None) -> None:
        path = self.out / "jobs" / job_id / kind
        owner = self.placed[job_id].owner if owner is None else owner
        if owner == self.rank:  # the weights are here; the announcement follows the files
            state = state or self.engine.jobs[job_id]
            export_peft(state.adapter, path, list(self.engine.targets), self.cfg.model_dir,
                        metadata={"step": str(state.step)})
        self.cb.on_adapter(job_id, kind, path)

    def _set_state(self, job_id: str, state: str, details: dict) -> None:
        self.status[job_id]["state"] = state
        if self.rank == 0:
            log.info("job=%s state=%s details=%s", job_id, state, details)
        self.cb.on_job_state(job_id, state, details)

    # ----- reports and checkpoints -------------------------------------------------------------
    def _report_throughput(self) -> None:
        w, self.window = self.window, _Window()
        if w.steps == 0:
            return
        tokens_per_s = w.tokens / w.seconds if w.seconds > 0 else 0.0
        self.cb.on_event("", "throughput", {
            "global_step": self.global_step, "padded_fraction": sum(w.padded) / len(w.padded),
            "active_jobs": len(self.placed), "ranks": self.world, "tokens_per_s": tokens_per_s,
        })
        if tokens_per_s > 0 and w.batch_sizes:  # also at the end, when no job is placed any more
            mm = self.memory_model
            self.cb.on_throughput({
                "gpus": self.world, "seq_len": self.cfg.max_seq_len, "batch_sizes": w.batch_sizes,
                "tokens_per_s": tokens_per_s, "samples_per_s": w.samples / w.seconds,
                "memory_k0": mm.k0 if mm else None, "memory_k1": mm.k1 if mm else None,
            })

    def _checkpoint(self) -> None:
        with self._phase("checkpoint"):
            self._checkpoint_now()

    def _checkpoint_now(self) -> None:
        self.last_checkpoint, self.checkpoint_due = time.monotonic(), False
        self._report_throughput()
        dpo = isinstance(self.engine, DpoEngine)
        mine = {j: job_state_dict(s) for j, s in [*self.engine.jobs.items(), *self.parked.items()]}
        parts = self.strategy.collect_parts(self.out, {
            "jobs": mine, "reference": self.engine.reference_state() if dpo else None})
        if parts is None:  # not rank 0: it writes the one state.pt
            return
        states = {j: d for part in parts for j, d in part["jobs"].items()}
        owners = {j: s.owner for j, s in self.placed.items()}
        owners.update({q.job_id: q.owner for q in self.queue if isinstance(q, JobSlot)})
        payload = {
            "active": [states[j] for j in self.placed],
            "queue": [states[q.job_id] if isinstance(q, JobSlot) else {"fresh": q} for q in self.queue],
            "status": self.status, "monitors": self.monitors, "ranking": self.ranking,
            "global_step": self.global_step, "last_eval": self.last_eval, "rng": rng_state(),
            "parallel": {"world": self.world, "owners": owners},
        }
        if dpo:  # the reference log-probs of every rank (2 floats per pair): a resume reuses them
            refs = [p["reference"] for p in parts]
            payload["reference"] = {k: torch.cat([r[k] for r in refs]) for k in ("keys", "values")}
        save_checkpoint(self.out / "state.pt", payload)

    def _resume(self, ck: dict[str, Any]) -> None:
        """Continue from a state.pt of any strategy: on the same number of ranks every job stays
        on its rank; otherwise jobs are dealt to the least-loaded ranks, which gives the same
        adapters, as a job's trajectory does not depend on where or beside whom it runs."""
        par = ck.get("parallel") or {}
        owners = par.get("owners", {}) if par.get("world") == self.world else {}
        parked_load = [0] * self.world
        for d in ck["active"]:
            job_id, bs = d["spec"]["job_id"], d["spec"]["batch_size"]
            r = owners.get(job_id)
            if r is None:
                r = min(range(self.world), key=lambda k: (self._rank_batch(k), k))
            self.placed[job_id] = JobSlot(job_id, r, bs, d["step"], d["total_steps"])
            if r == self.rank:
                self.engine.attach(restore_job(self.engine, d))
        self.queue = []
        for q in ck["queue"]:
            if "fresh" in q:
                self.queue.append(q["fresh"])
                continue
            job_id = q["spec"]["job_id"]
            r = owners.get(job_id)
            if r is None:
                r = min(range(self.world), key=lambda k: (parked_load[k], k))
            parked_load[r] += 1
            self.queue.append(JobSlot(job_id, r, q["spec"]["batch_size"], q["step"], q["total_steps"]))
            if r == self.rank:
                self.parked[job_id] = restore_job(self.engine, q).to("cpu")
        self.status, self.monitors, self.ranking = ck["status"], ck["monitors"], ck["ranking"]
        self.global_step, self.last_eval = ck["global_step"], ck["last_eval"]
        if isinstance(self.engine, DpoEngine) and ck.get("reference") is not None:
            self.engine.load_reference_state(ck["reference"])
        set_rng_state(ck["rng"])
        self.cb.on_event("", "resumed", {"global_step": self.global_step, "ranks": self.world,
                                         "same_placement": bool(owners)})
        # a retry starts every unfinished job again (the service shows them pending meanwhile):
        # the running ones say so now, the parked ones when they are placed again
        for st in self.status.values():
            if st["state"] == "running":
                st["state"] = "pending"
        for job_id, slot in self.placed.items():
            self._set_state(job_id, "running", {"resumed": True, "rank": slot.owner})


def _length(example: Example | PairExample) -> int:
    if isinstance(example, PairExample):
        return len(example.chosen.input_ids) + len(example.rejected.input_ids)
    return len(example.input_ids)


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
