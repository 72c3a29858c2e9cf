"""The executor recipe: load the base model, build the multi-LoRA engine (SFT or DPO), read the
data, admit jobs, loop training steps with periodic evaluation, early exit, ranking, checkpoints.

Read top to bottom in `Executor.run`. Everything reaches the outside world through `Callbacks`
(the node daemon forwards them to the service); resuming from `output_dir/state.pt` is exact.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from service.protocol import EarlyExitSettings, EvalSettings
from trainer.admission import AdmissionController, MemoryModel, fit_memory_model, profile_memory
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
from trainer.engine import JobSpec, JobState, MultiLoraEngine
from trainer.export import export_peft

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
    eval_batch_size: int = 8
    checkpoint_every: int = 50
    targets: tuple[str, ...] | None = None  # None: the model family's defaults
    gradient_checkpointing: bool = True
    device: str = "auto"
    backend: str = "auto"
    adapter_dtype: str = "float32"
    max_active_jobs: int | None = None
    max_tokens_per_step: int | None = None  # admission budget without a memory model (CPU)
    memory_model: tuple[float, float] | None = None  # (k0, k1) from a profiling run
    memory_budget_bytes: float | None = None
    early_exit: EarlyExitSettings = field(default_factory=EarlyExitSettings)
    stop_after_steps: int | None = None  # stop (as if killed) after this many executor steps
    method: str = "sft"  # sft | dpo (preference pairs; JobSpec.beta per job)
    world_size: int = 1  # GPUs of the placement; > 1: adapter parallelism (FSDP2 backbone)


class Executor:
    """Runs all jobs of one task to completion on one engine; see the module docstring."""

    def __init__(self, cfg: ExecutorConfig, callbacks: Callbacks | None = None) -> None:
        self.cfg = cfg
        self.cb = callbacks or Callbacks()
        self.out = Path(cfg.output_dir)
        self.status: dict[str, dict[str, Any]] = {
            j.job_id: {"state": "pending", "exit_reason": None} for j in cfg.jobs
        }
        self.monitors = {j.job_id: JobMonitor(cfg.early_exit) for j in cfg.jobs}
        ranked = cfg.early_exit.enabled and len(cfg.jobs) > 1
        self.ranking = WarmupRanking([j.job_id for j in cfg.jobs], cfg.early_exit.keep_fraction) if ranked else None
        self.queue: list[JobSpec | JobState] = list(cfg.jobs)  # never started, then parked
        self.global_step = 0
        self.last_eval: dict[str, int] = {}
        self.padded: list[float] = []  # padded-token fraction per step since the last checkpoint

    # ----- setup -------------------------------------------------------------------------
    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cfg = self.cfg
        device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available()
                              else ("cpu" if cfg.device == "auto" else cfg.device))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if cfg.method not in ("sft", "dpo"):
            raise ValueError(f"unknown method {cfg.method!r}; expected 'sft' or 'dpo'")
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
        model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=dtype).to(device)
        tokenize = tokenize_pairs if cfg.method == "dpo" else tokenize_all
        train = tokenize(self.tokenizer, read_jsonl(cfg.train_file), cfg.max_seq_len)
        if cfg.val_file:
            val = tokenize(self.tokenizer, read_jsonl(cfg.val_file), cfg.max_seq_len)
        else:
            train, val = split_validation(train, cfg.val_fraction, cfg.split_seed)
        if not train or not val:
            raise ValueError("no trainable examples left after tokenisation/truncation")
        self.val = val
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        engine_cls = DpoEngine if cfg.method == "dpo" else MultiLoraEngine
        self.engine = engine_cls(
            model, train, pad, cfg.targets, cfg.gradient_checkpointing, cfg.backend,
            getattr(torch, cfg.adapter_dtype),
        )
        if device.type == "cuda" and cfg.max_tokens_per_step is None:
            budget = cfg.memory_budget_bytes or torch.cuda.get_device_properties(device).total_memory
            mm = MemoryModel(*cfg.memory_model) if cfg.memory_model else self._profile_memory_model()
            self.cb.on_event("", "memory_model", {"k0": mm.k0, "k1": mm.k1, "budget_bytes": budget})
            self.admission = AdmissionController(mm, budget, cfg.max_seq_len, max_jobs=cfg.max_active_jobs)
        else:
            # a DPO batch item is a pair: two sequences of up to max_seq_len tokens
            per_item = cfg.max_seq_len * (2 if cfg.method == "dpo" else 1)
            self.admission = AdmissionController.from_token_budget(
                cfg.max_tokens_per_step or 1 << 60, per_item, cfg.max_active_jobs)
        self.cb.on_event("", "executor_loaded", {"train": len(train), "val": len(val), "device": str(device)})

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

    # ----- the recipe --------------------------------------------------------------------
    def run(self) -> dict[str, dict[str, Any]]:
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
            self._admit()
            done = [j for j, s in self.engine.jobs.items() if s.done]
            for job_id in done:  # e.g. a parked job whose warmup was its whole run
                self._finish(job_id)
            if done:
                continue
            if not self.engine.jobs:
                break
            report = self.engine.step()
            self.global_step += 1
            self.padded.append(report.padded_fraction)
            for job_id, loss in report.losses.items():
                step = report.steps[job_id]
                if report.metrics.get(job_id):
                    self.cb.on_metrics(job_id, step, "train", report.metrics[job_id])
                self.cb.on_train_loss(job_id, step, loss)
                if report.skipped[job_id]:
                    self.cb.on_event(job_id, "update_skipped", {"step": step, "loss": loss,
                                                                "grad_norm": report.grad_norms[job_id]})
                decision = self.monitors[job_id].observe_train(step, loss)
                if decision is not None:
                    self._exit(job_id, decision)
            self._evaluate_due()
            self._warmup_policy()
            for job_id in [j for j, s in self.engine.jobs.items() if s.done]:
                self._finish(job_id)
            if self.global_step % self.cfg.checkpoint_every == 0:
                self._checkpoint()
            if self.cfg.stop_after_steps is not None and self.global_step >= self.cfg.stop_after_steps:
                self._checkpoint()
                return self.status
        self._checkpoint()
        return self.status

    # ----- pieces of the loop --------------------------------------------------------------
    def _admit(self) -> None:
        ranking_open = self.ranking is not None and self.ranking.result is None
        # during warmup only never-started jobs rotate in; parked ones wait for the ranking
        candidates = [q for q in self.queue if not (ranking_open and isinstance(q, JobState))]
        running = list(self.engine.jobs.values())
        for job_id in self.admission.admit(candidates, running):
            item = next(q for q in self.queue if q.job_id == job_id)
            self.queue.remove(item)
            self.engine.attach(item)
            if self.status[job_id]["state"] != "running":
                self._set_state(job_id, "running", {"resumed": isinstance(item, JobState)})

    def _evaluate_due(self) -> None:
        due = []
        for job_id, s in self.engine.jobs.items():
            warm_end = self._warmup_len(s) if self._in_warmup(job_id) else -1
            if s.step % self.cfg.eval_every == 0 or s.done or s.step == warm_end:
                if self.last_eval.get(job_id) != s.step:
                    due.append(job_id)
        if not due:
            return
        step_batch = sum(s.batch_size for s in self.engine.jobs.values())
        metrics = self.engine.evaluate_metrics(self.val, self.cfg.eval_batch_size, due,
                                               max_sequences=max(step_batch, self.cfg.eval_batch_size))
        for job_id, numbers in metrics.items():
            s = self.engine.jobs[job_id]
            self.last_eval[job_id] = s.step
            val = numbers["loss"]  # DPO: the validation DPO loss, for the same detectors
            extra = {k: v for k, v in numbers.items() if k != "loss"}
            if extra:
                self.cb.on_metrics(job_id, s.step, "val", extra)
            self.cb.on_eval(job_id, s.step, val)
            mon = self.monitors[job_id]
            decision = mon.observe_eval(s.step, val)
            if mon.last_eval_was_best:
                self._export(job_id, "best")
            if decision is not None:
                self._exit(job_id, decision)

    def _warmup_len(self, s: JobState) -> int:
        return self.cfg.early_exit.warmup_steps(s.total_steps)

    def _in_warmup(self, job_id: str) -> bool:
        return self.ranking is not None and job_id in self.ranking.waiting

    def _warmup_policy(self) -> None:
        if self.ranking is None or self.ranking.result is not None:
            return
        fresh_waiting = any(isinstance(q, JobSpec) for q in self.queue)
        for job_id, s in list(self.engine.jobs.items()):
            if self._in_warmup(job_id) and s.step >= self._warmup_len(s):
                self.ranking.report(job_id, self.monitors[job_id].eval_val[-1]
                                    if self.monitors[job_id].eval_val else math.inf)
                if fresh_waiting:  # rotate: park it so a queued configuration gets its warmup
                    self.queue.append(self.engine.detach(job_id, park_device="cpu"))
                    self.cb.on_event(job_id, "parked_after_warmup", {"step": s.step})
        if self.ranking.ready:
            keep, evict = self.ranking.decide()
            self.cb.on_event("", "warmup_ranking", {"keep": keep, "evict": evict})
            for job_id in evict:
                self._exit(job_id, ExitDecision("underperforming", {"kept": keep}))

    def _exit(self, job_id: str, decision: ExitDecision) -> None:
        if self.status[job_id]["state"] in ("exited", "completed", "failed"):
            return
        if job_id in self.engine.jobs:
            self.engine.detach(job_id)
        self.queue = [q for q in self.queue if q.job_id != job_id]
        if self._in_warmup(job_id):
            self.ranking.exit(job_id)
        self.status[job_id]["exit_reason"] = decision.reason
        self._set_state(job_id, "exited", {"exit_reason": decision.reason, **decision.details})

    def _finish(self, job_id: str) -> None:
        state = self.engine.detach(job_id)
        self._export(job_id, "final", state)
        self._set_state(job_id, "completed", {"steps": state.step, "best_val": self.monitors[job_id].best_val})

    def _export(self, job_id: str, kind: str, state: JobState | None = None) -> None:
        state = state or self.engine.jobs[job_id]
        path = export_peft(state.adapter, self.out / "jobs" / job_id / kind, list(self.cfg.targets),
                           self.cfg.model_dir, metadata={"step": str(state.step)})
        self.cb.on_adapter(job_id, kind, path)

    def _set_state(self, job_id: str, state: str, details: dict) -> None:
        self.status[job_id]["state"] = state
        log.info("job=%s state=%s details=%s", job_id, state, details)
        self.cb.on_job_state(job_id, state, details)

    # ----- checkpoints -------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        if self.padded:
            self.cb.on_event("", "throughput", {
                "global_step": self.global_step,
                "padded_fraction": sum(self.padded) / len(self.padded),
                "active_jobs": len(self.engine.jobs),
            })
            self.padded = []
        active = [job_state_dict(s) for s in self.engine.jobs.values()]
        queued = [job_state_dict(q) if isinstance(q, JobState) else {"fresh": q} for q in self.queue]
        save_checkpoint(self.out / "state.pt", {
            "active": active, "queue": queued, "status": self.status, "monitors": self.monitors,
            "ranking": self.ranking, "global_step": self.global_step, "last_eval": self.last_eval,
            "rng": rng_state(),
            # DPO: the reference log-probs (2 floats per pair), so a resumed run reuses them
            **({"reference": self.engine.reference_state()} if isinstance(self.engine, DpoEngine) else {}),
        })

    def _resume(self, ck: dict[str, Any]) -> None:
        for d in ck["active"]:
            self.engine.attach(restore_job(self.engine, d))
        self.queue = [q["fresh"] if "fresh" in q else restore_job(self.engine, q).to("cpu") for q in ck["queue"]]
        self.status, self.monitors, self.ranking = ck["status"], ck["monitors"], ck["ranking"]
        self.global_step, self.last_eval = ck["global_step"], ck["last_eval"]
        if isinstance(self.engine, DpoEngine) and "reference" in ck:
            self.engine.load_reference_state(ck["reference"])
        set_rng_state(ck["rng"])
        self.cb.on_event("", "resumed", {"global_step": self.global_step})


def run_executor(cfg: ExecutorConfig, callbacks: Callbacks | None = None,
                 should_stop: Callable[[], bool] | None = None) -> dict[str, dict[str, Any]]:
    """Run one task with the strategy its placement asks for: this process on one GPU, or
    `cfg.world_size` ranks (one process per GPU) with the backbone sharded (adapter parallelism).
    Returns every job's final status."""
    if cfg.world_size > 1:
        from trainer.parallel import run_parallel

        return run_parallel(cfg, cfg.world_size, callbacks, should_stop)
    return Executor(cfg, callbacks).run()


def main(argv: list[str] | None = None) -> None:
    """`python -m trainer.executor config.json`: run one task, printing callbacks as JSON lines."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(description="Run one task's jobs on this machine.")
    parser.add_argument("config", help="JSON file with ExecutorConfig fields; jobs as a list of JobSpec dicts")
    args = parser.parse_args(argv)
    raw = json.loads(Path(args.config).read_text())
    raw["jobs"] = [JobSpec(**{**j, "betas": tuple(j.get("betas", (0.9, 0.999)))}) for j in raw["jobs"]]
    if "early_exit" in raw:
        raw["early_exit"] = EarlyExitSettings(**raw["early_exit"])
    if "targets" in raw:
        raw["targets"] = tuple(raw["targets"])

    def emit(kind: str) -> Callable[..., None]:
        def f(job_id: str, *rest: Any) -> None:
            print(json.dumps({"kind": kind, "job": job_id, "data": [str(r) if isinstance(r, Path) else r
                                                                    for r in rest]}, default=str))
            sys.stdout.flush()
        return f

    cb = Callbacks(emit("train_loss"), emit("eval"), emit("job_state"), emit("adapter"), emit("event"),
                   emit("metrics"))
    status = Executor(ExecutorConfig(**raw), cb).run()
    print(json.dumps({"kind": "done", "status": status}))


if __name__ == "__main__":
    main()
