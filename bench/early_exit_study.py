"""Quality study of loss-aware early exit: a grid of LoRA configurations trained (a) to completion
and (b) with early exit, warmup ranking and admission/rotation; prints one markdown table.

Model: a small Llama (transformers config, random init) that is first pretrained here on 1-2 digit
addition (full parameters), then frozen; the LoRA task is 3-digit addition with the answer written
least-significant digit first, on a small training set (several epochs, so overfitting happens)
and a held-out validation set. Loss is on answer tokens only.

Every job has its own seed (adapter init, data order), so a job's curve does not depend on which
jobs share the device: (b)'s curves must equal the prefix of (a)'s, which the script checks.
Jobs are stepped one at a time on the shared frozen backbone (a plain per-job LoRA wrapper, not
the batched executor): this study measures the exit policy, not the kernels.

    python3 bench/early_exit_study.py --tiny          # CPU smoke check, ~1 minute
    python3 bench/early_exit_study.py --out bench/results/early_exit_<device>.md   # GPU size
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.admission import AdmissionController, fit_memory_model, profile_memory  # noqa: E402
from worker.early_exit import (  # noqa: E402
    EarlyExitConfig,
    JobMonitor,
    WarmupRanking,
    warmup_steps,
)

VOCAB = list("0123456789+=") + ["<pad>", "<bos>", "<eos>"]
TOK = {c: i for i, c in enumerate(VOCAB)}
PAD, BOS, EOS = TOK["<pad>"], TOK["<bos>"], TOK["<eos>"]


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    pretrain_steps: int
    n_train: int
    n_val: int
    epochs: int
    lrs: tuple[float, ...]
    ranks: tuple[int, ...]
    batches: tuple[int, ...]
    evals_per_job: int
    concurrent_batch: int  # admission budget: total sequences of co-resident jobs


TINY = Size(64, 2, 2, 300, 256, 128, 3, (3e-4, 1e-3, 3e-3, 1e-2), (2, 8), (4, 8, 16), 20, 24)
FULL = Size(256, 4, 4, 1500, 2000, 512, 4, (1e-4, 3e-4, 1e-3, 3e-3), (4, 16), (8, 16, 32), 40, 96)


# ----------------------------------------------------------------------------- data
def encode(a: int, b: int) -> tuple[list[int], int]:
    """Tokens of 'a+b=' + reversed sum + eos, and the index where the answer starts."""
    prompt = [BOS] + [TOK[c] for c in f"{a}+{b}="]
    answer = [TOK[c] for c in str(a + b)[::-1]] + [EOS]
    return prompt + answer, len(prompt)


def make_batch(pairs: list[tuple[int, int]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(pairs), seq_len), PAD, dtype=torch.long)
    labels = torch.full((len(pairs), seq_len), -100, dtype=torch.long)
    for i, (a, b) in enumerate(pairs):
        toks, start = encode(a, b)
        ids[i, : len(toks)] = torch.tensor(toks)
        labels[i, start - 1 : len(toks) - 1] = torch.tensor(toks[start:])  # next-token targets
    return ids, labels


def lora_task(size: Size, seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    while len(seen) < size.n_train + size.n_val:
        seen.add((rng.randrange(100, 1000), rng.randrange(100, 1000)))
    pairs = sorted(seen)
    rng.shuffle(pairs)
    return pairs[: size.n_train], pairs[size.n_train :]


# ----------------------------------------------------------------------------- model
def build_backbone(size: Size, seq_len: int, device: torch.device) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=size.hidden, intermediate_size=2 * size.hidden,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.heads, max_position_embeddings=seq_len,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(cfg).to(device)
    # Pretrain on 1-2 digit addition so the frozen backbone knows the format and digits.
    rng = random.Random(99)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    for _ in range(size.pretrain_steps):
        pairs = [(rng.randrange(0, 100), rng.randrange(0, 100)) for _ in range(64)]
        ids, labels = make_batch(pairs, seq_len)
        loss = model(input_ids=ids.to(device), labels=labels.to(device)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.requires_grad_(False)
    model.eval()  # no dropout anyway; eval mode keeps it explicit
    return model


class LoRALinear(nn.Module):
    """y = base(x) + s * (x A) B for the adapter of the job that is active right now."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.adapter: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.adapter is not None:
            a, b, scale = self.adapter
            y = y + scale * ((x @ a) @ b)
        return y


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def wrap_targets(model: nn.Module) -> list[LoRALinear]:
    wrapped = []
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in TARGETS and isinstance(child, nn.Linear):
                w = LoRALinear(child)
                setattr(module, name, w)
                wrapped.append(w)
    return wrapped


# ----------------------------------------------------------------------------- jobs
@dataclass
class Job:
    job_id: str
    lr: float
    rank: int
    batch_size: int
    total_steps: int
    warmup: int
    eval_at: set[int]
    params: list[tuple[torch.Tensor, torch.Tensor]]
    opt: torch.optim.Optimizer
    order: list[int]
    step: int = 0
    samples: int = 0
    curve: list[tuple[int, float]] = field(default_factory=list)
    monitor: JobMonitor | None = None
    state: str = "pending"
    exit_reason: str | None = None


def new_job(job_id: str, lr: float, rank: int, batch: int, size: Size, wrapped: list[LoRALinear],
            seed: int, device: torch.device, warmup_fraction: float) -> Job:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for w in wrapped:
        d_in, d_out = w.base.in_features, w.base.out_features
        a = (torch.randn(d_in, rank, generator=gen) / math.sqrt(d_in)).to(device).requires_grad_()
        b = torch.zeros(rank, d_out, device=device, requires_grad=True)
        params.append((a, b))
    opt = torch.optim.AdamW([p for ab in params for p in ab], lr=lr, weight_decay=0.0)
    total = size.epochs * size.n_train // batch
    order = []
    for _ in range(size.epochs):
        order += torch.randperm(size.n_train, generator=gen).tolist()
    warm = warmup_steps(total, warmup_fraction)
    every = max(1, total // size.evals_per_job)
    eval_at = set(range(every, total + 1, every)) | {warm, total}
    return Job(job_id, lr, rank, batch, total, warm, eval_at, params, opt, order)


class Trainer:
    """Steps one job at a time on the shared frozen backbone."""

    def __init__(self, model: nn.Module, wrapped: list[LoRALinear], train, val, seq_len: int,
                 device: torch.device) -> None:
        self.model, self.wrapped, self.train, self.device = model, wrapped, train, device
        self.seq_len = seq_len
        self.val_ids, self.val_labels = (t.to(device) for t in make_batch(val, seq_len))

    def _activate(self, job: Job) -> None:
        scale = 16.0 / job.rank  # lora_alpha = 16, the PEFT-typical fixed alpha
        for w, (a, b) in zip(self.wrapped, job.params, strict=True):
            w.adapter = (a, b, scale)

    def step(self, job: Job) -> float:
        self._activate(job)
        idx = job.order[job.step * job.batch_size : (job.step + 1) * job.batch_size]
        ids, labels = make_batch([self.train[i] for i in idx], self.seq_len)
        loss = self.model(input_ids=ids.to(self.device), labels=labels.to(self.device)).loss
        job.opt.zero_grad(set_to_none=True)
        loss.backward()
        job.opt.step()
        job.step += 1
        job.samples += len(idx)
        return float(loss)

    @torch.no_grad()
    def evaluate(self, job: Job) -> float:
        self._activate(job)
        return float(self.model(input_ids=self.val_ids, labels=self.val_labels).loss)


def run_grid(trainer: Trainer, jobs: list[Job], cfg: EarlyExitConfig, budget: int,
             events: list[dict]) -> None:
    """Train all jobs to completion or exit under a budget of co-resident sequences.

    With `cfg.enabled`: detectors at every evaluation; at the end of its warmup a job reports
    its validation loss and is parked (detached, state kept) so queued jobs rotate in; once all
    have finished warmup, the top keep_ratio resume and the rest exit as underperforming.
    """
    seq = trainer.seq_len
    ctrl = AdmissionController.from_token_budget(max_tokens=budget * seq, seq_len=seq)
    by_id = {j.job_id: j for j in jobs}
    for j in jobs:
        j.monitor = JobMonitor(cfg)
    pending: list[Job] = list(jobs)
    running: list[Job] = []
    parked: list[Job] = []
    ranking = WarmupRanking([j.job_id for j in jobs], cfg.keep_ratio) if cfg.enabled else None

    def attach(ids: list[str]) -> None:
        for i in ids:
            job = by_id[i]
            pending.remove(job)
            running.append(job)
            job.state = "running"

    attach(ctrl.admit(pending, running))
    while running or pending or parked:
        if not running and not pending and parked:
            raise RuntimeError("parked jobs but no ranking decision")
        for job in list(running):
            loss = trainer.step(job)
            decision = job.monitor.observe_train(job.step, loss)
            if decision is None and job.step in job.eval_at:
                val = trainer.evaluate(job)
                job.curve.append((job.step, val))
                decision = job.monitor.observe_eval(job.step, val)
            leave = None
            if decision is not None:
                job.state, job.exit_reason, leave = "exited", decision.reason, "exit"
                events.append({"job": job.job_id, "step": job.step, "reason": decision.reason,
                               **{k: v for k, v in decision.details.items()
                                  if isinstance(v, (int, float))}})
                if ranking is not None and job.job_id in ranking.waiting:
                    ranking.exit(job.job_id)
            elif ranking is not None and job.step == job.warmup and job.job_id in ranking.waiting:
                ranking.report(job.job_id, job.curve[-1][1])
                if job.step < job.total_steps:
                    job.state, leave = "parked", "park"
                    parked.append(job)
            if leave is None and job.step >= job.total_steps:
                job.state, leave = "completed", "done"
            if leave is not None:
                running.remove(job)
                attach(ctrl.backfill(job.batch_size, pending, running))
        if ranking is not None and ranking.ready and ranking.result is None:
            keep, evict = ranking.decide()
            for i in evict:
                job = by_id[i]
                if job.state == "parked":
                    parked.remove(job)
                    job.state, job.exit_reason = "exited", "underperforming"
                    events.append({"job": i, "step": job.step, "reason": "underperforming",
                                   "val_loss": job.curve[-1][1]})
            for i in keep:
                if by_id[i].state == "parked":
                    parked.remove(by_id[i])
                    pending.append(by_id[i])
                    by_id[i].state = "pending"
        attach(ctrl.admit(pending, running))


# ----------------------------------------------------------------------------- analysis
def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy)


def best(curve: list[tuple[int, float]]) -> float:
    finite = [v for _, v in curve if math.isfinite(v)]
    return min(finite) if finite else math.inf


def profile(trainer: Trainer, wrapped: list[LoRALinear], jobs: list[Job], seq_len: int) -> str:
    """Fit M = k0 + k1*B*L on this device (CUDA only) and check it at a held-out batch."""
    if not torch.cuda.is_available():
        return "memory model: not profiled (CPU; admission ran against a token budget)"
    job = jobs[0]

    def step_fn(total_batch: int) -> None:
        trainer._activate(job)
        ids, labels = make_batch(trainer.train[:total_batch], seq_len)
        trainer.model(input_ids=ids.cuda(), labels=labels.cuda()).loss.backward()

    pts = profile_memory(step_fn, [64, 128, 256, 512], seq_len)
    held_out = profile_memory(step_fn, [384], seq_len)[0]
    m = fit_memory_model(pts)
    pred = m.predict(held_out.total_batch, seq_len)
    for a, b in job.params:
        a.grad = b.grad = None
    return (f"memory model on this device: k0={m.k0 / 2**20:.1f} MiB, k1={m.k1:.0f} B/token; "
            f"held-out B=384: predicted {pred / 2**20:.1f} MiB, measured "
            f"{held_out.peak_bytes / 2**20:.1f} MiB ({(pred / held_out.peak_bytes - 1) * 100:+.1f}%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke size")
    ap.add_argument("--out", type=Path, help="write the table here as well")
    ap.add_argument("--json", type=Path, help="write curves and events here")
    args = ap.parse_args()
    size = TINY if args.tiny else FULL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 throughout: curves must be comparable
    seq_len = 16
    t0 = time.perf_counter()
    model = build_backbone(size, seq_len, device)
    wrapped = wrap_targets(model)
    train, val = lora_task(size)
    trainer = Trainer(model, wrapped, train, val, seq_len, device)
    t_pre = time.perf_counter() - t0
    cfg = EarlyExitConfig()
    grid = list(itertools.product(size.lrs, size.ranks, size.batches))

    def make_jobs() -> list[Job]:
        return [new_job(f"lr{lr:g}-r{r}-b{b}", lr, r, b, size, wrapped, seed=1000 + i,
                        device=device, warmup_fraction=cfg.warmup_fraction)
                for i, (lr, r, b) in enumerate(grid)]

    runs = {}
    times = {}
    for name, c in (("a", EarlyExitConfig(enabled=False)), ("b", cfg)):
        jobs = make_jobs()
        events: list[dict] = []
        t = time.perf_counter()
        run_grid(trainer, jobs, c, size.concurrent_batch, events)
        times[name] = time.perf_counter() - t
        runs[name] = (jobs, events)
    mem_line = profile(trainer, wrapped, runs["a"][0], seq_len)

    ja, jb = runs["a"][0], runs["b"][0]
    samples_a = sum(j.samples for j in ja)
    samples_b = sum(j.samples for j in jb)
    best_a = min(ja, key=lambda j: best(j.curve))
    best_b = min(jb, key=lambda j: best(j.curve))
    keep_ids = set()
    for j in jb:
        if j.state in ("completed",) or (j.state == "exited" and j.exit_reason != "underperforming"
                                         and j.step > j.warmup):
            keep_ids.add(j.job_id)
    warm_a = [dict(j.curve)[j.warmup] for j in ja]
    final_a = [j.curve[-1][1] for j in ja]
    rho = spearman(warm_a, final_a)
    rho_best = spearman(warm_a, [best(j.curve) for j in ja])
    # (b)'s curves must be prefixes of (a)'s: jobs are independent of their co-residents.
    max_dev = 0.0
    for x, y in zip(ja, jb, strict=True):
        for (sa, va), (sb, vb) in zip(x.curve, y.curve, strict=False):
            assert sa == sb
            max_dev = max(max_dev, abs(va - vb) / abs(va))
    reasons = {}
    for j in jb:
        key = j.exit_reason or "completed"
        reasons[key] = reasons.get(key, 0) + 1
    survived = best_a.job_id in keep_ids
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"

    lines = [
        f"# Early-exit quality study ({'tiny' if args.tiny else 'study'} size) on {dev_name}",
        "",
        f"Backbone: Llama, random init, pretrained here for {size.pretrain_steps} steps on 1-2 digit "
        f"addition, then frozen (hidden {size.hidden}, {size.layers} layers). LoRA task: 3-digit "
        f"addition, reversed answer, {size.n_train} train / {size.n_val} validation problems, "
        f"{size.epochs} epochs, AdamW, constant lr, lora_alpha 16 on q,k,v,o,gate,up,down.",
        f"Grid: {len(grid)} jobs = lr {list(size.lrs)} x rank {list(size.ranks)} x batch "
        f"{list(size.batches)}; admission budget {size.concurrent_batch} co-resident sequences.",
        f"Early exit: {cfg}.",
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| training samples (a) no early exit | {samples_a} |",
        f"| training samples (b) early exit | {samples_b} |",
        f"| **fraction of samples saved** | **{1 - samples_b / samples_a:.3f}** |",
        f"| best val loss (a) | {best(best_a.curve):.4f} ({best_a.job_id}) |",
        f"| best val loss (b) | {best(best_b.curve):.4f} ({best_b.job_id}) |",
        f"| **best (b) / best (a)** (goal <= 1.01) | **{best(best_b.curve) / best(best_a.curve):.4f}** |",
        f"| **best config of (a) survived warmup ranking** | **{'yes' if survived else 'no'}** |",
        f"| **Spearman(val at end of warmup, val at end)** over (a) | **{rho:.3f}** |",
        f"| Spearman(val at end of warmup, best val) over (a) | {rho_best:.3f} |",
        f"| job outcomes in (b) | {json.dumps(reasons, sort_keys=True)} |",
        f"| max rel. deviation of (b) curves from (a) prefixes | {max_dev:.2e} |",
        f"| wall time: pretrain / (a) / (b) | {t_pre:.1f} s / {times['a']:.1f} s / {times['b']:.1f} s |",
        "",
        mem_line,
        "",
        "| job | val @warmup (a) | best val (a) | final val (a) | (b) outcome | (b) step / total | best val (b) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for x, y in zip(ja, jb, strict=True):
        lines.append(
            f"| {x.job_id} | {dict(x.curve)[x.warmup]:.4f} | {best(x.curve):.4f} | "
            f"{x.curve[-1][1]:.4f} | {y.exit_reason or y.state} | {y.step} / {y.total_steps} | "
            f"{best(y.curve):.4f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps({
            "a": {j.job_id: j.curve for j in ja}, "b": {j.job_id: j.curve for j in jb},
            "events": runs["b"][1]}))
    assert max_dev < 1e-3, f"(b) curves deviate from (a): {max_dev}"


if __name__ == "__main__":
    main()
