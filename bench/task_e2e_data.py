"""bench/task_e2e.py's task and what its parts share: the synthetic Markov-chain language (chain A
to pretrain, chain B to learn), its data files and tokenizer, the large (speed) and small (quality)
Llamas, the grid of configurations; the device, the clock, the log."""

from __future__ import annotations

import gc
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.jobs import TrainJob  # noqa: E402

K = 512  # words of the synthetic language
P_NEXT = (0.5, 0.25, 0.15, 0.1)  # successor probabilities of a word (entropy 1.21 nats)
T0 = time.perf_counter()
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMOKE = {"on": False}  # --smoke: a CPU run at toy sizes, to check the script itself


def sync() -> None:
    """Wait for the work this thread queued (its current stream: a step's side streams join it before its
    update). Not the whole device: a step graph captured on a thread meanwhile (trainer.graph_thread) may not
    be synced with; session 59 changed it from torch.cuda.synchronize."""
    if DEV.type == "cuda":
        torch.cuda.current_stream().synchronize()


def log(*a: Any) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def free() -> None:
    gc.collect()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- data and models
def emit(text: str, res: dict, args: Any) -> None:
    """A bench's table printed and written to --out, its numbers to --json (where given)."""
    print(text)
    if getattr(args, "out", ""):
        Path(args.out).write_text(text)
    if getattr(args, "json", ""):
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))


def chains(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Chain A (pretraining) and chain B (the task): each word's 4 successors; B keeps two of A's
    (in another order of likelihood) and draws two new ones, so the task needs real learning."""
    r = random.Random(seed)
    a = [r.sample(range(K), 4) for _ in range(K)]
    b = []
    for t in range(K):
        new = [w for w in r.sample(range(K), 8) if w not in a[t]][:2]
        b.append([a[t][1], new[0], a[t][0], new[1]])
    return a, b


def walk(chain: list[list[int]], n: int, r: random.Random) -> list[int]:
    w = r.randrange(K)
    out = [w]
    for _ in range(n - 1):
        w = r.choices(chain[w], P_NEXT)[0]
        out.append(w)
    return out


def write_data(root: Path, chain_b: list[list[int]], n_train: int, n_val: int, max_len: int
               ) -> tuple[Path, Path]:
    """prompt/completion JSONL of chain-B walks, 60..max_len words log-uniform (mean ~ 200)."""
    r = random.Random(1)
    paths = []
    for name, n in (("train", n_train), ("val", n_val)):
        p = root / f"{name}.jsonl"
        with p.open("w") as f:
            for _ in range(n):
                length = int(math.exp(r.uniform(math.log(60), math.log(max_len - 4))))
                words = walk(chain_b, length, r)
                cut = max(8, length // 3)
                f.write(json.dumps({"prompt": " ".join(f"w{w}" for w in words[:cut]),
                                    "completion": " ".join(f"w{w}" for w in words[cut:])}) + "\n")
        paths.append(p)
    return paths[0], paths[1]


def make_tokenizer():  # noqa: ANN201
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{f"w{i}": 4 + i for i in range(K)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


def save_model(model, tokenizer, path: Path) -> Path:  # noqa: ANN001
    model.config.bos_token_id, model.config.eos_token_id = 1, 2
    model.config.pad_token_id = 0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def large_model(path: Path, layers: int, tokenizer) -> Path:  # noqa: ANN001
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = (dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2) if SMOKE["on"] else
             dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_attention_heads=32, num_key_value_heads=8))
    cfg = LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with DEV:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    save_model(model, tokenizer, path)
    del model
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    return path


def small_model(path: Path, chain_a: list[list[int]], tokenizer, steps: int,  # noqa: ANN001
                width: int = 256, depth: int = 4) -> tuple[Path, float]:
    """A Llama (default 4 layers, 256 wide) pretrained (all weights) on chain-A walks; its final loss."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    width, depth = (32, 1) if SMOKE["on"] else (width, depth)
    cfg = LlamaConfig(vocab_size=4 + K, hidden_size=width, intermediate_size=4 * width,
                      num_hidden_layers=depth, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    r = random.Random(2)
    loss = math.nan
    for step in range(steps):
        ids = torch.tensor([[1] + [4 + w for w in walk(chain_a, 255, r)] for _ in range(32)]).to(DEV)
        for g in opt.param_groups:
            g["lr"] = 2e-3 * min(1.0, (step + 1) / 20) * (1 - step / steps)
        with torch.autocast(DEV.type, dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == steps - 1:
            loss = out.loss.item()
    save_model(model, tokenizer, path)
    return path, loss


def grid(n_train: int) -> list[TrainJob]:
    """32 configurations: lr x batch size x two ranks (8/64 or 16/32 by batch size)."""
    jobs = []
    for lr in (1e-4, 1e-3, 1e-2, 1e-1):
        for k, bs in enumerate((1, 2, 4, 16)):
            for rank in ((8, 64) if k % 2 == 0 else (16, 32)):
                jobs.append(TrainJob(f"lr{lr:g}_b{bs}_r{rank}", lora_rank=rank, lora_alpha=2.0 * rank, learning_rate=lr,
                                    batch_size=bs, epochs=1.0, seed=len(jobs)))
    return jobs
