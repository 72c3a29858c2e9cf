"""An executor's memory plan (`MemoryPlan`): the memory model M(B) = k0 + k1 * B * L
(docs/architecture.md, technique 3), stored per node and profile key or built from the model's
config with no profiling pass (trainer.memory_model) and corrected online from the real steps'
peaks (stored again), the admission controller built on it, the policy that turns activation
recompute off for steps that fit without it, and the step that runs again out of memory.

A component (its own meaning and state) that trainer.executor.Executor owns (`executor.memory`),
built once the engine exists, with what it reads: the settings, the engine and its device, the
objective (the probe's items), the strategy (the ranks decide alike), the phase timer and where a
hosted task's parked job is. The engine's hooks and admission's callables are its bound methods."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from trainer.admission import (
    AdmissionController,
    JobLike,
    MemoryModel,
    RecomputePolicy,
    fit_memory_model,
    load_profile,
    profile_key,
    profile_memory,
    store_profile,
)
from trainer.config import ExecutorConfig
from trainer.engine import MultiLoraEngine
from trainer.fused_blocks import fused, mlp_rebuilds
from trainer.jobs import JobRun, TrainJob
from trainer.memory_model import (
    ARENA_SLACK,
    OnlineCorrection,
    Shapes,
    analytic_model,
    engine_terms,
    eval_fixed_bytes,
    eval_token_bytes,
    head_bytes,
    state_bytes_per_param,
)
from trainer.sft import Sft
from trainer.step_graphs import MAX_EVAL_CAPTURE_TOKENS
from trainer.strategy import Strategy

log = logging.getLogger("loraplex.executor")

# the share of device memory the adapter arenas may hold for no job before a step packs them: 5%
# (4 GB on an H100) is a few rank-64 jobs of an 8B model, so the packing (and the step graphs'
# captures it drops) comes once a search's warmup ranking evicted most of its configurations
ARENA_COMPACT_SHARE = 0.05


class MemoryPlan:
    """The memory model, admission and recompute policy of one executor (see the module
    docstring); built on the executor's loaded engine, it plans at once (`admission` is set)."""

    def __init__(self, cfg: ExecutorConfig, engine: MultiLoraEngine, device: torch.device,
                 objective: Sft, strategy: Strategy,
                 phase: Callable[[str], AbstractContextManager[None]],
                 parked_state: Callable[[str], JobRun | None]) -> None:
        self.cfg, self.engine, self.device = cfg, engine, device
        self.objective, self.strategy, self.phase = objective, strategy, phase
        self.parked_state = parked_state  # a job id -> its state parked by a hosted task, or None
        self.model: MemoryModel | None = None  # None: admission by a token budget (the CPU)
        self.recompute_policy: RecomputePolicy | None = None
        self.corrections: dict[bool, OnlineCorrection] = {}  # recompute on/off -> corrected online
        self.profile_reused: bool | None = None  # whether every stored profile it needs was there
        self.retries = 0  # steps run again after running out of device memory
        self.replays = 0  # steps replayed from a graph (their memory counted at its capture)
        self.recompute_steps = {"on": 0, "off": 0}
        self.split_steps = 0  # steps run as several passes without recompute (split_for)
        self.eval_retries = 0  # evaluations run again after running out of device memory
        self.arena_compactions = 0  # times compact_arena packed the arenas
        self.last_short = False  # the last step recomputed or ran as passes (short of memory)
        # a step's copy of the arena in the compute dtype, bytes an element (AdapterArena.layout_arenas)
        self.copy_per_param = 0.0 if engine.adapter_dtype == engine.compute_dtype else float(engine.compute_dtype.itemsize)
        self.admission = self._plan()
        # an evaluation forward's bytes per token and fixed part (one GPU; None: sized as a step)
        self.eval_per_token, self.eval_fixed = self._eval_model() if self.live and self.model else (None, 0.0)

    def _plan(self) -> AdmissionController:
        """The admission budget: on a GPU from the memory model (given, stored or built; with
        recompute "auto" also the model without it), elsewhere from max_tokens_per_step."""
        cfg, device = self.cfg, self.device
        if device.type != "cuda" or cfg.max_tokens_per_step is not None:
            per_item = cfg.max_seq_len * self.objective.sequences_per_item  # a DPO item: a pair
            return AdmissionController.from_token_budget(
                cfg.max_tokens_per_step or 1 << 60, per_item, cfg.max_active_jobs)
        budget = cfg.memory_budget_bytes or torch.cuda.get_device_properties(device).total_memory
        with self.phase("profile"):
            mm = MemoryModel(*cfg.memory_model) if cfg.memory_model else self.stored_model()
        # ranks measure slightly different peaks; all must decide alike: take the largest
        fits = self.strategy.gather((mm.k0, mm.k1))
        self.model = MemoryModel(max(f[0] for f in fits), max(f[1] for f in fits))
        live = self.live and not cfg.memory_model
        admission = AdmissionController(
            self.model, budget, cfg.max_seq_len, max_jobs=cfg.max_active_jobs,
            resident=self.step_resident if live else None, state_bytes=self.state_bytes if live else None)
        if cfg.gradient_checkpointing == "auto" and self.strategy.whole_engine and not cfg.memory_model:
            with self.phase("profile"):
                self.recompute_policy = self._without_recompute(admission)
        return admission

    def _without_recompute(self, admission: AdmissionController) -> RecomputePolicy | None:
        """The memory model without activation recompute (stored or built), as the policy that
        turns recompute off for steps it predicts to fit; None where it cannot be had."""
        eng = self.engine
        eng.set_recompute(False)
        try:
            without = self.stored_model(recompute=False)
        except (ValueError, RuntimeError) as e:
            log.info("no memory model without recompute (%s): recompute stays on", e)
            return None
        finally:
            eng.set_recompute(True)
        return RecomputePolicy(without, admission.limit_bytes, self.cfg.max_seq_len, admission.resident)

    @property
    def max_rank(self) -> int:
        """The largest LoRA rank among the executor's jobs (what every size here is planned for)."""
        return max(j.lora_rank for j in self.cfg.jobs)

    @property
    def n_targets(self) -> int:
        """How many kinds of linear the adapters target (q_proj, v_proj, ...)."""
        return len({name.rsplit(".", 1)[-1] for name in self.engine.shapes})

    @property
    def live(self) -> bool:
        """One GPU: admission reads what is resident at each decision (trainer.memory_model);
        ranks of adapter parallelism must decide alike: the static form there."""
        return self.strategy.whole_engine and self.device.type == "cuda"

    # ----- the model: stored, built or measured --------------------------------------------
    def profile_key(self, recompute: bool = True) -> str:
        """What this executor's memory profile depends on (see trainer.admission.profile_key)."""
        cfg, eng = self.cfg, self.engine
        try:
            config_text = (Path(cfg.model_dir) / "config.json").read_text()
        except OSError:
            config_text = None
        gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return profile_key(
            model_dir=str(Path(cfg.model_dir).resolve()), model_config=config_text,
            seq_len=cfg.max_seq_len, gpu=gpu, torch=torch.__version__, method=cfg.method,
            targets=sorted(eng.targets), gradient_checkpointing=recompute,
            adapter_dtype=cfg.adapter_dtype, backend=cfg.backend, ranks=self.strategy.world,
            max_lora_rank=self.max_rank, attention=eng.attention,
            memory_model="live-copy" if self.live else "static", fused_blocks=fused(eng.model), mlp_rebuild=mlp_rebuilds(eng.model))

    def stored_model(self, recompute: bool = True) -> MemoryModel:
        """The node's stored model for this key (measured or corrected by an earlier task), or
        the analytic one (no profiling pass); either is corrected online from the real steps."""
        key = self.profile_key(recompute)
        stored = load_profile(self.cfg.profile_cache, key)
        # every rank must agree to reuse (a torn read makes all build it); reused: every profile needed was
        reuse = all(self.strategy.gather(stored is not None))
        self.profile_reused = reuse if recompute else bool(self.profile_reused) and reuse
        mm = stored if reuse else self.analytic_model(recompute)
        if not reuse:  # the node knows it from now on (and as corrected by the steps, below)
            fits = self.strategy.gather((mm.k0, mm.k1))  # stored as the ranks will decide: the largest
            if self.strategy.rank == 0:
                store_profile(self.cfg.profile_cache, key,
                              MemoryModel(max(f[0] for f in fits), max(f[1] for f in fits)))
        if self.live:
            built = mm if not reuse else self.analytic_model(recompute)
            head = head_bytes(Shapes.of(self.engine.model.config), 1, engine_terms(self.engine)["fused_head"])
            self.corrections[recompute] = OnlineCorrection(mm, head, self.engine.head_chunk, floor_of=built.k1,
                                                           copy_per_param=self.copy_per_param)
        return mm

    def analytic_model(self, recompute: bool) -> MemoryModel:
        """trainer.memory_model.analytic_model for this engine and its jobs: the live form on one
        GPU, else the static form with what is resident now (a sharded backbone: with a gathered
        layer and the next one prefetched)."""
        eng = self.engine
        resident, per_rank = None, 0.0
        if not self.live:
            resident = float(torch.cuda.memory_allocated(self.device)) if self.device.type == "cuda" else 0.0
            layers = getattr(getattr(eng.model, "base_model", None), "layers", None)
            if self.strategy.world > 1 and layers:
                resident += 2 * sum(p.numel() * p.element_size() for p in layers[0].parameters())
            per_rank = eng.params_per_rank * state_bytes_per_param(eng.adapter_dtype.itemsize, self.copy_per_param)
        return analytic_model(eng.model.config, head_chunk=eng.head_chunk, max_rank=self.max_rank,
                              n_targets=self.n_targets, recompute=recompute,
                              sequences_per_item=self.objective.sequences_per_item, resident=resident,
                              state_bytes_per_rank=per_rank, fused=fused(eng.model), rebuild=mlp_rebuilds(eng.model),
                              **engine_terms(eng))

    def measured_model(self, batches: tuple[int, ...] = (1, 2, 4)) -> MemoryModel:
        """A profiling pass (CUDA): the peak of `probe_step` at a few total batches, fitted."""
        return fit_memory_model(profile_memory(self.probe_step, batches, self.cfg.max_seq_len))

    def probe_step(self, total_batch: int) -> None:
        """One full training step of a throwaway job of the largest rank at `total_batch`
        sequences of max_seq_len tokens (DPO: pairs, reference pass included); leaves the engine
        as it found it."""
        eng, cfg = self.engine, self.cfg
        g = torch.Generator().manual_seed(0)
        vocab = eng.model.get_input_embeddings().num_embeddings
        rows = torch.randint(0, vocab, (total_batch, cfg.max_seq_len), generator=g).tolist()
        probe = self.objective.probe_items(rows, cfg.max_seq_len)
        saved, eng.train_examples = eng.train_examples, probe
        try:
            eng.attach(TrainJob("__probe__", lora_rank=self.max_rank, learning_rate=0.0,
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
            self.objective.forget(eng, probe)

    # ----- what admission reads (one GPU, the live form) -------------------------------------
    def resident_bytes(self) -> float:
        """Live tensors, and the step graphs' pool (its blocks serve only the replays)."""
        graphs = self.engine.step_graphs
        return float(torch.cuda.memory_allocated(self.device)) + (graphs.pool_bytes if graphs else 0)

    def step_copy(self) -> float:
        """The arena's copy a training step makes (every job's region: ~5 GB for a search's 48
        jobs of the 8B shape, uncounted until session 39)."""
        return self.copy_per_param * self.engine.slots.arena.numel()

    def step_resident(self) -> float:
        """Admission's and the recompute policy's resident: what is, and a step's arena copy."""
        return self.resident_bytes() + self.step_copy()

    def state_bytes(self, job: JobLike) -> float:
        """A job's (a TrainJob, a started job's slot) device bytes on attaching (one parked on the device: its gradient)."""
        eng = self.engine
        per_rank = eng.params_per_rank
        rank = getattr(job, "lora_rank", None)
        if rank is None:  # a started job resuming from its park
            state = self.parked_state(job.job_id)
            if state is None:
                return 0.0
            if state.adapter.flat.is_cuda:
                return (4.0 + self.copy_per_param) * per_rank * state.adapter.rank * ARENA_SLACK
            rank = state.adapter.rank
        return per_rank * rank * state_bytes_per_param(eng.adapter_dtype.itemsize, self.copy_per_param)

    # ----- evaluation forwards (one GPU, the live form) ---------------------------------------
    def _eval_model(self) -> tuple[float, float]:
        config = self.engine.model.config
        return (eval_token_bytes(config, self.n_targets, self.max_rank),
                eval_fixed_bytes(config, self.engine.head_chunk, engine_terms(self.engine)["fused_head"]))

    def eval_tokens(self) -> int | None:
        """Tokens one evaluation forward may hold now: the room under admission's limit (what is
        resident read live: the graphs' pool, the evaluation's arena copy) less a forward's fixed
        part, over a no-grad forward's bytes per token (trainer.memory_model.eval_token_bytes;
        raised by evaluations that peaked above it). None: sized as a training step (ranks that
        must decide alike; the CPU; after two evaluations ran out of memory)."""
        if self.eval_per_token is None:
            return None
        # what is resident, not admission's step_resident: an evaluation makes no step's arena copy
        room = self.admission.limit_bytes - (self.resident_bytes() if self.admission.resident is not None else 0.0)
        return max(0, int((room - self.eval_fixed) / self.eval_per_token))

    def eval_job_tokens(self) -> int:
        """What a job adds to an evaluation forward beside its tokens, in tokens' worth: its
        adapter's copy in the compute dtype (AdapterArena.compute_copy; the largest rank's)."""
        if self.eval_per_token is None or not self.copy_per_param:
            return 0
        return math.ceil(self.engine.params_per_rank * self.max_rank * self.copy_per_param / self.eval_per_token)

    def evaluation(self, run: Callable[[], tuple[Any, int]], relieve: Callable[[], bool] | None = None) -> Any:
        """An evaluation's forwards, sized by eval_tokens when `run` plans them: `run` returns its
        result and its largest forward's tokens. The allocator's peak over it raises the bytes
        per token when above them. One that runs out of device memory runs again with them
        doubled; then, where `relieve` frees device memory (parked states to the host), with
        that; then sized as a training step. After it the allocator's free cached blocks go back
        (session 25: fragments of them left no 5.4 GB whole for a step's arena copy)."""
        if self.eval_per_token is None:
            return run()[0]
        torch.cuda.reset_peak_memory_stats(self.device)
        self.peak_floor = 0  # a peak before a reset inside it (captures ahead: trainer.task_eval.ahead)
        before = torch.cuda.memory_allocated(self.device)
        try:
            out, tokens = run()
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            self.eval_retries += 1
            if self.eval_retries == 1:
                self.eval_per_token *= 2
            elif relieve is None or not relieve():
                self.eval_per_token = None
            log.warning("an evaluation ran out of device memory: run again %s", "sized as a training step"
                        if self.eval_per_token is None else "with fewer tokens a forward or more room")
            return self.evaluation(run, relieve)
        seen = (max(torch.cuda.max_memory_allocated(self.device), self.peak_floor) - before - self.eval_fixed) / max(1, tokens)
        if tokens > MAX_EVAL_CAPTURE_TOKENS and seen > self.eval_per_token:  # a large forward's peak
            self.eval_per_token = seen * 1.05
        torch.cuda.empty_cache()
        return out

    # ----- each step ----------------------------------------------------------------------
    def recompute_for(self, tokens: int, padding: float = 1.25) -> bool | None:
        """The engine's hook (`engine.recompute_for`): recompute on or off from a step's own
        tokens once it has drawn them (RecomputePolicy.recompute_tokens); `padding`: the allowance
        for the row's length over them (1.0: the row itself, a graphed step's key). None without
        a policy: the setting stays."""
        if self.recompute_policy is None:
            return None
        return self.recompute_policy.recompute_tokens(tokens, padding)

    def capture_bytes(self, tokens: int, recompute: bool) -> float | None:
        """A capture's pool (StepGraphs.capture_need): activations without recompute, the step's arena copy."""
        policy = self.recompute_policy
        return None if recompute or policy is None else policy.without.k1 * tokens + self.step_copy()

    def split_for(self, job_tokens: list[int]) -> list[list[int]] | None:
        """The engine's hook (`engine.split_for`): a step that one pass could run only with
        recompute runs as passes over its jobs that each fit without (RecomputePolicy.passes;
        session 33, H100: 1.83 s against 2.11 s recomputed). None: one pass; without a policy
        (several ranks) always; with LORAPLEX_SPLIT_STEPS=0."""
        if self.recompute_policy is None or os.environ.get("LORAPLEX_SPLIT_STEPS", "1") == "0":
            return None
        return self.recompute_policy.passes(job_tokens)

    def compact_arena(self) -> None:
        """Before a step (one GPU) after one that was short of memory (it recomputed or ran as
        passes): where the adapter arenas hold at least ARENA_COMPACT_SHARE of the device for no
        job, pack them (AdapterArena.compact) and drop the step graphs (their captures point at the
        old arenas) with their pool. Steps that had room keep their captures (session 33)."""
        if not self.live or not self.last_short:
            return
        total = torch.cuda.get_device_properties(self.device).total_memory
        freed = self.engine.slots.compact(int(ARENA_COMPACT_SHARE * total))
        if freed:
            if self.engine.step_graphs is not None:
                self.engine.step_graphs.reset()
            torch.cuda.empty_cache()
            self.arena_compactions += 1
            log.info("adapter arenas packed: %.2f GB back to the device", freed / 1e9)

    def step_start(self) -> int | None:
        """Before a step: the arenas packed where they hold much for no job (compact_arena); the
        allocator's resident bytes, its peak reset (None: not watched)."""
        self.compact_arena()
        if not self.corrections:
            return None
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def train_step(self) -> Any:
        """The engine's step (its StepReport); one that runs out of device memory (the model
        under-predicted it) is run again with recompute on and the model widened by half
        (admission then admits less; the jobs' batches of the failed attempt are drawn anew)."""
        try:
            return self.engine.step()
        except torch.cuda.OutOfMemoryError:
            if not self.corrections:
                raise
            log.warning("a step ran out of device memory: recompute on, the memory model widened")
            torch.cuda.empty_cache()
            self.retries += 1
            for recompute, corr in self.corrections.items():
                corr.model = MemoryModel(corr.model.k0, corr.model.k1 * 1.5)
                if recompute:
                    self.model = self.admission.model = corr.model
            if self.recompute_policy is not None and False in self.corrections:
                self._without_recompute_is(self.corrections[False].model)
            self.engine.set_recompute(True)
            return self.engine.step()

    def step_end(self, resident: int | None, report: Any) -> None:
        """After a step (its StepReport, None where this rank ran none): the step counted by
        recompute, its peak against the model; a corrected model goes to admission (and the
        recompute policy) and is stored for the node's later tasks (rank 0, one GPU)."""
        recompute = bool(self.engine.gradient_checkpointing)
        split = bool(report is not None and report.pass_cells)
        self.last_short = recompute or split
        self.recompute_steps["on" if recompute else "off"] += 1
        self.split_steps += split
        corr = self.corrections.get(recompute)
        if resident is None or corr is None or report is None:
            return
        graphs = self.engine.step_graphs
        if graphs is not None and graphs.last_replayed:
            self.replays += 1  # its memory is the pool's, counted when it was captured
            return
        # a step of several passes peaks in its largest one (each frees its activations)
        cells = (max(report.pass_cells) if report.pass_cells
                 else round(report.tokens / max(1e-9, 1.0 - report.padded_fraction)))
        peak = torch.cuda.max_memory_allocated(self.device)
        after = torch.cuda.memory_allocated(self.device)
        if not corr.observe(cells, recompute, resident, peak, self.engine.slots.arena.numel(), after):
            return
        if recompute:
            self.model = self.admission.model = corr.model
        elif self.recompute_policy is not None:
            self._without_recompute_is(corr.model)
        if self.strategy.rank == 0:
            store_profile(self.cfg.profile_cache, self.profile_key(recompute), corr.model)

    def _without_recompute_is(self, model: MemoryModel) -> None:
        policy = self.recompute_policy
        assert policy is not None
        self.recompute_policy = replace(policy, without=model)  # its spare bytes and release kept

    def timings(self) -> dict[str, Any]:
        """The memory plan's details of the timings report: whether the profile was reused, the
        steps with and without recompute and, where the allocator saw steps, how the model did."""
        out = {"profile_reused": self.profile_reused, "recompute_steps": self.recompute_steps["on"],
               "no_recompute_steps": self.recompute_steps["off"], "split_steps": self.split_steps,
               "eval_retries": self.eval_retries, "arena_compactions": self.arena_compactions,
               "eval_bytes_per_token": None if self.eval_per_token is None else round(self.eval_per_token)}
        seen = [p for c in self.corrections.values() for p in c.trace if p.peak > p.resident]
        if seen:
            worst = max(seen, key=lambda p: abs(p.predicted - p.peak) / p.peak)
            out.update(memory_steps_checked=len(seen), memory_retries=self.retries, memory_replays=self.replays,
                       memory_model_error=abs(worst.predicted - worst.peak) / worst.peak,
                       memory_worst_cells=worst.tokens, memory_worst_recompute=bool(worst.recompute),
                       memory_worst_resident=worst.resident, memory_worst_peak=worst.peak,
                       memory_worst_predicted=round(worst.predicted))
            # the last 64 steps the allocator saw, for whoever tunes the model: [cells, recompute,
            # resident, peak, predicted] in MB and the arena's elements in millions
            log.info("memory trace steps=%s", json.dumps([
                [p.tokens, int(p.recompute), p.resident >> 20, p.peak >> 20, round(p.predicted) >> 20,
                 round(p.adapter_params / 1e6)] for p in seen[-64:]]))
        return out


def allocator_counts(device: torch.device | None) -> dict[str, int]:
    """The caching allocator's retries on a GPU (a full device: its cached blocks freed and the
    allocation tried again, each a device sync) and its cudaMalloc calls, since the process
    began; nothing elsewhere."""
    if device is None or device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "device_mallocs": int(stats.get("num_device_alloc", 0))}
