"""A step that one pass fits only with activation recompute, run each way the engine can run it
(issue 40): one pass with recompute, or passes without recompute (engine.split_for, chosen by
trainer.admission.RecomputePolicy.passes) of a given size. Which is faster depends on the pass
size: a small pass is launch-bound on the host (the passes run eagerly), a large one is not.
This table says where the split starts to win on this device (MIN_PASS_TOKENS).

Llama-3.1-8B shape with random bf16 weights, --jobs jobs of ranks 8/16/64 cycled, each --batch
sequences of --seq tokens (one step: jobs x batch x seq tokens), varlen attention, the product's
adapter dtype, no step graphs (passes run eagerly). Every arm first runs one step from the same
adapters and data as the first arm: its losses and gradient norms must equal the first arm's
(bf16: within 2e-2); then the median of --iters steps after --warmup.

    python bench/split_step.py --layers 32 --jobs 16 --batch 4 --passes 1r,1,2,4,8,16 --out FILE.md
    (1r: one pass with recompute; K: K passes without recompute, jobs dealt evenly)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_step import llama8b_config, profile_step  # noqa: E402
from trainer.data import Example  # noqa: E402
from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402

RANKS = (8, 16, 64)


def deal(n_jobs: int, k: int) -> list[list[int]]:
    """n_jobs jobs dealt into k passes of nearly equal size (in job order within each)."""
    return [list(range(i, n_jobs, k)) for i in range(k)]


def set_arm(engine: MultiLoraEngine, arm: str) -> None:
    """The step's way: "1r" one pass with recompute; "K" K passes without recompute."""
    recompute = arm.endswith("r")
    k = int(arm.rstrip("r"))
    n = len(engine.jobs)
    engine.recompute_for = lambda tokens, on=recompute: on
    engine.split_for = None if k == 1 else (lambda tokens, k=k, n=n: deal(n, k))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--passes", default="1r,1,2,4,8,16")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU, 2 layers of a tiny shape: the arms agree")
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", default="", help="also one profiled step of each arm: GPU busy share, kernels (FILE.md)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    config = llama8b_config(args.layers)
    if args.smoke:
        config.update({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "vocab_size": 256, "num_hidden_layers": 2})
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dtype = torch.bfloat16 if cuda else torch.float64
    with dev:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(3, config.vocab_size, (args.jobs * args.batch * 4, args.seq), generator=g)
    examples = [Example(tuple(r.tolist()), tuple(r.tolist())) for r in rows]
    engine = MultiLoraEngine(model, examples, pad_id=0, step_graphs=False, attention="varlen" if cuda else "rows")
    for i in range(args.jobs):
        r = RANKS[i % len(RANKS)]
        engine.attach(TrainJob(f"j{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=1e-4, batch_size=args.batch,
                               max_steps=100_000, seed=i, max_grad_norm=1.0))
    states = list(engine.jobs.values())
    start = [(s.adapter.flat.detach().clone(), s.stream.state_dict()) for s in states]
    tokens = args.jobs * args.batch * args.seq
    table, first, profiles = [], None, []
    for arm in args.passes.split(","):
        set_arm(engine, arm)
        with torch.no_grad():
            for s, (flat, stream) in zip(states, start, strict=True):
                s.adapter.flat.copy_(flat)
                s.stream.load_state_dict(stream)
        try:
            check = engine.step()
            if cuda:
                torch.cuda.synchronize()
            times = []
            for i in range(args.warmup + args.iters):
                if cuda:
                    torch.cuda.synchronize()
                    if i == args.warmup:
                        torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                engine.step()
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        except torch.OutOfMemoryError:
            table.append((arm, None, None, None, "out of memory"))
            print(arm, "out of memory", flush=True)
            torch.cuda.empty_cache()
            continue
        if first is None:
            first = check
        tol = 2e-2 if cuda else 1e-9
        err = max(max(abs(check.losses[j] - first.losses[j]) / max(abs(first.losses[j]), 1e-9),
                      abs(check.grad_norms[j] - first.grad_norms[j]) / max(abs(first.grad_norms[j]), 1e-9))
                  for j in first.losses)
        assert err < tol, (arm, err)
        t = statistics.median(times[args.warmup:])
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        if args.profile and cuda:
            profiles.append(profile_step(f"arm {arm}", engine.step))
        table.append((arm, t, tokens / t, peak, f"losses, grad norms vs the first arm: rel {err:.1e}"))
        print(table[-1], flush=True)
    name = torch.cuda.get_device_name() if cuda else "cpu (smoke)"
    lines = [f"# split_step on {name} (torch {torch.__version__}, {config.num_hidden_layers} layers of "
             f"{'a tiny' if args.smoke else 'Llama-3.1-8B'} shape, "
             f"{args.jobs} jobs of ranks {'/'.join(map(str, RANKS))} x batch {args.batch} x seq {args.seq} = "
             f"{tokens} tokens a step, {engine.attention} attention, eager; median of {args.iters} after {args.warmup})", "",
             "| arm | pass tokens | step s | tokens/s | peak GiB | check |", "|---|---|---|---|---|---|"]
    for arm, t, tps, peak, note in table:
        k = int(arm.rstrip("r"))
        label = "one pass, recompute" if arm.endswith("r") else f"{k} pass{'es' if k > 1 else ''}, no recompute"
        if t is None:
            lines.append(f"| {label} | {tokens // k} | | | | {note} |")
        else:
            lines.append(f"| {label} | {tokens // k} | {t:.3f} | {tps:,.0f} | {peak:.1f} | {note} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if profiles:
        Path(args.profile).write_text("\n\n".join(profiles) + "\n")


if __name__ == "__main__":
    main()
