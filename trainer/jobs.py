"""One job of the engine: its specification (`TrainJob`, the hyperparameters as the engine
consumes them), its optimizer and schedule, the AdamW step of many jobs at once and a step's
update of every job (`update_jobs`: clip, AdamW, a non-finite job skipping its own), and its state
across steps (`JobRun`, `JobRun.new`: adapter, optimizer, data position; parked on the host
between turns).
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from contract.methods import METHOD_KNOBS
from contract.protocol import JobHyperparameters
from trainer.data import JobDataStream
from trainer.host_pool import POOL
from trainer.multilora import JobAdapter


def load_init_adapter(adapter: JobAdapter, path: str) -> None:
    """Set a job's weights from a PEFT adapter on disk. Modules the adapter does not cover get
    A = B = 0 (no update, no gradient: they stay off); a key the engine has no module for, or
    a shape that differs, is a ValueError."""
    from pathlib import Path

    from safetensors.torch import load_file

    p = Path(path)
    state = load_file(str(p / "adapter_model.safetensors" if p.is_dir() else p))
    prefix = "base_model.model."
    mine = adapter.peft_state_dict()
    unknown = sorted(k for k in state if prefix + k.removeprefix(prefix) not in mine)
    if unknown:
        raise ValueError(f"init adapter: no module for {unknown[:3]}")
    with torch.no_grad():
        adapter.flat.zero_()
        for k, v in state.items():
            dst = mine[prefix + k.removeprefix(prefix)]
            if tuple(dst.shape) != tuple(v.shape):
                raise ValueError(f"init adapter: {k} has shape {tuple(v.shape)}; the job's is "
                                 f"{tuple(dst.shape)}")
            dst.copy_(v)


# a job's fields in checkpoints written before they took the contract's names
LEGACY_FIELDS = {"rank": "lora_rank", "alpha": "lora_alpha", "lr": "learning_rate"}


@dataclass
class TrainJob:
    """One job as the engine trains it: the contract's configuration (contract.protocol.
    JobHyperparameters, its fields under their own names) and how it is trained."""

    job_id: str
    lora_rank: int = 8
    lora_alpha: float = 16.0
    learning_rate: float = 1e-4
    batch_size: int = 4
    beta: float = 0.1  # DPO's knob (contract.methods), a field of its own as checkpoints hold it
    epochs: float = 1.0
    max_steps: int | None = None
    warmup_steps: int = 0
    schedule: str = "linear"  # linear | cosine | constant (after the linear warmup)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    seed: int = 0
    use_rslora: bool = False
    # A PEFT adapter (its directory, or its adapter_model.safetensors) the job starts from
    # instead of a fresh init; rank and alpha must be the adapter's. Optimizer state is fresh.
    init_adapter: str | None = None
    # every other method's own knob by name (contract.methods.METHOD_KNOBS); `knob` reads them
    knobs: dict[str, float] = field(default_factory=dict)

    def knob(self, name: str) -> float:
        """A method's own knob of this job: its value, else the method's default."""
        value = self.knobs.get(name, getattr(self, name, None))
        return METHOD_KNOBS[name].default if value is None else float(value)

    @classmethod
    def from_hyperparameters(cls, job_id: str, hp: JobHyperparameters, *, epochs: float,
                             seed: int) -> TrainJob:
        """The engine's job of one configuration of the task (its hyperparameters as they are)."""
        given = {k: v for k, v in hp.model_dump().items() if v is not None}  # its method's knobs
        own = {f.name for f in fields(cls)}
        return cls(job_id=job_id, **{k: v for k, v in given.items() if k in own},
                   knobs={k: v for k, v in given.items() if k not in own},
                   epochs=float(epochs), seed=seed)

    def __setstate__(self, state: dict) -> None:
        # unpickled from a checkpoint (a queued job): one written before the fields took the
        # contract's names still reads
        self.__dict__.update({"knobs": {}, **{LEGACY_FIELDS.get(k, k): v for k, v in state.items()}})

    def total_steps(self, n_train: int) -> int:
        if self.max_steps is not None:
            return int(self.max_steps)
        return max(1, math.ceil(self.epochs * n_train / self.batch_size))


def lr_factor(step: int, warmup: int, total: int, schedule: str = "linear") -> float:
    """Multiplier of the base LR after `step` optimizer steps (linear warmup, then decay to 0)."""
    if warmup > 0 and step < warmup:
        return step / warmup  # the HF convention: the first step runs at lr 0
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    raise ValueError(f"unknown schedule {schedule!r}")


def make_optimizer(spec: TrainJob, params: Sequence[nn.Parameter], total: int):  # noqa: ANN201
    """The job's own AdamW and LambdaLR (the same objects a PEFT run of the job alone uses). The
    engine applies the update itself, for every job of a step at once (`multi_adamw`, the same
    math); the optimizer holds the job's hyperparameters and state (step on the host, moments
    beside the weights) in torch's format, for checkpoints."""
    opt = torch.optim.AdamW(
        list(params), lr=spec.learning_rate, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
        foreach=False, fused=False,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, spec.warmup_steps, total, spec.schedule)
    )
    return opt, sched


# elements per multi-tensor AdamW group: the groups' temporary (the second moments' square roots)
# stays under 4 bytes x this however many jobs step together (trainer.memory_model counts it)
ADAMW_CHUNK = 64 << 20


def multi_adamw(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor],
                grads: Sequence[torch.Tensor], clips: Sequence[float] | None = None) -> None:
    """`_multi_adamw` over groups of jobs of at most ADAMW_CHUNK elements (a larger job alone);
    `clips`: each job's gradient clipping factor (1: none), applied before the update."""
    def update(group: list[int]) -> None:
        _multi_adamw([optimizers[k] for k in group], [params[k] for k in group], [grads[k] for k in group],
                     None if clips is None else [clips[k] for k in group])

    group: list[int] = []
    size = 0
    for i, p in enumerate(params):
        if group and size + p.numel() > ADAMW_CHUNK:
            update(group)
            group, size = [], 0
        group.append(i)
        size += p.numel()
    if group:
        update(group)


def adamw_states(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor]
                 ) -> tuple[list[dict], list[tuple]]:
    """Each job's AdamW state (made on its first step; the step counted on the host, one more now)
    and its (lr, beta1, beta2, eps, weight decay, step)."""
    states, hyper = [], []
    for opt, p in zip(optimizers, params, strict=True):
        st = opt.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif st["step"].device.type != "cpu":
            st["step"] = st["step"].cpu()  # a fused optimizer's state: counted on the host now
        st["step"] += 1
        opt._opt_called = True  # what torch.optim's step marks for its LR scheduler: stepped
        g = opt.param_groups[0]
        states.append(st)
        hyper.append((g["lr"], *g["betas"], g["eps"], g["weight_decay"], float(st["step"])))
    return states, hyper


@torch.no_grad()
def _multi_adamw(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor],
                 grads: Sequence[torch.Tensor], clips: Sequence[float] | None = None) -> None:
    """One AdamW step of many jobs at once: torch's single-tensor AdamW (decoupled weight decay,
    bias corrections from the host step count) per job, each with its own optimizer's lr, betas,
    eps and weight decay, as a few multi-tensor (`torch._foreach_*`) kernels over all jobs instead
    of one optimizer step per job. Elementwise per tensor: one job's values never reach another's.
    Bit for bit torch.optim.AdamW(foreach=False) on CPU; within float32 rounding of its fused
    CUDA kernel, which is what runs on CUDA (`_fused_each`)."""
    if not params:
        return
    states, hyper = adamw_states(optimizers, params)
    clips = [1.0] * len(params) if clips is None else list(clips)
    if _use_fused(params[0]):
        _fused_each(params, grads, states, hyper, clips)
        return
    clipped = [(g, c) for g, c in zip(grads, clips, strict=True) if c < 1.0]
    if clipped:
        torch._foreach_mul_([g for g, _ in clipped], [c for _, c in clipped])
    decay = [(p, 1 - h[0] * h[4]) for p, h in zip(params, hyper, strict=True) if h[4] != 0]
    if decay:
        torch._foreach_mul_([p for p, _ in decay], [f for _, f in decay])
    exp_avgs = [st["exp_avg"] for st in states]
    exp_avg_sqs = [st["exp_avg_sq"] for st in states]
    torch._foreach_lerp_(exp_avgs, list(grads), [1 - h[1] for h in hyper])
    torch._foreach_mul_(exp_avg_sqs, [h[2] for h in hyper])
    torch._foreach_addcmul_(exp_avg_sqs, list(grads), list(grads), [1 - h[2] for h in hyper])
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, [(1 - h[2] ** h[5]) ** 0.5 for h in hyper])
    torch._foreach_add_(denom, [h[3] for h in hyper])
    torch._foreach_addcdiv_(list(params), exp_avgs, denom, [-(h[0] / (1 - h[1] ** h[5])) for h in hyper])


# On CUDA each job's update is torch's fused AdamW kernel ($LORAPLEX_FUSED_ADAMW=0: the foreach path)
FUSED_ADAMW = os.environ.get("LORAPLEX_FUSED_ADAMW", "1") != "0"


def _use_fused(param: torch.Tensor) -> bool:
    return param.is_cuda and FUSED_ADAMW


def _fused_each(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], states: list[dict],
                hyper: list[tuple], clips: Sequence[float]) -> None:
    """`_multi_adamw`'s update as torch's fused AdamW kernel, one call per job (its own lr, betas,
    eps, weight decay and step): it reads and writes each element once, 28 bytes an element
    against ~80 for the eight foreach passes (at 734 tokens, 2 jobs, the foreach AdamW was ~8% of
    an H100 step); a job's clipping rides in it as its gradient scale (1 / the factor) instead of
    a pass of its own. The steps and scales go to the device in one copy (the host keeps the
    count). Same math as torch.optim.AdamW(fused=True) after clip_grads_with_norm_."""
    n = len(params)
    values = [h[5] for h in hyper] + [1.0 / c for c in clips]
    vals = torch.tensor(values, dtype=torch.float32, pin_memory=params[0].is_cuda)
    vals = vals.to(params[0].device, non_blocking=True)
    for i, (p, g, st, h) in enumerate(zip(params, grads, states, hyper, strict=True)):
        torch._fused_adamw_([p], [g], [st["exp_avg"]], [st["exp_avg_sq"]], [], [vals[i]], lr=h[0], beta1=h[1],
                            beta2=h[2], weight_decay=h[4], eps=h[3], amsgrad=False, maximize=False,
                            grad_scale=vals[n + i] if clips[i] < 1.0 else None, found_inf=None)


@dataclass
class JobRun:
    """Everything of one job that lives across steps (moved to CPU when the job is parked): a job's
    run in the engine. Not its lifecycle state, which is contract.states.JobState."""

    spec: TrainJob
    adapter: JobAdapter
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: JobDataStream
    total_steps: int
    step: int = 0
    skipped_steps: int = 0
    last_loss: float = math.nan

    @classmethod
    def new(cls, spec: TrainJob, shapes: dict[str, tuple[int, int]], dtype: torch.dtype,
            device: torch.device, n_examples: int) -> JobRun:
        """A job's fresh state on `device`: its adapter over these target shapes (PEFT's init, or
        spec.init_adapter), its optimizer and schedule, its data order over n_examples."""
        adapter = JobAdapter(shapes, spec.lora_rank, spec.lora_alpha, spec.seed, dtype, device, spec.use_rslora)
        if spec.init_adapter is not None:
            load_init_adapter(adapter, spec.init_adapter)
        total = spec.total_steps(n_examples)
        opt, sched = make_optimizer(spec, list(adapter.parameters()), total)
        return cls(spec, adapter, opt, sched, JobDataStream(n_examples, spec.seed), total)

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def batch_size(self) -> int:
        return self.spec.batch_size

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    # a park to the host still in flight: the event its copies complete at (see `to`)
    host_copy: torch.cuda.Event | None = field(default=None, repr=False, compare=False)

    def to(self, device: torch.device | str) -> JobRun:
        """Move adapter and optimizer state (park on CPU / resume on the GPU). From a GPU to the
        host the copies go into pinned memory without waiting (they run on the copy engine in
        stream order while the host goes on; a later use of the state waits for them, `settle`);
        where pinned memory cannot be had, a plain blocking copy."""
        self.settle()
        device = torch.device(device)
        tensors = [p.data for p in self.adapter.parameters()]
        if device.type == "cpu" and tensors and tensors[0].is_cuda:
            move, self.host_copy = _to_host_async, torch.cuda.Event()
        else:
            def move(v: torch.Tensor) -> torch.Tensor:
                return v.to(device)
        to_host = device.type == "cpu" and bool(tensors) and tensors[0].is_cuda
        for p in self.adapter.parameters():
            moved = move(p.data)
            p.data = moved
            # a pool slice goes back when its tensor object is freed: the parameter keeps that
            # object (p.data keeps the storage, not the object) for as long as it holds the data
            if to_host:
                p._host_slice = moved
            else:
                p.__dict__.pop("_host_slice", None)
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    st[k] = move(v)
        if self.host_copy is not None:
            self.host_copy.record()
        return self

    def settle(self) -> None:
        """Wait for a park's host copies (before the host reads or frees the state's tensors)."""
        if self.host_copy is not None:
            self.host_copy.synchronize()
            self.host_copy = None


def update_jobs(states: Sequence[JobRun], losses: Sequence[float], norms: Sequence[float],
                grads: Sequence[torch.Tensor]) -> list[bool]:
    """Each job's clip and AdamW update from its gradient sums (`grads`: its region of the
    engine's gradient arena), all jobs' in a few multi-tensor kernels, then every job's schedule
    and step count; a job whose loss or gradient norm is non-finite skips its own update. Returns
    which jobs skipped."""
    coefs, run, skipped = [], [], []
    for s, v, norm, g in zip(states, losses, norms, grads, strict=True):
        skip = note_step(s, v, norm)
        if not skip:
            coef = 1.0
            if s.spec.max_grad_norm is not None:
                coef = min(1.0, s.spec.max_grad_norm / (norm + 1e-6))  # clip_grads_with_norm_'s rule
            coefs.append(coef)
            run.append((s, g))
        skipped.append(skip)
    flats = [s.adapter.flat for s, _ in run]
    multi_adamw([s.optimizer for s, _ in run], flats, [as_param_dtype(g, f) for (_, g), f in zip(run, flats, strict=True)],
                coefs)
    advance(states)
    return skipped


def note_step(s: JobRun, loss: float, norm: float) -> bool:
    """Whether the job skips this step's update (its loss or gradient norm non-finite), the skip
    counted and the loss noted (the host's record of the step, whichever side decided it)."""
    skip = not (math.isfinite(loss) and math.isfinite(norm))
    s.skipped_steps += int(skip)
    s.last_loss = loss
    return skip


def as_param_dtype(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A job's gradient sums in its weights' dtype (the arena's float32 sums for bf16 weights)."""
    return grad if grad.dtype == param.dtype else grad.to(param.dtype)


def advance(states: Sequence[JobRun]) -> None:
    """After the step's updates: every job's learning-rate schedule and step count, one step on."""
    for s in states:
        s.scheduler.step()
        s.step += 1


def release_host_cache() -> None:
    """Give the host allocator's cached pinned blocks (parked states freed since) back to the
    system: pinned memory cannot be swapped, and torch keeps freed blocks for reuse otherwise."""
    if not torch.cuda.is_available():
        return
    release = getattr(torch._C, "_accelerator_emptyHostCache", None) or getattr(torch._C, "_host_emptyCache", None)
    if release is not None:
        release()


def _to_host_async(v: torch.Tensor) -> torch.Tensor:
    out = POOL.take(v.shape, v.dtype)  # pinned ahead of time, off the loop (trainer.host_pool)
    if out is not None:
        return out.copy_(v, non_blocking=True)
    try:
        out = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
    except RuntimeError:  # no pinned memory to be had: a blocking copy into pageable memory
        return v.to("cpu")
    return out.copy_(v, non_blocking=True)
