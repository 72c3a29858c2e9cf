"""The samples a task ends with (contract SampleSettings): a few held-out prompts answered by the
task's leading adapters (the top k jobs by best validation loss, from their exported best
adapters: the files, or the snapshot being written to them) and by the base model, in one decode batch on the executor's backbone (trainer.sampling)
before the task lets go of it. Written as samples.jsonl in the task's output directory and
reported to the service (the TaskSamples report, kept there as a result file of the task).
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from contract.protocol import SampleSettings
from trainer.data import IGNORE, render_chat
from trainer.decode_graph import part
from trainer.jobs import TrainJob

SAMPLES_FILE = "samples.jsonl"


class SamplingTask(Protocol):
    """What the samples read of a task (trainer.colocate.TaskRun)."""

    cfg: Any  # trainer.config.ExecutorConfig
    out: Path
    val: list[Any]
    monitors: dict[str, Any]
    files: Any  # trainer.task_files.TaskFiles: pending_best(job_id)


def prompt_ids(example: Any) -> list[int]:
    """A held-out example's prompt: its tokens before the first one it trains on (a preference
    pair: its chosen sequence's)."""
    ex = getattr(example, "chosen", None) or example
    first = next((i for i, label in enumerate(ex.labels) if label != IGNORE), len(ex.labels))
    return list(ex.input_ids[: max(1, first)])


def inline_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """An inline prompt as the training data's prompts were made: the chat template's user turn
    and generation prompt where the tokenizer has one, else BOS and the text."""
    if getattr(tokenizer, "chat_template", None):
        rendered = render_chat(tokenizer, [{"role": "user", "content": text}], True)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = tokenizer.bos_token_id
    return [bos, *ids] if bos is not None else ids


def leading_jobs(task: SamplingTask, k: int) -> list[str]:
    """The k jobs of the best validation loss that have an exported best adapter (on file, or
    being written)."""
    ranked = sorted((m.best_val, job_id) for job_id, m in task.monitors.items()
                    if m.best_val is not None and math.isfinite(m.best_val))
    found = [j for _, j in ranked if task.files.pending_best(j) is not None
             or (adapter_dir(task, j) / "adapter_model.safetensors").exists()]
    return found[:k]


def adapter_dir(task: SamplingTask, job_id: str) -> Path:
    return task.out / "jobs" / job_id / "best"


def task_samples(task: SamplingTask, engine: Any, tokenizer: Any, generate: Any,
                 parts: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Every prompt answered by the base model and each leading adapter (rows of one decode batch,
    `generate`: trainer.sampling.generate); the sample jobs leave the engine afterwards. `parts`,
    when given, gains the seconds of the prompts and adapters' attach ("attach"), of the decode's
    parts (trainer.sampling.generate) and of the completions' text ("text")."""
    cfg: SampleSettings = task.cfg.settings.samples
    if not cfg.enabled:
        return []
    if cfg.prompts:
        texts = list(cfg.prompts)
        prompts = [inline_prompt_ids(tokenizer, t) for t in texts]
    else:
        prompts = [prompt_ids(ex) for ex in task.val[: cfg.n_prompts]]
        texts = [tokenizer.decode(p, skip_special_tokens=True) for p in prompts]
    jobs = leading_jobs(task, cfg.top_k)
    attached: list[str] = []
    try:
        with part(parts, "attach", engine.device):
            _attach(task, engine, jobs, attached)
        columns: Sequence[str | None] = [None, *attached]
        rows = [(p, c) for p in range(len(prompts)) for c in columns]
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
        new = generate(engine, [prompts[p] for p, _ in rows], [c for _, c in rows],
                       max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                       seed=cfg.seed, eos_token_id=eos, pad_id=pad, parts=parts)
    finally:
        with part(parts, "detach", engine.device):
            for name in attached:
                engine.detach(name)
    with part(parts, "text", engine.device):
        return [{"prompt": shown(texts[p]), "job_id": None if c is None else c.removeprefix("__sample__"),
                 "completion": tokenizer.decode(tokens, skip_special_tokens=True), "tokens": len(tokens)}
                for (p, c), tokens in zip(rows, new, strict=True)]


def _attach(task: SamplingTask, engine: Any, jobs: list[str], attached: list[str]) -> None:
    """Each leading job's best adapter attached to the engine as a sample job (its files, or the
    snapshot being written to them); `attached` gains each name as it joins."""
    specs = {j.job_id: j for j in task.cfg.jobs}
    for job_id in jobs:
        spec = specs[job_id]
        name = f"__sample__{job_id}"
        pending = task.files.pending_best(job_id)  # files not complete yet: their snapshot
        run = engine.attach(TrainJob(name, lora_rank=spec.lora_rank, lora_alpha=spec.lora_alpha,
                                     use_rslora=spec.use_rslora, max_steps=1,
                                     init_adapter=None if pending is not None else str(adapter_dir(task, job_id))))
        attached.append(name)
        if pending is not None:
            with torch.no_grad():
                run.adapter.flat.copy_(pending)


PROMPT_CHARS = 8000  # the report's bound on a prompt's text (contract.protocol.Sample)


def shown(prompt: str) -> str:
    """A prompt as the samples show it: a long one's last PROMPT_CHARS characters (what the
    completion follows), marked as cut."""
    return prompt if len(prompt) <= PROMPT_CHARS else "…" + prompt[-(PROMPT_CHARS - 1):]


def write_samples(out: Path, samples: list[dict[str, Any]]) -> Path:
    path = out / SAMPLES_FILE
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(s) + "\n" for s in samples))
    tmp.replace(path)  # whole or absent
    return path
