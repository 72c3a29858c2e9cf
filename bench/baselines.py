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

The grids and the evaluation policy are in baselines_policy.py, Liger in baselines_liger.py, the
runs of configurations (one at a time, successive halving) and the step-0 check in
baselines_runs.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines_liger import LIGER, liger_llama  # noqa: E402

from trainer.data import IGNORE, Example, JobDataStream  # noqa: E402
from trainer.jobs import TrainJob, lr_factor  # noqa: E402
from trainer.varlen import flash_varlen_available, register_varlen  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


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
    from task_e2e_peft import collate

    ids, mask, lab = collate(examples, pad_id, "cpu")
    return {"ids": ids, "mask": mask, "labels": lab, "tokens": sum(len(e.input_ids) for e in examples),
            "targets": sum(e.n_trained for e in examples)}


def to_device(dev: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host int64 tensors on the device in one pinned, asynchronous copy."""
    if dev.type != "cuda":
        return [t.to(dev) for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors]).pin_memory().to(dev, non_blocking=True)
    return [p.view(t.shape) for p, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]


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


def lora_init(model: torch.nn.Module, spec: TrainJob) -> dict[str, torch.Tensor]:
    """The engine's init of the job's adapter (JobAdapter: PEFT's kaiming A from the job's seed,
    B = 0) under PEFT's key names, for this model's target linears in module order."""
    from trainer.multilora import JobAdapter

    shapes = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in TARGETS}
    device = next(model.parameters()).device  # the engine draws its init on its own device
    return dict(JobAdapter(shapes, spec.lora_rank, spec.lora_alpha, spec.seed, device=device).peft_state_dict())


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

    def __init__(self, model: torch.nn.Module, spec: TrainJob, arm: Arm, train: Sequence[Example],
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
            r=spec.lora_rank, lora_alpha=spec.lora_alpha, lora_dropout=0.0, target_modules=TARGETS, bias="none",
            task_type="CAUSAL_LM", use_rslora=spec.use_rslora), autocast_adapter_dtype=True)
        weights = parked["lora"] if parked else init
        if weights is not None:
            set_peft_model_state_dict(self.pm, weights)
        self.params = [p for p in self.pm.parameters() if p.requires_grad]
        self.total = spec.total_steps(len(train))
        self.opt = torch.optim.AdamW(self.params, lr=spec.learning_rate, betas=spec.betas, eps=spec.eps,
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


def backbone_params(model: torch.nn.Module) -> int:
    """Parameters of the backbone's matmuls (every 2-D weight but the embeddings: the decoder's
    linears and the LM head): N of MFU = 6 N tokens / time / peak."""
    return sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)


def config_matmul_params(config: Any) -> int:
    """backbone_params from a Llama-style config alone (no model built): each layer's q, k, v, o,
    gate, up and down weights and the LM head, for a run whose arms built no baseline model."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    return layers * (2 * h * q + 2 * h * kv + 3 * h * i) + config.vocab_size * h


def env_versions() -> dict[str, str]:
    import peft
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "python": sys.version.split()[0],
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "host": os.uname().nodename}
