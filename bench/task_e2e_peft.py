"""What bench/task_e2e.py compares its executor with: the backbone alone on the engine's packed
batches (the floor) and (c), one configuration at a time with PEFT and a standard training loop."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from task_e2e_data import DEV, sync  # noqa: E402

from trainer.data import IGNORE, JobDataStream  # noqa: E402
from trainer.jobs import TrainJob, lr_factor  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ----------------------------------------------------------------------------- floor and PEFT
def floor_step(model, ids, pos, tgt, cu=None) -> None:  # noqa: ANN001
    """The backbone alone (no LoRA) on one packed batch: forward, loss on the same target
    tokens (head recomputed in backward like the engine's), backward to the embeddings. A varlen
    batch (cu: sequence bounds) runs with the same bounds (the model's attention is varlen)."""
    from torch.utils.checkpoint import checkpoint

    kw = {}
    if cu is not None:
        bounds = torch.tensor(cu, dtype=torch.int32, device=ids.device)
        longest = max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True))
        kw = {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest,
              "max_length_k": longest}
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    hidden = model.base_model(inputs_embeds=emb, position_ids=pos, use_cache=False, **kw).last_hidden_state
    head = model.get_output_embeddings()
    h, t = hidden.reshape(-1, hidden.shape[-1]), tgt.reshape(-1)
    sel = t != IGNORE

    def f(hs, ts):  # noqa: ANN001, ANN202
        return torch.nn.functional.cross_entropy(head(hs).float(), ts, reduction="sum")

    checkpoint(f, h[sel], t[sel], use_reentrant=False).backward()


def time_floor(model, batches, step_s, n: int) -> dict:  # noqa: ANN001
    first = min(2, len(batches) - 1)  # the first steps compile kernels: not a step's time
    pick = sorted({first + round(i * (len(batches) - 1 - first) / max(1, n - 1)) for i in range(n)})
    dev = DEV
    out: dict[str, Any] = {"steps": len(pick)}
    varlen = batches[0][3] is not None
    for name, plain in (("floor", False), ("floor_unpacked_positions", True))[: 1 if varlen else 2]:
        total = 0.0
        for k, i in enumerate([pick[0], pick[0], *pick]):  # two warm-up passes
            ids, pos, tgt = (x.to(dev) for x in batches[i][:3])
            if plain:  # one causal sequence per row: no packed-boundary mask
                pos = torch.arange(ids.shape[1], device=dev).expand_as(ids)
            sync()
            t0 = time.perf_counter()
            floor_step(model, ids, pos, tgt, batches[i][3])
            sync()
            if k >= 2:
                total += time.perf_counter() - t0
        out[name + "_s"] = total
    out["engine_s"] = sum(step_s[i] for i in pick)
    tokens = sum(int((batches[i][0] != 0).sum()) for i in pick)  # pad id 0
    cells = sum(batches[i][0].numel() for i in pick)
    out["padding"] = 1 - tokens / cells
    out["engine_tok_s"] = tokens / out["engine_s"]
    out["floor_tok_s"] = tokens / out["floor_s"]
    return out


def collate(examples, pad: int, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
    n = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), n), pad, dtype=torch.long)
    lab = torch.full((len(examples), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), n), dtype=torch.long)
    for r, e in enumerate(examples):
        k = len(e.input_ids)
        ids[r, :k], lab[r, :k], mask[r, :k] = torch.tensor(e.input_ids), torch.tensor(e.labels), 1
    return ids.to(dev), mask.to(dev), lab.to(dev)


def peft_job(model, spec: TrainJob, train, val, every: int, eval_bs: int = 8):  # noqa: ANN001, ANN201
    """One configuration alone: PEFT LoRA on the 7 projections, AdamW + linear schedule, grad
    clip 1.0, dynamic padding, evaluation on the validation set every `every` samples and at the
    end, batches in the executor's data order (JobDataStream with the job's seed)."""
    from peft import LoraConfig, get_peft_model

    dev = DEV
    sync()
    t0 = time.perf_counter()
    pm = get_peft_model(model, LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, lora_dropout=0.0,
                                          target_modules=TARGETS, task_type="CAUSAL_LM"),
                        autocast_adapter_dtype=True)
    params = [p for p in pm.parameters() if p.requires_grad]
    total = spec.total_steps(len(train))
    opt = torch.optim.AdamW(params, lr=spec.learning_rate, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 0, total))
    stream = JobDataStream(len(train), spec.seed)
    evals, eval_s = 0, 0.0
    pm.train()
    for step in range(1, total + 1):
        ids, mask, lab = collate([train[i] for i in stream.next_indices(spec.batch_size)], 0, dev)
        pm(input_ids=ids, attention_mask=mask, labels=lab, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        seen = step * spec.batch_size
        if seen // every > (seen - spec.batch_size) // every or step == total:
            sync()
            e0 = time.perf_counter()
            pm.eval()
            with torch.no_grad():
                s = torch.zeros((), device=dev)
                for lo in range(0, len(val), eval_bs):
                    ids, mask, lab = collate(val[lo : lo + eval_bs], 0, dev)
                    s += pm(input_ids=ids, attention_mask=mask, labels=lab, use_cache=False).loss
                s.item()
            pm.train()
            evals += 1
            eval_s += time.perf_counter() - e0
    sync()
    out = {"job": spec.job_id, "batch_size": spec.batch_size, "rank": spec.lora_rank, "steps": total,
           "seconds": time.perf_counter() - t0, "evals": evals, "eval_s": eval_s}
    return out, pm.unload()
