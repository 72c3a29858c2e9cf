"""DPO step benchmark: 8 DPO jobs batched on one engine against the same 8 jobs one at a time,
on a random-weight Llama-3.1-8B-shaped model in bf16 (one run, one device, one table).

Per job a micro-batch of 1 or 2 pairs, 512 tokens per sequence (256 prompt + 256 response), ranks
16/32/64 cycled, betas 0.1/0.5. "cold": no reference log-prob cached (first epoch: each step runs
the reference pass over its new samples); "warm": all cached (later epochs). Batched = one engine
step with 8 jobs attached; one at a time = the same engine with one job attached, 8 steps.
Correctness in the same run: the first-step losses of the batched jobs equal the one-at-a-time
losses (same weights, same samples). Usage: python bench/dpo_step.py [--smoke] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_step import llama8b_config  # noqa: E402
from trainer.data import IGNORE, Example  # noqa: E402
from trainer.dpo import DpoEngine  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402
from trainer.pairs import PairExample  # noqa: E402

N_JOBS = 8
RANKS = (16, 32, 64)
BETAS = (0.1, 0.5)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], None], dev: torch.device, warmup: int, iters: int) -> tuple[list[float], float]:
    """Seconds of each timed fn() after warmup, and the peak memory (GiB) during them."""
    for _ in range(warmup):
        fn()
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    return times, peak


def make_pairs(n: int, vocab: int, prompt: int, response: int, seed: int = 0) -> list[PairExample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = torch.randint(0, vocab, (prompt,), generator=g).tolist()
        sides = []
        for _ in range(2):
            r = torch.randint(0, vocab, (response,), generator=g).tolist()
            sides.append(Example(tuple(p + r), (IGNORE,) * prompt + tuple(r)))
        out.append(PairExample(*sides))
    return out


def reset_streams(engine: DpoEngine) -> None:
    for s in engine.jobs.values():
        s.stream.load_state_dict({"n": s.stream.n, "seed": s.stream.seed, "epoch": 0, "pos": 0})


def one_at_a_time(engine: DpoEngine, cold: bool) -> dict[str, float]:
    """Each job alone on the engine for one step (the others detached); their losses."""
    parked = {j: engine.detach(j) for j in list(engine.jobs)}
    losses = {}
    try:
        for j, state in parked.items():
            engine.attach(state)
            if cold:
                engine.reference.clear()
            losses[j] = engine.step().losses[j]
            engine.detach(j)
    finally:
        for state in parked.values():
            if state.job_id not in engine.jobs:
                engine.attach(state)
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", default="1,2", help="pairs per job per step")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    if args.smoke:
        from trainer.tiny import tiny_config

        dev, dtype, cfg = torch.device("cpu"), torch.float32, tiny_config("llama", 512)
        prompt = response = 16
        ranks = (2, 4, 8)
    else:
        dev, dtype, cfg = torch.device("cuda"), torch.bfloat16, llama8b_config(args.layers)
        prompt = response = 256
        ranks = RANKS
    torch.manual_seed(0)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (smoke)"
    batches = [int(b) for b in args.batches.split(",")]
    pairs = make_pairs(64, cfg.vocab_size, prompt, response)
    engine = DpoEngine(model, pairs, pad_id=0, adapter_dtype=dtype)
    rows, checks = [], []
    failed, tol = False, (5e-2 if dtype == torch.bfloat16 else 1e-5)
    for b in batches:
        for j in list(engine.jobs):
            engine.detach(j)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        specs = [TrainJob(f"j{i}", lora_rank=ranks[i % 3], lora_alpha=2 * ranks[i % 3], learning_rate=0.0, batch_size=b,
                         beta=BETAS[i % 2], seed=i, max_steps=10_000) for i in range(N_JOBS)]
        g = torch.Generator().manual_seed(b)
        for s in specs:
            st = engine.attach(s)
            with torch.no_grad():  # B != 0: the policy differs from the reference
                for w in st.adapter.lora_b:
                    w.copy_(1e-2 * torch.randn(w.shape, generator=g).to(w))
        # correctness: lr = 0 keeps the weights (and costs the same AdamW work as any lr), so
        # both runs see the same weights and samples
        reset_streams(engine)
        engine.reference.clear()
        together = engine.step().losses
        reset_streams(engine)
        alone = one_at_a_time(engine, cold=True)
        err = max(abs(together[j] - alone[j]) for j in together)
        spread = max(together.values()) - min(together.values())
        # bf16: a sequence's log-prob is a sum over 256 tokens, each off by ~1e-2 between GEMM
        # shapes, so the DPO logits may move by beta * O(0.1); 5e-2 on a ~0.7 loss is that scale
        ok = (all(math.isfinite(v) for v in together.values()) and err <= tol
              and spread > 2 * err and max(abs(v - math.log(2)) for v in together.values()) > 1e-2)
        failed |= not ok
        checks.append(f"batch {b}: {'PASS' if ok else 'FAIL'} first-step loss batched vs alone max abs "
                      f"err {err:.2e} (tol {tol:g}; losses {min(together.values()):.4f}.."
                      f"{max(together.values()):.4f}, batched "
                      + " ".join(f"{together[j]:.4f}" for j in together) + ", alone "
                      + " ".join(f"{alone[j]:.4f}" for j in together) + ")")
        print(checks[-1], flush=True)
        for cold in (True, False):
            regime = "cold" if cold else "warm"
            if not cold:  # fill the cache with every sample the timed steps can draw
                engine.ensure_reference(pairs)

            def batched(cold: bool = cold) -> None:
                if cold:
                    engine.reference.clear()
                engine.step()

            p0 = dict(engine.passes)
            t_b, mem_b = timed(batched, dev, args.warmup, args.iters)
            n_steps = args.warmup + args.iters
            passes_b = {k: (engine.passes[k] - p0[k]) / n_steps for k in p0}
            p0 = dict(engine.passes)
            t_s, mem_s = timed(lambda cold=cold: one_at_a_time(engine, cold), dev, args.warmup, args.iters)
            passes_s = {k: (engine.passes[k] - p0[k]) / n_steps for k in p0}
            mb, ms = statistics.median(t_b), statistics.median(t_s)
            n_pairs = N_JOBS * b
            rows.append((b, regime, "batched (1 engine step, 8 jobs)", mb, n_pairs / mb, passes_b, mem_b,
                         ms / mb, t_b))
            rows.append((b, regime, "one at a time (8 steps, 1 job)", ms, n_pairs / ms, passes_s, mem_s,
                         None, t_s))
            print(rows[-2], flush=True)
            print(rows[-1], flush=True)

    lines = [
        f"# dpo_step on {name} (torch {torch.__version__}, "
        + (f"{args.layers} layers of Llama-3.1-8B shape, bf16" if not args.smoke else "tiny llama, fp32")
        + f", {N_JOBS} DPO jobs, {prompt}+{response} tokens per sequence, ranks "
        f"{'/'.join(map(str, ranks))} cycled, beta {'/'.join(map(str, BETAS))}, grad checkpointing; "
        f"median of {args.iters} after {args.warmup} warmup)",
        "",
        "| pairs/job | reference | mode | step s (8 jobs) | pairs/s | ref passes/step | policy passes/step "
        "| peak GiB | one-at-a-time / batched | raw s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b, regime, mode, t, pps, passes, mem, ratio, raw in rows:
        lines.append(
            f"| {b} | {regime} | {mode} | {t:.3f} | {pps:.2f} | {passes['reference']:.2f} | "
            f"{passes['policy']:.2f} | {mem:.1f} | {'' if ratio is None else f'{ratio:.2f}'} | "
            f"{' '.join(f'{x:.3f}' for x in raw)} |")
    lines += ["", "Correctness (same run): " + "; ".join(checks)]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    if failed:
        sys.exit("correctness check FAILED (see the table)")


if __name__ == "__main__":
    main()
