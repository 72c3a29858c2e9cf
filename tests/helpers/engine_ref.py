"""Tiny models and data for the engine tests, and the baseline they compare against: one job
trained alone with PEFT on ordinary padded batches (no packing, no multi-LoRA)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from contract.families import LLAMA_LINEARS as DEFAULT_TARGETS
from trainer.data import IGNORE, Example, JobDataStream
from trainer.jobs import TrainJob, make_optimizer
from trainer.tiny import _WORDS, make_tiny_model

_CACHE: dict[str, Path] = {}


def tiny_model_dir(family: str, root: Path) -> Path:
    """A tiny random model of `family` saved under root (once per process and root)."""
    key = f"{root}:{family}"
    if key not in _CACHE:
        _CACHE[key] = make_tiny_model(family, root / f"tiny-{family}", seed=1)
    return _CACHE[key]


def synthetic_rows(n: int, seed: int = 0, fmt: str = "chat") -> list[dict]:
    """JSONL rows with varied lengths (chat or prompt/completion)."""
    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))

    rows = []
    for _ in range(n):
        if fmt == "chat":
            rows.append({"messages": [
                {"role": "user", "content": words(2, 12)},
                {"role": "assistant", "content": words(1, 10)},
            ]})
        else:
            rows.append({"prompt": words(2, 12), "completion": " " + words(1, 10)})
    return rows


def write_jsonl(path: Path, rows: Sequence[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def peft_model(model_dir: Path, spec: TrainJob, init: dict[str, torch.Tensor], targets=DEFAULT_TARGETS):  # noqa: ANN001, ANN201
    """The base model with a PEFT LoRA adapter of the job's rank/alpha, weights set from `init`."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, target_modules=list(targets),
                     lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", use_rslora=spec.use_rslora)
    model = get_peft_model(base, cfg)
    result = set_peft_model_state_dict(model, init)
    assert not [k for k in result.unexpected_keys if "lora" in k], result.unexpected_keys
    return model


def padded_batch(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch with attention mask and HF-style (unshifted) labels."""
    length = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), length), pad_id)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(e.labels)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train_alone_peft(
    model_dir: Path, spec: TrainJob, init: dict[str, torch.Tensor], train: Sequence[Example],
    steps: int, pad_id: int, targets=DEFAULT_TARGETS,  # noqa: ANN001
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train one job alone with PEFT: same init, data order, AdamW and schedule as the engine.
    Returns per-step losses and the final adapter weights (PEFT's saved key names)."""
    from peft import get_peft_model_state_dict

    model = peft_model(model_dir, spec, init, targets)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt, sched = make_optimizer(spec, params, spec.total_steps(len(train)))
    stream = JobDataStream(len(train), spec.seed)
    losses = []
    for _ in range(steps):
        batch = padded_batch([train[i] for i in stream.next_indices(spec.batch_size)], pad_id)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        if spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    return losses, state
