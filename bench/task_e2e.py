"""Time to the best adapter, end to end (issue 15): one device run, one table.

A grid of 32 LoRA configurations (ranks 8-64, batch sizes 1-16, learning rates 1e-4..1e-1, the
last one diverging) trained on the same data four ways, each timed from "executor starts" to
"every job finished":
  (a) loraplex's real executor (trainer.executor.Executor) with early exit (default settings),
  (b) the same without early exit,
  (c) one configuration at a time with PEFT and a standard training loop (dynamic padding, the
      same evaluation cadence and data order), timed on one configuration per batch size and
      extrapolated to the grid,
  and the backbone alone on the same packed batches as (b)'s steps (the floor).

Speed is measured on a Llama-3.1-8B-shaped model (width, heads, vocabulary of the real model,
random weights, `--layers` decoder layers); random weights give meaningless loss curves, so the
losses the executor SEES in (a) and (b) at that shape are replayed from a small Llama that really
learns: it is pretrained here on a synthetic Markov-chain language (chain A), then the grid's
LoRA jobs learn a changed chain (B) with the same files, tokenizer, lengths, steps and eval
points through the same executor. Every exit decision, the ranking and the best adapter of the
large runs therefore come from real curves, and the large runs check that they reproduce the
small runs' decisions exactly. Quality (best validation loss of (a) vs (b)) is the small model's.

    python bench/task_e2e.py --out bench/results/task_e2e_h100.md [--layers 4] [--json FILE]
    python bench/task_e2e.py --pack-only   # CPU: shapes and padding only (free, buckets, varlen)

`--pack-only` runs (b)'s executor on the CPU with the backbone replaced by zeros (a toy model
loads; every step and evaluation is packed exactly as on the device, at the admission width of
`--max-total-batch` sequences, the device run's) and reports the distinct [rows, length] shapes
of the backbone forwards (what attention builds plans for) and the padding of training steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer.engine as engine_mod  # noqa: E402
from contract.protocol import EarlyExitSettings, EvalSettings  # noqa: E402
from trainer.data import IGNORE, JobDataStream, read_jsonl, tokenize_all  # noqa: E402
from trainer.executor import Callbacks, Executor, ExecutorConfig  # noqa: E402
from trainer.jobs import JobSpec, lr_factor  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
K = 512  # words of the synthetic language
P_NEXT = (0.5, 0.25, 0.15, 0.1)  # successor probabilities of a word (entropy 1.21 nats)
T0 = time.perf_counter()
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMOKE = {"on": False}  # --smoke: a CPU run at toy sizes, to check the script itself


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def log(*a: Any) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


# ----------------------------------------------------------------------------- data and models
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


def grid(n_train: int) -> list[JobSpec]:
    """32 configurations: lr x batch size x two ranks (8/64 or 16/32 by batch size)."""
    jobs = []
    for lr in (1e-4, 1e-3, 1e-2, 1e-1):
        for k, bs in enumerate((1, 2, 4, 16)):
            for rank in ((8, 64) if k % 2 == 0 else (16, 32)):
                jobs.append(JobSpec(f"lr{lr:g}_b{bs}_r{rank}", rank=rank, alpha=2.0 * rank, lr=lr,
                                    batch_size=bs, epochs=1.0, seed=len(jobs)))
    return jobs


# ----------------------------------------------------------------------------- executor runs
@dataclass
class Record:
    train: dict[str, dict[int, float]] = field(default_factory=dict)
    val: dict[str, dict[int, float]] = field(default_factory=dict)
    events: list[tuple[str, str, dict]] = field(default_factory=list)
    states: dict[str, tuple[str, dict]] = field(default_factory=dict)

    def callbacks(self) -> Callbacks:
        return Callbacks(
            on_train_loss=lambda j, s, v: self.train.setdefault(j, {}).__setitem__(s, v),
            on_eval=lambda j, s, v: self.val.setdefault(j, {}).__setitem__(s, v),
            on_job_state=lambda j, st, d: self.states.__setitem__(j, (st, d)),
            on_event=lambda j, m, d: self.events.append((j, m, d)),
        )


class TraceExecutor(Executor):
    """The real executor whose engine computes everything at the large shape, but whose train
    and validation losses are replaced by the small model's at the same job and step."""

    def __init__(self, cfg: ExecutorConfig, cb: Callbacks, trace: Record, recorder: dict,
                 shape_buckets: bool = True, attention: str = "rows") -> None:
        cfg.attention = attention  # the executor's own setting (profile key included)
        super().__init__(cfg, cb)
        self.trace, self.recorder, self.missing = trace, recorder, 0
        self.shape_buckets = shape_buckets

    def _load(self) -> None:
        super()._load()
        eng, real_step, real_eval = self.engine, self.engine.step, self.engine.evaluate_metrics
        if not self.shape_buckets:
            eng.shape_buckets = None

        def step():  # noqa: ANN202
            n = len(self.recorder["step_s"])
            prof = self.recorder.get("profile_at")
            if prof is not None and n == prof:  # a torch.profiler window of 3 steps
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else [])
                self.recorder["profiler"] = profile(activities=acts)
                self.recorder["profiler"].__enter__()
            t0 = time.perf_counter()
            self.recorder["active"] = True
            try:
                report = real_step()
            finally:
                self.recorder["active"] = False
            sync()
            self.recorder["step_s"].append(time.perf_counter() - t0)
            if prof is not None and n == prof + 2:
                p = self.recorder.pop("profiler")
                p.__exit__(None, None, None)
                self.recorder["profile_table"] = p.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
                self.recorder["profile_steps_s"] = self.recorder["step_s"][-3:]
            if self.trace is not None:
                for j in report.losses:
                    report.losses[j] = self.trace.train[j][report.steps[j]]
            return report

        def evaluate_metrics(examples, batch_size=8, job_ids=None, max_sequences=None,  # noqa: ANN001, ANN202
                             forwards=None):
            out = real_eval(examples, batch_size, job_ids, max_sequences, forwards)
            for j in out if self.trace is not None else ():
                curve, step = self.trace.val.get(j, {}), eng.jobs[j].step
                if step not in curve:
                    self.missing += 1
                    step = max([s for s in curve if s <= step] or [min(curve)])
                out[j]["loss"] = curve[step]
            return out

        eng.step, eng.evaluate_metrics = step, evaluate_metrics


REC: dict[str, Any] = {}


def install_recorder() -> dict:
    """Record every training step's packed batch (CPU) and the host time of packing/layout."""
    fresh = not REC
    REC.update({"active": False, "batches": [], "step_s": [], "pack_s": 0.0, "layout_s": 0.0})
    rec = REC
    if not fresh:
        return rec
    real_layout = engine_mod.MultiLoraEngine._set_layout

    def recorded(real):  # noqa: ANN001, ANN202
        def pack(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            batch = real(*a, **kw)
            if rec["active"]:
                rec["pack_s"] += time.perf_counter() - t0
                rec["batches"].append((batch.input_ids, batch.position_ids, batch.targets,
                                       batch.cu_seqlens))
            return batch
        return pack

    def set_layout(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        real_layout(self, *a, **kw)
        if rec["active"]:
            rec["layout_s"] += time.perf_counter() - t0

    engine_mod.pack_step = recorded(engine_mod.pack_step)
    engine_mod.pack_flat = recorded(engine_mod.pack_flat)
    engine_mod.MultiLoraEngine._set_layout = set_layout
    return rec


def executor_cfg(model_dir: Path, data: tuple[Path, Path], out: Path, jobs: list[JobSpec],
                 early_exit: bool, args: argparse.Namespace, cache: Path) -> ExecutorConfig:
    return ExecutorConfig(
        model_dir=str(model_dir), train_file=str(data[0]), val_file=str(data[1]),
        output_dir=str(out), jobs=[JobSpec(**vars(j)) for j in jobs], max_seq_len=args.seq,
        eval=EvalSettings(eval_every_steps=50, eval_max_samples=args.n_val,
                          eval_every_samples=args.eval_every_samples),
        checkpoint_every=50, checkpoint_every_s=300.0,
        early_exit=EarlyExitSettings(enabled=early_exit), profile_cache=str(cache) if cache else None)


def run_small(model_dir: Path, data, root: Path, jobs, early_exit: bool, args, cache) -> tuple[Record, dict, Executor]:  # noqa: ANN001
    rec = Record()
    ex = Executor(executor_cfg(model_dir, data, root / f"small_{int(early_exit)}", jobs,
                               early_exit, args, cache), rec.callbacks())
    status = ex.run()
    return rec, status, ex


def free() -> None:
    gc.collect()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


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


def peft_job(model, spec: JobSpec, train, val, every: int, eval_bs: int = 8):  # noqa: ANN001, ANN201
    """One configuration alone: PEFT LoRA on the 7 projections, AdamW + linear schedule, grad
    clip 1.0, dynamic padding, evaluation on the validation set every `every` samples and at the
    end, batches in the executor's data order (JobDataStream with the job's seed)."""
    from peft import LoraConfig, get_peft_model

    dev = DEV
    sync()
    t0 = time.perf_counter()
    pm = get_peft_model(model, LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0,
                                          target_modules=TARGETS, task_type="CAUSAL_LM"),
                        autocast_adapter_dtype=True)
    params = [p for p in pm.parameters() if p.requires_grad]
    total = spec.total_steps(len(train))
    opt = torch.optim.AdamW(params, lr=spec.lr, fused=True)
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
    out = {"job": spec.job_id, "batch_size": spec.batch_size, "rank": spec.rank, "steps": total,
           "seconds": time.perf_counter() - t0, "evals": evals, "eval_s": eval_s}
    return out, pm.unload()


# ----------------------------------------------------------------------------- report
def best_val(rec: Record, jobs: list[str] | None = None) -> tuple[float, str]:
    vals = [(v, j) for j, c in rec.val.items() if jobs is None or j in jobs for v in c.values()
            if math.isfinite(v)]
    return min(vals)


def summarize_statuses(states: dict[str, tuple[str, dict]]) -> dict[str, str]:
    return {j: st + (f":{d.get('exit_reason')}" if st == "exited" else "")
            for j, (st, d) in sorted(states.items())}


def quality(args, root, tok, chain_a, data, jobs, cache, res, dump) -> Record:  # noqa: ANN001
    """The small model pretrained on chain A, then the grid through the real executor without
    (b) and with (a) early exit: the quality numbers and the trace the large runs replay."""
    log("pretraining the small model")
    small_dir, pre_loss = small_model(root / "small", chain_a, tok, args.pretrain_steps)
    res["small_pretrain_loss"] = pre_loss
    log("small pretrain loss", pre_loss)

    # ---- quality: the small model through the same executor, grid and data
    small_b, st_b, ex_b = run_small(small_dir, data, root, jobs, False, args, cache)
    res["small_b_timings"] = ex_b.timings()
    log("small (b)", res["small_b_timings"])
    dump()
    small_a, st_a, ex_a = run_small(small_dir, data, root, jobs, True, args, cache)
    res["small_a_timings"] = ex_a.timings()
    log("small (a)", res["small_a_timings"])
    del ex_a, ex_b
    trace = Record(train=small_b.train, val={j: {**small_b.val.get(j, {}), **small_a.val.get(j, {})}
                                             for j in small_b.val})
    n_train_ex = len(tokenize_all(tok, read_jsonl(data[0]), args.seq))
    samples_b = sum(j.total_steps(n_train_ex) * j.batch_size for j in jobs)
    steps_a = {j: max(c) for j, c in small_a.train.items()}
    spec = {j.job_id: j for j in jobs}
    samples_a = sum(steps_a[j] * spec[j].batch_size for j in steps_a)
    qa, ja = best_val(small_a)
    qb, jb = best_val(small_b)
    res["quality"] = {"best_a": qa, "best_job_a": ja, "best_b": qb, "best_job_b": jb,
                      "samples_a": samples_a, "samples_b": samples_b,
                      "statuses_a": summarize_statuses(small_a.states),
                      "val_at_start": statistics.median(min(c.items())[1] for c in small_b.val.values())}
    log("quality", res["quality"])
    dump()
    free()
    return trace


def shape_summary(shapes: dict) -> dict:
    """Distinct backbone-forward shapes (attention plans) of an engine's forward_shapes."""
    train = {k[:2] for k, n in shapes.items() if k[2]}
    evals = {k[:2] for k, n in shapes.items() if not k[2]}
    return {"train": len(train), "eval": len(evals), "total": len(shapes),
            "forwards": sum(shapes.values()),
            "top": sorted(([list(k), n] for k, n in shapes.items()), key=lambda x: -x[1])[:8]}


class PackOnlyExecutor(Executor):
    """(b)'s executor with the backbone replaced by zeros: packing, admission, evaluation points
    and updates are the real ones, the model costs nothing (shapes and padding on the CPU)."""

    def __init__(self, cfg: ExecutorConfig, cb: Callbacks, buckets: bool, attention: str) -> None:
        cfg.attention = attention
        super().__init__(cfg, cb)
        self.buckets, self.cells, self.real = buckets, 0, 0

    def _load(self) -> None:
        super()._load()
        eng = self.engine
        if not self.buckets:
            eng.shape_buckets = None
        width = eng.model.config.hidden_size

        def hidden(batch):  # noqa: ANN001, ANN202
            eng.forward_shapes[(*batch.input_ids.shape, torch.is_grad_enabled())] += 1
            if torch.is_grad_enabled():
                self.cells += batch.input_ids.numel()
                self.real += batch.real_tokens
            return torch.zeros(*batch.input_ids.shape, width, requires_grad=torch.is_grad_enabled())

        eng._hidden = hidden
        # nor does the head: a zero loss that keeps the graph (the step's shapes are what counts)
        eng._job_loss_sum = lambda h, targets, index=None, n=None: (h.sum() * 0.0, n or 1)  # noqa: ARG005


def pack_only(args: argparse.Namespace, root: Path, data: tuple[Path, Path], jobs: list[JobSpec],
              tok) -> dict:  # noqa: ANN001
    """Shapes and padding of (b) on the CPU: rows in free shapes, rows in bucketed shapes, one
    varlen row."""
    SMOKE["on"] = True
    model_dir = large_model(root / "toy", 1, tok)
    out = {}
    for name, buckets, attention in (("free", False, "rows"), ("buckets", True, "rows"),
                                     ("varlen", True, "varlen")):
        cfg = executor_cfg(model_dir, data, root / f"pack_{name}", jobs, False, args, None)
        cfg.device, cfg.max_tokens_per_step = "cpu", args.max_total_batch * args.seq
        cfg.checkpoint_every, cfg.checkpoint_every_s = 10**9, None
        ex = PackOnlyExecutor(cfg, Record().callbacks(), buckets, attention)
        t0 = time.perf_counter()
        ex.run()
        out[name] = {**shape_summary(ex.engine.forward_shapes), "steps": ex.global_step,
                     "padding": 1 - ex.real / max(ex.cells, 1), "host_s": time.perf_counter() - t0}
        log(name, out[name])
    return out


def large_run(name: str, ee: bool, attention: str, *, args: argparse.Namespace, root: Path,
              large_dir: Path, data: tuple[Path, Path], jobs: list[JobSpec], trace: Record | None,
              cache: Path, res: dict, floor: bool = True) -> dict:
    """One executor run at the large shape ((a) with early exit, (b) without), the small model's
    losses replayed (trace); (b) also times the floor on its own packed batches. `res` holds the
    quality phase's statuses ((a)'s decisions are checked against them)."""
    spec = {j.job_id: j for j in jobs}
    rec = install_recorder()
    profile_out = getattr(args, "profile_out", "")
    rec["profile_at"] = 100 if name == "b" and profile_out else None
    out = Record()
    cfg = executor_cfg(large_dir, data, root / f"large_{name}", jobs, ee, args, cache)
    cfg.cudnn_attention = getattr(args, "cudnn_attention", True)
    cfg.async_writes = getattr(args, "async_writes", True)
    ex = TraceExecutor(cfg, out.callbacks(), trace, rec, getattr(args, "shape_buckets", True), attention)
    t0 = time.perf_counter()
    ex.run()
    wall = time.perf_counter() - t0
    tm = ex.timings()
    mm = next((d for j, m, d in out.events if m == "memory_model"), {"k0": None, "k1": None})
    run = {**tm, "wall_outer_s": wall, "steps": len(rec["step_s"]),
           "missing_trace_points": ex.missing, "statuses": summarize_statuses(out.states),
           "host_pack_s": rec["pack_s"], "host_layout_s": rec["layout_s"],
           "max_total_batch": ex.admission.max_total_batch(), "k0": mm["k0"], "k1": mm["k1"],
           "evals": sum(len(c) for c in out.val.values()),
           "attention_shapes": shape_summary(ex.engine.forward_shapes),
           "padding": statistics.fmean(1 - (b[0] != 0).sum().item() / b[0].numel()
                                       for b in rec["batches"]) if rec["batches"] else None,
           "samples": sum(max(c) * spec[j].batch_size for j, c in out.train.items()),
           "job_steps": {j: max(c) for j, c in out.train.items()},
           "eval_forwards_note": "sequences per eval forward up to max_total_batch"}
    if rec.get("profile_table") and profile_out:
        Path(profile_out).write_text(
            f"steps (s, profiled): {rec['profile_steps_s']}\n{rec['profile_table']}\n")
    if name == "a" and "quality" in res:
        run["decisions_match_small"] = run["statuses"] == res["quality"]["statuses_a"]
    elif not rec["batches"]:  # no training step ran: say why instead of timing nothing
        run["no_steps"] = {j: d for j, (st, d) in out.states.items() if st != "completed"}
        log("no training step recorded", run["statuses"], run["no_steps"])
    elif floor:
        # the floor on (b)'s own packed batches: the engine's model with no job attached
        log("floor on", len(rec["batches"]), "recorded batches")
        run["floor"] = time_floor(ex.engine.model, rec["batches"], rec["step_s"],
                                  getattr(args, "floor_steps", 24))
    log(name, {k: v for k, v in run.items() if k != "statuses"})
    ex.engine.model.to("meta")
    del ex
    rec["batches"] = []
    free()
    return run


def main() -> None:  # noqa: PLR0915
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--n-train", type=int, default=128)
    ap.add_argument("--n-val", type=int, default=64)
    ap.add_argument("--eval-every-samples", type=int, default=64)
    ap.add_argument("--pretrain-steps", type=int, default=300)
    ap.add_argument("--floor-steps", type=int, default=24)
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip what is left after this")
    ap.add_argument("--work", default="/tmp/task_e2e")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile-out", default="", help="torch.profiler table of 3 steps of (b)")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (checks the script)")
    ap.add_argument("--speed-only", action="store_true",
                    help="(b) at the large shape with its own losses, the floor and PEFT at batch "
                         "sizes 1 and 16: no quality runs, no (a)")
    ap.add_argument("--pack-only", action="store_true",
                    help="CPU: (b)'s packed shapes and padding only (no model compute)")
    ap.add_argument("--max-total-batch", type=int, default=88,
                    help="--pack-only: sequences per step admitted (the H100 run's at 4 layers)")
    ap.add_argument("--no-shape-buckets", dest="shape_buckets", action="store_false",
                    help="the engine packs steps in free shapes (MultiLoraEngine.shape_buckets=None)")
    ap.add_argument("--attention", choices=("rows", "varlen"), default="rows",
                    help="the engine's packing and attention (MultiLoraEngine.set_attention)")
    ap.add_argument("--compare-attention", action="store_true",
                    help="after (c), (b) again with the other attention (if the deadline allows)")
    ap.add_argument("--sync-writes", dest="async_writes", action="store_false",
                    help="checkpoints and exports written in the step loop (ExecutorConfig.async_writes off)")
    ap.add_argument("--no-cudnn-attention", dest="cudnn_attention", action="store_false",
                    help="the executor turns SDPA's cuDNN backend off (ExecutorConfig.cudnn_attention)")
    args = ap.parse_args()
    SMOKE["on"] = args.smoke
    root = Path(args.work)
    root.mkdir(parents=True, exist_ok=True)
    cache = root / "memory_profiles.json"
    cache.unlink(missing_ok=True)
    res: dict[str, Any] = {"args": vars(args),
                           "gpu": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu",
                           "torch": torch.__version__}

    def dump() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1, default=str))

    chain_a, chain_b = chains()
    tok = make_tokenizer()
    data = write_data(root, chain_b, args.n_train, args.n_val, args.seq)
    jobs = grid(args.n_train)
    if args.pack_only:
        res["pack_only"] = pack_only(args, root, data, jobs, tok)
        dump()
        return
    trace = None
    if not args.speed_only:
        trace = quality(args, root, tok, chain_a, data, jobs, cache, res, dump)
    run_names = (("b", False),) if args.speed_only else (("b", False), ("a", True))
    peft_sizes = (1, 16) if args.speed_only else sorted({j.batch_size for j in jobs})

    # ---- speed at the large shape: (b) first (it profiles and stores), then (a) (reuses)
    large_dir = large_model(root / "large", args.layers, tok)
    log("large model saved")
    runs = res["runs"] = {}

    def run_large(name: str, ee: bool, attention: str) -> None:
        runs[name] = large_run(name, ee, attention, args=args, root=root, large_dir=large_dir,
                               data=data, jobs=jobs, trace=trace, cache=cache, res=res)
        dump()

    for name, ee in run_names:
        run_large(name, ee, args.attention)

    # ---- (c) PEFT one configuration at a time: one job per batch size, extrapolated
    from transformers import AutoModelForCausalLM

    sync()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(large_dir, dtype=torch.bfloat16, device_map={"": DEV})
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    load_s = time.perf_counter() - t0
    train = tokenize_all(tok, read_jsonl(data[0]), args.seq)
    val = tokenize_all(tok, read_jsonl(data[1]), args.seq)[: args.n_val]
    measured = {}
    for bs in peft_sizes:
        if time.perf_counter() - T0 > args.deadline_s:
            log("deadline: PEFT batch size", bs, "not measured")
            continue
        sample = next(j for j in jobs if j.batch_size == bs and j.rank in (16, 64) and j.lr == 1e-3)
        measured[bs], model = peft_job(model, sample, train, val, args.eval_every_samples)
        log("peft", measured[bs])
    extrapolated = load_s + sum(measured[j.batch_size]["seconds"] for j in jobs
                                if j.batch_size in measured)  # speed-only: bs 1 and 16 only
    res["peft"] = {"load_s": load_s, "measured": measured, "grid_s": extrapolated}
    dump()
    del model
    free()
    if args.compare_attention:
        # (b) again with the other packing and attention, if the deadline leaves room for it
        other = "varlen" if args.attention == "rows" else "rows"
        if time.perf_counter() - T0 + runs["b"]["wall_outer_s"] * 1.2 < args.deadline_s:
            run_large(f"b_{other}", False, other)
        else:
            log("deadline: (b) with attention", other, "not run")
    if args.out and not args.speed_only:
        Path(args.out).write_text(render(res))
    log("done")


def render(res: dict) -> str:
    a, b, q, p = res["runs"]["a"], res["runs"]["b"], res["quality"], res["peft"]
    lines = [f"device: {res['gpu']}, torch {res['torch']}; settings: {json.dumps(res['args'])}", ""]
    lines.append("| run | wall s | load | profile | train steps | eval | checkpoints | exports | idle |"
                 " first step s | samples |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in (("(a) early exit", a), ("(b) no early exit", b)):
        lines.append(f"| {name} | {r['wall_s']:.1f} | {r['load_s']:.1f} | {r['profile_s']:.1f} | "
                     f"{r['train_s']:.1f} | {r['eval_s']:.1f} | {r['checkpoint_s']:.1f} | "
                     f"{r['export_s']:.1f} | {r['idle_s'] + r['admit_s']:.1f} | {r['first_step_s']:.1f} | "
                     f"{r['samples']} |")
    lines.append(f"| (c) PEFT one at a time (extrapolated) | {p['grid_s']:.1f} | {p['load_s']:.1f} | | | | | | | | "
                 f"{q['samples_b']} |")
    for name, r in (("(a)", a), ("(b)", b)):
        sh = r["attention_shapes"]
        lines.append(f"\n{name}: {sh['total']} distinct backbone-forward shapes ({sh['train']} training, "
                     f"{sh['eval']} evaluation) over {sh['forwards']} forwards; padded cells per step "
                     f"{r['padding']:.1%}")
    for name, r in res["runs"].items():
        if name.startswith("b_"):
            lines.append(f"\n{name}: train steps {r['train_s']:.1f} s vs (b) {b['train_s']:.1f} s; wall "
                         f"{r['wall_s']:.1f} s; floor {r['floor']['engine_s'] / r['floor']['floor_s']:.2f}x; "
                         f"padding {r['padding']:.1%}")
    fl = b["floor"]
    lines.append(f"\nfloor on {fl['steps']} of (b)'s steps: engine {fl['engine_s']:.2f} s vs backbone "
                 f"{fl['floor_s']:.2f} s = {fl['engine_s'] / fl['floor_s']:.2f}x; padding {fl['padding']:.1%}")
    lines.append(f"\nquality: best val (a) {q['best_a']:.4f} ({q['best_job_a']}), (b) {q['best_b']:.4f} "
                 f"({q['best_job_b']}); ratio {q['best_a'] / q['best_b']:.4f}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
