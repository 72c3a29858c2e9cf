"""Runs of bench/baselines.py's arms: one configuration from attach to detach (c1, c2), synchronous
successive halving with loraplex's warmup-ranking rung (c3), each timed in training segments and
evaluations; and the step-0 check of every arm's loss against loraplex's engine."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines import TARGETS, Arm, JobRun, arm_model, sync  # noqa: E402
from baselines_policy import EvalPolicy  # noqa: E402

from trainer.data import Example, JobDataStream  # noqa: E402
from trainer.early_exit import warmup_ranking  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402
from trainer.varlen import flash_varlen_available  # noqa: E402


# ----------------------------------------------------------------------------- one configuration
@dataclass
class ConfigRecord:
    """What one configuration's run produced and where its time went (seconds, device-synced
    at the boundaries of training segments and evaluations only)."""

    train: dict[int, float] = field(default_factory=dict)
    val: dict[int, float] = field(default_factory=dict)
    eval_sizes: dict[int, int] = field(default_factory=dict)
    setup_s: float = 0.0
    train_s: float = 0.0
    eval_s: float = 0.0
    park_s: float = 0.0
    teardown_s: float = 0.0
    tokens: int = 0
    steps: int = 0
    rung_train_s: float | None = None  # training seconds up to and including the rung step
    eval_durations: list[tuple[int, float]] = field(default_factory=list)  # (size, seconds)


def train_to(run: JobRun, policy: EvalPolicy, stop: int, val: Sequence[Example], rec: ConfigRecord,
             rung: int | None = None) -> None:
    """Train the job's steps up to `stop`, evaluating where the policy says (on the leading
    subset of the validation set, as the executor); `rung`: note the training time there."""
    dev, bs = run.dev, run.spec.batch_size
    sync(dev)
    t0 = time.perf_counter()
    while run.step < stop:
        rec.tokens += run.train_step()
        rec.steps += 1
        at_rung = run.step == rung
        if policy.due(run.step, run.total, bs) or at_rung:
            sync(dev)
            t1 = time.perf_counter()
            rec.train_s += t1 - t0
            if at_rung:
                rec.rung_train_s = rec.train_s
            if policy.due(run.step, run.total, bs):
                size = policy.size(run.step, run.last_eval, run.total, bs)
                rec.train.update(run.train_losses())
                rec.val[run.step] = run.evaluate(val[:size])
                rec.eval_sizes[run.step] = size
                run.last_eval = run.step
                t0 = time.perf_counter()
                rec.eval_s += t0 - t1
                rec.eval_durations.append((size, t0 - t1))
            else:
                t0 = time.perf_counter()
    sync(dev)
    rec.train_s += time.perf_counter() - t0
    rec.train.update(run.train_losses())


def run_config(model: torch.nn.Module, spec: TrainJob, arm: Arm, train: Sequence[Example],
               val: Sequence[Example], policy: EvalPolicy, pad_id: int,
               init: dict[str, torch.Tensor] | None = None) -> tuple[torch.nn.Module, ConfigRecord]:
    """One configuration from attach to detach (c1, c2): (the base model back, its record)."""
    rec = ConfigRecord()
    dev = next(model.parameters()).device
    sync(dev)
    t0 = time.perf_counter()
    run = JobRun(model, spec, arm, train, pad_id, init)
    sync(dev)
    rec.setup_s = time.perf_counter() - t0
    try:
        # the rung's training time is noted (one extra sync): (c3)'s time is extrapolated from it
        train_to(run, policy, run.total, val, rec, rung=policy.ee.warmup_steps(run.total))
    except BaseException:
        run.close()  # PEFT unloads in place: the caller's model is the bare model again
        raise
    t0 = time.perf_counter()
    model = run.close()
    sync(dev)
    rec.teardown_s = time.perf_counter() - t0
    return model, rec


def successive_halving(model: torch.nn.Module, jobs: Sequence[TrainJob], arm: Arm,
                       train: Sequence[Example], val: Sequence[Example], policy: EvalPolicy,
                       pad_id: int, inits: Callable[[TrainJob], dict | None] = lambda _: None,
                       ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """(c3) Synchronous successive halving, one configuration at a time: rung 0 trains every
    configuration to its warmup budget (policy.rung: loraplex's warmup_steps of its own steps)
    and evaluates it on the ranking's subset, parking its state on the host; the ranking keeps
    the ceil(keep_fraction n) lowest validation losses (trainer.early_exit.warmup_ranking: NaN
    last, ties in grid order); the kept configurations resume and train to the end. A
    configuration whose rung is its last step completes in rung 0. Deterministic."""
    if policy.ranking_samples is None:
        raise ValueError("successive halving needs a policy with the ranking's rung")
    dev = next(model.parameters()).device
    records = {j.job_id: ConfigRecord() for j in jobs}
    parked: dict[str, dict] = {}
    rung_loss: dict[str, float] = {}
    for spec in jobs:
        rec = records[spec.job_id]
        sync(dev)
        t0 = time.perf_counter()
        run = JobRun(model, spec, arm, train, pad_id, inits(spec))
        rec.setup_s += time.perf_counter() - t0
        rung = policy.rung(run.total)
        train_to(run, policy, rung, val, rec, rung=rung)
        rung_loss[spec.job_id] = rec.val[rung]
        t0 = time.perf_counter()
        if rung < run.total:
            model, parked[spec.job_id] = run.park()
            rec.park_s += time.perf_counter() - t0
        else:
            model = run.close()
            rec.teardown_s += time.perf_counter() - t0
    keep, evict = warmup_ranking(rung_loss, policy.ee.keep_fraction)
    for spec in jobs:
        if spec.job_id not in keep or spec.job_id not in parked:
            continue
        rec = records[spec.job_id]
        t0 = time.perf_counter()
        run = JobRun(model, spec, arm, train, pad_id, parked=parked.pop(spec.job_id))
        sync(dev)
        rec.setup_s += time.perf_counter() - t0
        train_to(run, policy, run.total, val, rec)
        t0 = time.perf_counter()
        model = run.close()
        sync(dev)
        rec.teardown_s += time.perf_counter() - t0
    return model, {"keep": keep, "evict": evict, "rung_loss": rung_loss, "records": records}


# ----------------------------------------------------------------------------- the engine's loss
def uninject(engine: Any) -> None:
    """Put the engine's model back as it was loaded: its MultiLoraLinear layers replaced by their
    base linears, its own attention again (the model can then serve PEFT runs)."""
    model = engine.model
    for name, layer in engine.layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer.base)
    engine.set_attention("rows")
    engine.jobs.clear()


def step0_losses(model: torch.nn.Module, spec: TrainJob, train: Sequence[Example], pad_id: int,
                 arms: Sequence[Arm], perturb: float = 0.02) -> dict[str, Any]:
    """The loss of the job's first micro-batch before any update, from loraplex's engine
    (MultiLoraEngine with this one job attached: its step 0 report) and from each arm's PEFT run
    from the same init; and the same with the same nonzero B in every adapter (B = 0 at init
    makes LoRA a no-op: this one exercises the LoRA path, its scaling and targets)."""
    from trainer.engine import MultiLoraEngine

    batch = [train[i] for i in JobDataStream(len(train), spec.seed).next_indices(spec.batch_size)]
    cuda = next(model.parameters()).is_cuda
    engine = MultiLoraEngine(model, train, pad_id, targets=TARGETS, gradient_checkpointing=False,
                             attention="varlen" if cuda and flash_varlen_available() else "rows")
    state = engine.attach(spec)
    init = {k: v.detach().clone().cpu() for k, v in state.adapter.peft_state_dict().items()}
    g = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for b in state.adapter.lora_b:
            b.copy_(torch.randn(b.shape, generator=g) * perturb)
    lora = {k: v.detach().clone().cpu() for k, v in state.adapter.peft_state_dict().items()}
    out = {"job": spec.job_id, "batch": len(batch), "tokens": sum(len(e.input_ids) for e in batch),
           "engine_attention": engine.attention,
           "engine_lora": engine.evaluate(batch, batch_size=len(batch))[spec.job_id]}
    with torch.no_grad():
        for b in state.adapter.lora_b:
            b.zero_()
    out["engine"] = engine.step().losses[spec.job_id]
    uninject(engine)
    del engine, state
    for arm in arms:
        with arm_model(model, arm):
            for key, weights in ((arm.name, init), (f"{arm.name}_lora", lora)):
                run = JobRun(model, spec, arm, train, pad_id, weights)
                with torch.no_grad():
                    out[key] = float(run.loss(batch))
                model = run.close()
    return out


def check_verdict(out: dict[str, Any], arms: Sequence[str], fp32: bool) -> dict[str, Any]:
    """Whether each arm's step-0 losses equal the engine's: |delta| <= 1e-4 (float32) or
    <= 1e-2 x loss (bf16: a bf16 ulp is 2^-8 of a value, summed over the model's depth)."""
    verdict = {}
    for arm in arms:
        for suffix in ("", "_lora"):
            mine, ref = out.get(arm + suffix), out.get("engine" + suffix)
            if mine is None or ref is None:
                continue
            tol = 1e-4 if fp32 else 1e-2 * max(1.0, abs(ref))
            verdict[arm + suffix] = {"delta": mine - ref, "tol": tol,
                                     "ok": math.isfinite(mine) and abs(mine - ref) <= tol}
    return verdict
