"""The backbone's norms, MLP gate and rotary embedding on fused kernels (trainer.fused_blocks)
against transformers' own modules and function, side by side in one process on one engine (issue 40).

At `--layers` layers of the Llama-3.1-8B shape (random bf16 weights, varlen attention) the engine
trains `--small` jobs on ~2k-token steps (CUDA graphs, as after a search's warmup ranking) and
`--large` jobs on ~13k-token steps (eager, as its first steps), with recompute off and on, and
evaluates 2 jobs over 64 examples (one no-grad forward). The arms alternate on the same engine:
`fused` is the engine as built (its modules' forwards and the rotary function swapped), `norms+MLP`
the same with transformers' own rotary function, `plain` the modules' own forwards and function
(the swaps taken off; captured graphs dropped at every switch). Per case and arm: the
median step wall over `--iters` synced steps after `--warmup`, tokens a second, and for eager
steps the transient peak per token (the allocator's peak less what was allocated before the
step). Correctness in the same run: each arm's first step from fresh jobs of the same seeds, the
losses of fused against plain.

    python bench/fused_blocks.py [--layers 32] [--out FILE] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_step import llama8b_config  # noqa: E402

from trainer.data import Example  # noqa: E402
from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.fused_blocks import use_fused_rope  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402
from trainer.step_graphs import StepGraphs  # noqa: E402

RANKS = (16, 64, 8, 32)
ARMS = ("plain", "norms+MLP", "fused")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_since(before: int) -> float:
    return float(torch.cuda.max_memory_allocated() - before) if torch.cuda.is_available() else 0.0


def examples(n: int, tokens: int, seed: int) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(tokens // 2, tokens * 3 // 2, (), generator=g))
        ids = torch.randint(0, 128000, (k,), generator=g).tolist()
        out.append(Example(tuple(ids), tuple([-100] * (k // 3) + ids[k // 3:])))
    return out


class Arms:
    """The engine's swapped forwards, taken off (plain) and put back (norms+MLP, fused), and the
    swapped rotary function (fused alone)."""

    def __init__(self, eng: MultiLoraEngine) -> None:
        self.eng = eng
        self.swapped = {m: m.__dict__["forward"] for m in eng.model.modules() if "forward" in m.__dict__}

    def use(self, arm: str, graphs: bool) -> None:
        use_fused_rope(arm == "fused")
        for m, fwd in self.swapped.items():
            if arm != "plain":
                m.forward = fwd
            else:
                m.__dict__.pop("forward", None)
        self.eng.step_graphs = StepGraphs(self.eng) if graphs else None


def fresh_jobs(eng: MultiLoraEngine, n: int, batch: int) -> None:
    for job_id in list(eng.jobs):
        eng.detach(job_id)
    for i in range(n):
        r = RANKS[i % len(RANKS)]
        eng.attach(TrainJob(f"j{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=1e-4, batch_size=batch,
                            max_steps=10**6, seed=10 + i))


def run_case(eng: MultiLoraEngine, arms: Arms, arm: str, case: dict, args: argparse.Namespace) -> dict:
    arms.use(arm, case["graphs"])
    eng.set_recompute(case["recompute"])
    fresh_jobs(eng, case["jobs"], case["batch"])
    sync()
    before = 0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    first = eng.step()
    sync()
    peak = peak_since(before) / max(1, first.tokens)
    for _ in range(args.warmup):
        eng.step()
    walls, toks = [], []
    for _ in range(args.iters):
        sync()
        t0 = time.perf_counter()
        rep = eng.step()
        sync()
        walls.append(time.perf_counter() - t0)
        toks.append(rep.tokens)
    wall = statistics.median(walls)
    return {"losses": first.losses, "wall_ms": wall * 1e3, "tokens": statistics.median(toks),
            "tok_s": statistics.median(toks) / wall, "first_peak_per_token": peak, "first_tokens": first.tokens}


def run_eval(eng: MultiLoraEngine, arms: Arms, arm: str, held: list[Example], iters: int) -> dict:
    arms.use(arm, False)
    fresh_jobs(eng, 2, 1)
    ids = list(eng.jobs)
    out = eng.evaluate_metrics(held, batch_size=len(held), job_ids=ids)
    walls = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        eng.evaluate_metrics(held, batch_size=len(held), job_ids=ids)
        sync()
        walls.append(time.perf_counter() - t0)
    tokens = 2 * sum(len(e.input_ids) for e in held)
    wall = statistics.median(walls)
    return {"metrics": {j: out[j]["loss"] for j in ids}, "wall_ms": wall * 1e3, "tokens": tokens, "tok_s": tokens / wall}


def rel_gap(a: dict[str, float], b: dict[str, float]) -> float:
    return max(abs(a[k] - v) / abs(v) for k, v in b.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=400, help="mean tokens of a sample")
    ap.add_argument("--small", type=int, default=2, help="jobs of the small steps (batch 2 each)")
    ap.add_argument("--large", type=int, default=8, help="jobs of the large steps (batch 4 each)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny model, Triton's interpreter (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    forced = {"ropes": 0}
    if args.smoke:
        from trainer.fused_blocks import fuse_blocks

        args.iters, args.warmup, args.tokens = 2, 1, 24
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=128000)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).requires_grad_(False)
        forced = fuse_blocks(model, force=True)
    else:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(llama8b_config(args.layers), dtype=torch.bfloat16)
    eng = MultiLoraEngine(model, examples(256, args.tokens, 1), 0, gradient_checkpointing=False, attention="varlen")
    arms = Arms(eng)
    n_norms = sum(1 for m in arms.swapped if "norm" in type(m).__name__.lower())
    cases = [dict(name="small, graphs, no recompute", jobs=args.small, batch=2, graphs=True, recompute=False),
             dict(name="small, graphs, recompute", jobs=args.small, batch=2, graphs=True, recompute=True),
             dict(name="large, eager, recompute", jobs=args.large, batch=4, graphs=False, recompute=True),
             dict(name="small, eager, no recompute", jobs=args.small, batch=2, graphs=False, recompute=False)]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)"
    swapped = {"norms": n_norms, "mlps": len(arms.swapped) - n_norms, "ropes": eng.fused_blocks["ropes"] or forced["ropes"]}
    rows, results = [], {"device": device, "args": vars(args), "fused": swapped, "cases": {}}
    for case in cases:
        got = {arm: run_case(eng, arms, arm, case, args) for arm in ARMS}
        gap = rel_gap(got["fused"]["losses"], got["plain"]["losses"])
        results["cases"][case["name"]] = {**got, "loss_gap": gap}
        p, n, f = got["plain"], got["norms+MLP"], got["fused"]
        rows.append(f"| {case['name']} | {case['jobs']} | {p['tokens']:.0f} | {p['wall_ms']:.1f} | {n['wall_ms']:.1f} | "
                    f"{f['wall_ms']:.1f} | {p['tok_s']:,.0f} | {f['tok_s']:,.0f} | {n['wall_ms'] / f['wall_ms']:.3f}x | "
                    f"{p['wall_ms'] / f['wall_ms']:.2f}x | {p['first_peak_per_token'] / 2**20:.2f} | "
                    f"{f['first_peak_per_token'] / 2**20:.2f} | {gap:.1e} |")
        print(rows[-1], flush=True)
    held = examples(64, args.tokens, 2)
    ev = {arm: run_eval(eng, arms, arm, held, args.iters) for arm in ARMS}
    gap = rel_gap(ev["fused"]["metrics"], ev["plain"]["metrics"])
    results["cases"]["evaluation"] = {**ev, "loss_gap": gap}
    p, n, f = ev["plain"], ev["norms+MLP"], ev["fused"]
    rows.append(f"| evaluation forward, 2 jobs x 64 examples | 2 | {p['tokens']} | {p['wall_ms']:.1f} | {n['wall_ms']:.1f} | "
                f"{f['wall_ms']:.1f} | {p['tok_s']:,.0f} | {f['tok_s']:,.0f} | {n['wall_ms'] / f['wall_ms']:.3f}x | "
                f"{p['wall_ms'] / f['wall_ms']:.2f}x | - | - | {gap:.1e} |")
    print(rows[-1], flush=True)
    text = "\n".join([
        f"# Fused norms, MLP gate and rotary embedding against transformers' own ({results['device']}, {args.layers} layers of the "
        f"Llama-3.1-8B shape, random bf16 weights, varlen attention, samples of ~{args.tokens} tokens)", "",
        f"One engine, arms alternating per case; fused swapped {swapped['norms']} norms, "
        f"{swapped['mlps']} MLPs and the rotary function of {swapped['ropes']} attention layers; norms+MLP is "
        f"fused with transformers' own rotary function. Median of {args.iters} synced steps after {args.warmup}; "
        "peak/token: the first step's transient peak over its tokens (eager steps; a graphed step's first "
        "step is its capture); loss gap: the largest relative difference of a job's first-step loss "
        "(evaluation: its loss) between the arms.", "",
        "| case | jobs | tokens | plain ms | norms+MLP ms | fused ms | plain tok/s | fused tok/s | rotary's speedup "
        "(norms+MLP / fused) | speedup (plain / fused) | plain peak MiB/token | fused peak MiB/token | loss gap |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|", *rows]) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
