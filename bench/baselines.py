"""The sequential baselines of issue 33, one configuration at a time with PEFT (no multi-LoRA
engine), on the same data, grid, evaluation policy and optimizer as loraplex's executor:

  (c1) plain PEFT as a first-time user writes it (bench/task_e2e.py's `peft_job`): padded rows
       with an attention mask, activation checkpointing, adapters in float32 without autocast;
  (c2) the strong sequential baseline: each micro-batch packed into ONE row without padding
       (transformers' DataCollatorWithFlattening: sequences back to back, position ids restarting,
       label -100 on each sequence's first token), attention by sequence bounds with torch's flash
       varlen kernel (trainer.varlen, the kernel FA2's varlen path is), Liger's RMSNorm, RoPE,
       SwiGLU and fused linear cross-entropy, bf16 autocast over float32 adapters, fused AdamW,
       SDPA's cuDNN backend off (the varlen flash path never calls cuDNN; the switch only matters
       where attention falls back to SDPA), activation checkpointing only for the batch sizes
       whose worst micro-batch does not fit without it (probed once);
  (c3) (c2) under synchronous successive halving with loraplex's warmup-ranking rung: every
       configuration trains to its warmup budget (EarlyExitSettings.warmup_steps: 5% of its steps)
       and is evaluated on the ranking's subset, the top keep_fraction (25%, trainer.early_exit's
       own rule) resume from their parked state and train to the end.

Every run starts from the engine's own adapter init (trainer.multilora.JobAdapter, the job's
seed) where quality matters, reads batches in the job's data order (JobDataStream), and uses the
job's AdamW hyperparameters and LR schedule (trainer.jobs.lr_factor) with grad-norm clipping.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from contract.protocol import EarlyExitSettings, EvalSettings
from trainer.colocate import eval_subset_size
from trainer.data import IGNORE, Example, JobDataStream
from trainer.early_exit import warmup_ranking
from trainer.jobs import JobSpec, lr_factor
from trainer.varlen import flash_varlen_available, register_varlen

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
REPO = Path(__file__).resolve().parents[1]
SEED_STRIDE = 1000  # --seed s: job seeds index + 1000 s (s = 0: bench/task_e2e.py's jobs)
PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ----------------------------------------------------------------------------- grids
def grid48(n_train: int, seed: int = 0) -> list[JobSpec]:
    """48 configurations, learning rate x batch size x rank, full factorial: lr 1e-4..1e-1 (the
    last one diverges), batch sizes 1/2/4/16, ranks 8/16/64 (alpha = 2 rank), one epoch."""
    del n_train  # one epoch of every job: its steps follow from the data
    jobs = []
    for lr in (1e-4, 1e-3, 1e-2, 1e-1):
        for bs in (1, 2, 4, 16):
            for rank in (8, 16, 64):
                jobs.append(JobSpec(f"lr{lr:g}_b{bs}_r{rank}", rank=rank, alpha=2.0 * rank, lr=lr,
                                    batch_size=bs, epochs=1.0, seed=len(jobs) + SEED_STRIDE * seed))
    return jobs


def grid_for(n_configs: int, n_train: int, seed: int = 0) -> list[JobSpec]:
    """The 32-configuration grid of bench/task_e2e.py or the 48 one, job seeds offset by seed."""
    if n_configs == 48:
        return grid48(n_train, seed)
    if n_configs != 32:
        raise ValueError(f"--configs is 32 or 48, not {n_configs}")
    import task_e2e as te

    return [replace(j, seed=j.seed + SEED_STRIDE * seed) for j in te.grid(n_train)]


# ----------------------------------------------------------------------------- evaluation policy
@dataclass(frozen=True)
class EvalPolicy:
    """When a job evaluates and on how many validation samples: trainer.colocate.TaskRun's
    cadence_due / eval_size / ranking_samples, for one job run alone. `ranking_samples` None: no
    warmup ranking (loraplex without early exit, c1, c2); else the rung (c3, loraplex (a))."""

    ev: EvalSettings
    ee: EarlyExitSettings
    full: int  # the evaluation set (eval_max_samples of the shuffled validation set)
    ranking_samples: int | None = None

    @classmethod
    def for_jobs(cls, ev: EvalSettings, ee: EarlyExitSettings, full: int, jobs: Sequence[JobSpec],
                 n_train: int, ranked: bool) -> EvalPolicy:
        samples = max(ee.warmup_steps(j.total_steps(n_train)) * j.batch_size for j in jobs)
        return cls(ev, ee, full, samples if ranked else None)

    def rung(self, total: int) -> int | None:
        return self.ee.warmup_steps(total) if self.ranking_samples is not None else None

    def due(self, step: int, total: int, bs: int) -> bool:
        every = self.ev.eval_every_samples
        cadence = ((step * bs) // every > ((step - 1) * bs) // every if every
                   else step % self.ev.eval_every_steps == 0)
        return cadence or step == total or step == self.rung(total)

    def size(self, step: int, last: int, total: int, bs: int) -> int:
        ratio = self.ev.eval_samples_per_trained
        if ratio is None or self.full == 0:
            return self.full
        if step >= total:
            trained = step * bs
        elif step == self.rung(total):
            trained = self.ranking_samples
        else:
            trained = (step - last) * bs
        return eval_subset_size(ratio * trained, self.ev.eval_min_samples, self.full)

    def evals(self, total: int, bs: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
        """(step, size) of every evaluation of a job whose steps lo+1..hi run now (the last
        evaluation before lo at its latest cadence point, as a resumed job has it)."""
        out, last = [], max([s for s in range(1, lo + 1) if self.due(s, total, bs)] or [0])
        for step in range(lo + 1, (total if hi is None else hi) + 1):
            if self.due(step, total, bs):
                out.append((step, self.size(step, last, total, bs)))
                last = step
        return out


# ----------------------------------------------------------------------------- batches
def pack_row(examples: Sequence[Example]) -> dict[str, Any]:
    """DataCollatorWithFlattening's layout: every sequence back to back in one row [1, T] (no
    padding), position ids restarting at 0, labels the example's with -100 at each sequence's
    first token (the model's shifted loss then never crosses a bound), cu_seqlens the bounds."""
    ids, pos, lab, cu = [], [], [], [0]
    for e in examples:
        n = len(e.input_ids)
        ids += e.input_ids
        pos += range(n)
        lab += (IGNORE, *e.labels[1:])
        cu.append(cu[-1] + n)
    return {"ids": torch.tensor([ids]), "pos": torch.tensor([pos]), "labels": torch.tensor([lab]),
            "cu": torch.tensor(cu, dtype=torch.int64), "longest": max(b - a for a, b in zip(cu, cu[1:], strict=False)),
            "tokens": cu[-1], "targets": sum(e.n_trained for e in examples)}


def pad_rows(examples: Sequence[Example], pad_id: int) -> dict[str, Any]:
    """bench/task_e2e.py's collate (one sequence per row, right-padded, attention mask), on the host."""
    import task_e2e as te

    ids, mask, lab = te.collate(examples, pad_id, "cpu")
    return {"ids": ids, "mask": mask, "labels": lab, "tokens": sum(len(e.input_ids) for e in examples),
            "targets": sum(e.n_trained for e in examples)}


def to_device(dev: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host int64 tensors on the device in one pinned, asynchronous copy."""
    if dev.type != "cuda":
        return [t.to(dev) for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors]).pin_memory().to(dev, non_blocking=True)
    return [p.view(t.shape) for p, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]


# ----------------------------------------------------------------------------- Liger
LIGER: dict[str, Any] = {"module": None, "status": "not loaded", "version": None}


def load_liger(dev: torch.device, wheel_dir: Path | None = None, enabled: bool = True) -> str:
    """Import Liger-Kernel: installed, else from the newest liger_kernel-*.whl of wheel_dir (the
    repository's ignored .whl/ by default, unpacked once to a temp dir and put on sys.path). Its
    kernels are Triton GPU kernels: on a CPU it is absent. Returns (and keeps) a status line."""
    if not enabled:
        return _liger_status(None, "absent: turned off (--no-liger)")
    if dev.type != "cuda":
        return _liger_status(None, "absent: CPU run (Liger's kernels are Triton GPU kernels)")
    wheels = sorted(glob.glob(str((wheel_dir or REPO / ".whl") / "liger_kernel-*.whl")))
    try:
        import liger_kernel  # noqa: F401 - installed (pip install --no-deps of the wheel)
    except ImportError:
        if not wheels:
            return _liger_status(None, f"absent: not installed and no wheel in {wheel_dir or REPO / '.whl'}")
        target = Path(tempfile.gettempdir()) / "loraplex_liger" / Path(wheels[-1]).stem
        if not (target / "liger_kernel").is_dir():
            with zipfile.ZipFile(wheels[-1]) as z:
                z.extractall(target)
        sys.path.insert(0, str(target))
    try:
        import liger_kernel.transformers as lt
    except Exception as exc:  # noqa: BLE001 - any import failure means: run without it
        return _liger_status(None, f"absent: import failed ({type(exc).__name__}: {exc})")
    try:
        LIGER["version"] = version("liger-kernel")
    except PackageNotFoundError:
        LIGER["version"] = Path(wheels[-1]).name.split("-")[1] if wheels else "?"
    return _liger_status(lt, f"applied: liger-kernel {LIGER['version']} (RMSNorm, RoPE, SwiGLU, fused linear CE)")


def _liger_status(module: Any, status: str) -> str:
    LIGER["module"], LIGER["status"] = module, status
    return status


def liger_failed(exc: BaseException) -> None:
    """Liger imported but its patched model failed: the arms run without it, and say why."""
    _liger_status(None, f"absent: its patched forward failed ({type(exc).__name__}: {exc})"[:300])


@contextlib.contextmanager
def liger_llama(model: torch.nn.Module) -> Iterator[bool]:
    """Liger's Llama patch on this model instance (its RMSNorm and MLP modules, its forward with
    the fused linear cross-entropy) and, for the duration, in transformers' Llama module (RoPE is
    a module-level function there); the module-level names are restored on exit, so only this
    model instance stays patched. Yields whether Liger is on."""
    lt = LIGER["module"]
    if lt is None or getattr(model.config, "model_type", None) != "llama":
        yield False
        return
    from transformers.models.llama import modeling_llama as ml

    saved = {k: getattr(ml, k) for k in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")}
    try:
        lt.apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                       fused_linear_cross_entropy=True, model=model)
        yield True
    finally:
        for k, v in saved.items():
            setattr(ml, k, v)


# ----------------------------------------------------------------------------- arms
@dataclass
class Arm:
    """How one sequential arm trains a configuration."""

    name: str
    packed: bool  # c2/c3: one packed row + varlen attention; c1: padded rows + mask
    autocast: bool  # bf16 autocast over the float32 adapters (CUDA only)
    liger: bool
    # activation checkpointing per batch size (c1: always, as bench/task_e2e.py's peft_job)
    checkpointing: dict[int, bool] = field(default_factory=dict)
    always_checkpoint: bool = False
    eval_tokens: int = 8192  # c2: tokens per packed evaluation forward
    eval_rows: int = 8  # c1: sequences per padded evaluation forward (peft_job's)

    def checkpoint(self, bs: int) -> bool:
        return self.always_checkpoint or self.checkpointing.get(bs, False)


def c1_arm() -> Arm:
    return Arm("c1", packed=False, autocast=False, liger=False, always_checkpoint=True)


def c2_arm(dev: torch.device, name: str = "c2") -> Arm:
    on = LIGER["module"] is not None
    return Arm(name, packed=True, autocast=dev.type == "cuda", liger=on,
               eval_tokens=8192 if on else 4096)  # without FLCE an evaluation holds fp32 logits


@contextlib.contextmanager
def arm_model(model: torch.nn.Module, arm: Arm) -> Iterator[dict]:
    """The model set up for the arm while it trains: varlen attention (c2), Liger, SDPA's cuDNN
    backend off (c2: its plans are per shape, every packed row has its own length)."""
    info = {"attention": model.config._attn_implementation, "liger": False, "cudnn_sdp": None}
    before = model.config._attn_implementation
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    if arm.packed:
        model.set_attn_implementation(register_varlen())
        info["attention"] = ("flash varlen (torch.nn.attention.varlen)" if flash_varlen_available()
                             and next(model.parameters()).is_cuda else "exact per-sequence SDPA (no flash kernel here)")
        torch.backends.cuda.enable_cudnn_sdp(False)
        info["cudnn_sdp"] = False
    try:
        with liger_llama(model) if arm.liger else contextlib.nullcontext(False) as on:
            info["liger"] = bool(on)
            yield info
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        model.set_attn_implementation(before)


def lora_init(model: torch.nn.Module, spec: JobSpec) -> dict[str, torch.Tensor]:
    """The engine's init of the job's adapter (JobAdapter: PEFT's kaiming A from the job's seed,
    B = 0) under PEFT's key names, for this model's target linears in module order."""
    from trainer.multilora import JobAdapter

    shapes = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in TARGETS}
    device = next(model.parameters()).device  # the engine draws its init on its own device
    return dict(JobAdapter(shapes, spec.rank, spec.alpha, spec.seed, device=device).peft_state_dict())


def _to_cpu(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class JobRun:
    """One configuration trained alone with PEFT on `model` (attach in __init__, `close` or
    `park` to detach), in the arm's way; resumable from a parked state (c3)."""

    def __init__(self, model: torch.nn.Module, spec: JobSpec, arm: Arm, train: Sequence[Example],
                 pad_id: int, init: dict[str, torch.Tensor] | None = None,
                 parked: dict[str, Any] | None = None) -> None:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        self.spec, self.arm, self.train, self.pad_id = spec, arm, train, pad_id
        self.dev = next(model.parameters()).device
        if arm.checkpoint(spec.batch_size):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif model.is_gradient_checkpointing:
            model.gradient_checkpointing_disable()
        self.pm = get_peft_model(model, LoraConfig(
            r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, target_modules=TARGETS, bias="none",
            task_type="CAUSAL_LM", use_rslora=spec.use_rslora), autocast_adapter_dtype=True)
        weights = parked["lora"] if parked else init
        if weights is not None:
            set_peft_model_state_dict(self.pm, weights)
        self.params = [p for p in self.pm.parameters() if p.requires_grad]
        self.total = spec.total_steps(len(train))
        self.opt = torch.optim.AdamW(self.params, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                     weight_decay=spec.weight_decay, fused=self.dev.type == "cuda")
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_factor(s, spec.warmup_steps, self.total, spec.schedule))
        self.stream = JobDataStream(len(train), spec.seed)
        self.step, self.last_eval, self.tokens = 0, 0, 0
        self.pending: list[tuple[int, torch.Tensor]] = []
        if parked:
            self.opt.load_state_dict(parked["opt"])
            self.sched.load_state_dict(parked["sched"])
            self.stream.load_state_dict(parked["stream"])
            self.step, self.last_eval, self.tokens = parked["step"], parked["last_eval"], parked["tokens"]
        self.pm.train()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.arm.autocast and self.dev.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def loss(self, examples: Sequence[Example], eval_mode: bool = False) -> torch.Tensor:
        """The model's own mean token loss of these examples as the arm batches them."""
        if self.arm.packed:
            b = pack_row(examples)
            ids, pos, lab, cu = to_device(self.dev, b["ids"], b["pos"], b["labels"], b["cu"])
            cu = cu.to(torch.int32)
            kw = {"input_ids": ids, "position_ids": pos, "labels": lab, "cu_seq_lens_q": cu,
                  "cu_seq_lens_k": cu, "max_length_q": b["longest"], "max_length_k": b["longest"]}
            if self.arm.liger and eval_mode:
                kw["skip_logits"] = True  # Liger's forward: the fused head + CE in eval mode too
        else:
            b = pad_rows(examples, self.pad_id)
            ids, mask, lab = to_device(self.dev, b["ids"], b["mask"], b["labels"])
            kw = {"input_ids": ids, "attention_mask": mask, "labels": lab}
        with self._autocast():
            return self.pm(**kw, use_cache=False).loss

    def train_step(self) -> int:
        """One optimizer step on the job's next micro-batch; its real tokens. No host sync."""
        examples = [self.train[i] for i in self.stream.next_indices(self.spec.batch_size)]
        loss = self.loss(examples)
        loss.backward()
        if self.spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.spec.max_grad_norm)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self.pending.append((self.step, loss.detach()))
        n = sum(len(e.input_ids) for e in examples)
        self.tokens += n
        return n

    def train_losses(self) -> dict[int, float]:
        """The train losses since the last call (one sync)."""
        if not self.pending:
            return {}
        values = torch.stack([v.float() for _, v in self.pending]).tolist()
        out = {s: v for (s, _), v in zip(self.pending, values, strict=True)}
        self.pending = []
        return out

    @torch.no_grad()
    def evaluate(self, examples: Sequence[Example]) -> float:
        """Token-mean loss over the examples (what the executor's evaluate_metrics reports): c2
        packs them by length into forwards of at most eval_tokens, c1 pads them in chunks."""
        self.pm.eval()
        try:
            total = torch.zeros((), dtype=torch.float64, device=self.dev)
            count = 0
            for group in self._eval_groups(examples):
                n = sum(e.n_trained for e in group)
                total += self.loss(group, eval_mode=True).double() * n
                count += n
            return float(total) / max(count, 1)
        finally:
            self.pm.train()

    def _eval_groups(self, examples: Sequence[Example]) -> list[list[Example]]:
        if not self.arm.packed:
            return [list(examples[i : i + self.arm.eval_rows]) for i in range(0, len(examples), self.arm.eval_rows)]
        groups: list[list[Example]] = [[]]
        used = 0
        for e in sorted(examples, key=lambda e: -len(e.input_ids)):
            if groups[-1] and used + len(e.input_ids) > self.arm.eval_tokens:
                groups.append([])
                used = 0
            groups[-1].append(e)
            used += len(e.input_ids)
        return groups

    def park(self) -> tuple[torch.nn.Module, dict[str, Any]]:
        """Detach the adapter: (the base model, the job's state on the host)."""
        from peft import get_peft_model_state_dict

        state = {"lora": _to_cpu(dict(get_peft_model_state_dict(self.pm))),
                 "opt": _to_cpu(self.opt.state_dict()), "sched": self.sched.state_dict(),
                 "stream": self.stream.state_dict(), "step": self.step, "last_eval": self.last_eval,
                 "tokens": self.tokens}
        return self.close(), state

    def close(self) -> torch.nn.Module:
        self.opt.zero_grad(set_to_none=True)
        self.opt = None
        return self.pm.unload()


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


def run_config(model: torch.nn.Module, spec: JobSpec, arm: Arm, train: Sequence[Example],
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


def successive_halving(model: torch.nn.Module, jobs: Sequence[JobSpec], arm: Arm,
                       train: Sequence[Example], val: Sequence[Example], policy: EvalPolicy,
                       pad_id: int, inits: Callable[[JobSpec], dict | None] = lambda _: None,
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


def step0_losses(model: torch.nn.Module, spec: JobSpec, train: Sequence[Example], pad_id: int,
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


def backbone_params(model: torch.nn.Module) -> int:
    """Parameters of the backbone's matmuls (every 2-D weight but the embeddings: the decoder's
    linears and the LM head): N of MFU = 6 N tokens / time / peak."""
    return sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)


def env_versions() -> dict[str, str]:
    import peft
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "python": sys.version.split()[0],
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "host": os.uname().nodename}
