"""bench/early_exit_study.py's task: the addition vocabulary and the study's sizes, the data (3-digit
addition, answer reversed), the small Llama pretrained on 1-2 digit addition, and the grid's plans
and outcomes."""

from __future__ import annotations

import itertools
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract.protocol import EarlyExitSettings  # noqa: E402
from trainer.data import IGNORE, Example  # noqa: E402
from trainer.early_exit import warmup_steps  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402

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


TINY = Size(32, 2, 2, 80, 64, 32, 2, (3e-4, 1e-3, 3e-3, 1e-2), (2, 8), (2, 4, 8), 10, 12)
FULL = Size(256, 4, 4, 1000, 2000, 512, 3, (3e-4, 1e-3, 3e-3, 1e-2), (4, 16), (8, 16, 32), 30, 96)


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


def to_example(a: int, b: int) -> Example:
    toks, start = encode(a, b)
    return Example(tuple(toks), tuple([IGNORE] * start + toks[start:]))


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


@dataclass(frozen=True)
class Plan:
    """One configuration of the grid and its evaluation schedule (the same in (a) and (b))."""

    job_id: str
    lr: float
    rank: int
    batch_size: int
    seed: int
    total_steps: int
    warmup: int
    eval_every: int
    eval_at: frozenset[int]

    def spec(self, epochs: int) -> TrainJob:
        return TrainJob(job_id=self.job_id, lora_rank=self.rank, lora_alpha=16.0, learning_rate=self.lr,
                       batch_size=self.batch_size, epochs=epochs, seed=self.seed)


@dataclass
class Outcome:
    """What one job did in one run: per-step train losses, (step, val) points, how it ended."""

    steps: int = 0
    samples: int = 0
    train: list[float] = field(default_factory=list)
    curve: list[tuple[int, float]] = field(default_factory=list)
    state: str = "pending"
    exit_reason: str | None = None


WARMUPS = (0.05, 0.1, 0.2)  # warmup fractions evaluated on every job, for the replay table


def make_plans(size: Size, n_train: int) -> list[Plan]:
    plans = []
    grid = itertools.product(size.lrs, size.ranks, size.batches)
    for i, (lr, rank, batch) in enumerate(grid):
        total = math.ceil(size.epochs * n_train / batch)
        every = max(1, total // size.evals_per_job)
        evals = set(range(every, total + 1, every)) | {total}
        evals |= {warmup_steps(total, f) for f in WARMUPS}
        plans.append(Plan(f"lr{lr:g}-r{rank}-b{batch}", lr, rank, batch, 1000 + i, total,
                          warmup_steps(total, EarlyExitSettings().warmup_fraction), every,
                          frozenset(evals)))
    return plans
