"""Host time of a small engine step: where Python and launches spend it (issue 32).

A step after the warmup ranking trains few jobs on a few thousand tokens; at 32 layers of the
Llama-3.1-8B shape it is bound by the host, not the GPU. This script builds the engine on
`--layers` layers (random bf16 weights), attaches 2 jobs (rank 16 batch 1, rank 64 batch 4) on
samples of ~`--tokens` tokens, and reports per mode (eager launches, CUDA graphs) and recompute
setting: the step's wall time (synced), the GPU's busy time in it (torch.profiler's kernel time),
the kernel launches the host makes, and the top ops by host time.

    python bench/host_profile.py [--layers 32] [--recompute 1,0] [--modes eager,graphs] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_step import llama8b_config  # noqa: E402
from step_trace import traced_busy  # noqa: E402

from trainer.data import Example  # noqa: E402
from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402


def build(layers: int, recompute: bool, tokens: int) -> MultiLoraEngine:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(llama8b_config(layers), dtype=torch.bfloat16)
    eng = MultiLoraEngine(model, samples(64, tokens // 2, tokens * 3 // 2, 0, 128000), 0,
                          gradient_checkpointing=recompute, attention="varlen")
    attach_pair(eng)
    return eng


def samples(count: int, lo: int, hi: int, vocab_lo: int, vocab_hi: int) -> list[Example]:
    """`count` samples of lo..hi-1 tokens (ids vocab_lo..vocab_hi-1, seeded), the first third of each a prompt."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        n = int(torch.randint(lo, hi, (), generator=g))
        ids = torch.randint(vocab_lo, vocab_hi, (n,), generator=g).tolist()
        out.append(Example(tuple(ids), tuple([-100] * (n // 3) + ids[n // 3:])))
    return out


def attach_pair(eng: MultiLoraEngine) -> None:
    """The small step's two jobs: rank 16 batch 1 and rank 64 batch 4."""
    eng.attach(TrainJob("a", lora_rank=16, lora_alpha=32, learning_rate=1e-4, batch_size=1, max_steps=10**6, seed=1))
    eng.attach(TrainJob("b", lora_rank=64, lora_alpha=128, learning_rate=1e-4, batch_size=4, max_steps=10**6, seed=2))


def measure(eng: MultiLoraEngine, warmup: int, iters: int, stacks: int = 0) -> dict:
    """One mode's numbers: step wall (median, synced), tokens, GPU busy (torch.profiler's kernel
    time over 3 steps, graph replays' kernels included), kernel launches from the host; with
    `stacks`, the ops' own GPU time by their callers (`op_table`)."""
    for _ in range(warmup):
        eng.step()
    torch.cuda.synchronize()
    before = dict(eng.step_graphs.stats()) if eng.step_graphs is not None else {}
    walls, toks = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        rep = eng.step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        toks.append(rep.tokens)
    after = dict(eng.step_graphs.stats()) if eng.step_graphs is not None else {}
    from torch.profiler import ProfilerActivity, profile

    # Python frames reach the events only with the verbose experimental config (torch 2.11-2.13)
    verbose = {"experimental_config": torch._C._profiler._ExperimentalConfig(verbose=True)} if stacks else {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stacks > 0, **verbose) as prof:
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    by_op = op_table(prof, stacks) if stacks > 0 else ""
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 3
    launches = sum(e.count for e in events if e.key in ("cuLaunchKernel", "cudaLaunchKernel", "cuLaunchKernelEx",
                                                          "cudaLaunchKernelExC")) / 3
    graph_launches = sum(e.count for e in events if e.key in ("cudaGraphLaunch", "cuGraphLaunch")) / 3
    wall = statistics.median(walls)
    traced, traced_wall = traced_steps(eng)
    return {"wall_ms": wall * 1e3, "replay": replay_only(eng, iters), "tokens": statistics.median(toks),
            "traced_ms": traced, "traced_wall_ms": traced_wall,
            "gpu_ms": gpu_us / 1e3,
            "busy": gpu_us / 1e3 / (wall * 1e3), "launches": launches, "graph_launches": graph_launches,
            "graphs": {k: after.get(k, 0) - before.get(k, 0) for k in after}, "events": events, "by_op": by_op}


def traced_steps(eng: MultiLoraEngine, tries: int = 4) -> tuple[float, float]:
    """`traced_busy` over 3 steps that replayed (a step that captured a new key or ran eagerly spends its host
    part with the device idle, which says nothing of a replayed step's pace): tried up to `tries` times, then
    NaN (no clean measure)."""
    for _ in range(tries):
        before = eng.step_graphs.stats() if eng.step_graphs is not None else {}
        traced = traced_busy(eng, 3)
        after = eng.step_graphs.stats() if eng.step_graphs is not None else {}
        if all(after.get(k, 0) == before.get(k, 0) for k in ("captures", "eager_runs")):
            return traced
    return math.nan, math.nan


def op_table(prof, frames: int, rows: int = 30) -> str:  # noqa: ANN001
    """The aten ops whose own kernels take the most GPU time over the 3 steps, summed by op and
    caller (the innermost `frames` Python frames outside torch; a module's instance number dropped,
    so the 32 layers' calls add up), with their largest kernel (an eager step: a replay has no ops)."""
    groups: dict[tuple[str, str], list] = {}
    for e in prof.events():
        kernels = getattr(e, "kernels", None) or []
        if not e.key.startswith("aten::") or not kernels:
            continue
        own = [f.strip() for f in (e.stack or []) if "torch/" not in f and "built-in" not in f]
        where = re.sub(r"_\d+\b", "", " <- ".join(own[:frames])) or "? (autograd's thread)"
        g = groups.setdefault((e.key, where), [0, 0.0, {}])
        g[0] += 1
        for k in kernels:
            g[1] += k.duration
            g[2][k.name] = g[2].get(k.name, 0.0) + k.duration
    top = sorted(groups.items(), key=lambda kv: -kv[1][1])[:rows]
    out = ["| aten op | calls a step | own GPU ms a step | its largest kernel | called from (innermost first) |",
           "|---|---|---|---|---|"]
    for (op, where), (n, us, names) in top:
        kernel = max(names, key=names.get)[:60]
        out.append(f"| {op} | {n / 3:.0f} | {us / 3e3:.2f} | {kernel} | {where[:260]} |")
    return "\n".join(out) + "\n"


def replay_only(eng: MultiLoraEngine, iters: int) -> str:
    """Each captured graph's GPU time alone: `iters` replays back to back (no host work between
    them), synced once, per replay in ms; what a step's wall spends beyond it is the host's. The
    replays really run their step's forward and backward (gradients, not updates): timings only."""
    sg = eng.step_graphs
    if sg is None or not torch.cuda.is_available():
        return ""
    return "; ".join(f"{key.tokens} rows: {back_to_back_ms(entry.graph, iters):.1f} ms"
                     for key, entry in sg.entries.items() if entry.graph is not None and key.train)


def back_to_back_ms(graph, iters: int) -> float:  # noqa: ANN001
    """A captured graph's ms a replay over `iters` replays back to back (after one, synced once)."""
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--recompute", default="1,0", help="recompute settings to run, e.g. 1,0")
    ap.add_argument("--modes", default="eager,graphs", help="eager (host launches) and/or graphs (CUDA graphs)")
    ap.add_argument("--warmup", type=int, default=24, help="steps before timing (the graphs capture their shapes)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--stacks", type=int, default=0,
                    help="eager steps: a table of the aten ops' own GPU time by this many calling frames")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from trainer.step_graphs import StepGraphs

    recomputes = [bool(int(v)) for v in args.recompute.split(",")]
    eng = build(args.layers, recomputes[0], args.tokens)
    n_linears = len(eng.layer_list)
    rows, tables = [], []
    for recompute in recomputes:
        eng.set_recompute(recompute)
        for mode in args.modes.split(","):
            eng.step_graphs = StepGraphs(eng) if mode == "graphs" else None
            m = measure(eng, args.warmup, args.iters, args.stacks if mode == "eager" else 0)
            rows.append(f"| {recompute} | {mode} | {m['wall_ms']:.1f} | {m['tokens']:.0f} | {m['gpu_ms']:.1f} | "
                        f"{m['busy']:.0%} | {m['tokens'] / m['wall_ms'] * 1e3:,.0f} | {m['launches']:.0f} | "
                        f"{m['graph_launches']:.0f} | {m['graphs'] or ''} | {m['traced_wall_ms']:.1f} | "
                        f"{m['traced_ms']:.1f} | {m['traced_ms'] / m['traced_wall_ms']:.0%} |")
            print(rows[-1], flush=True)
            if m["replay"]:
                tables.append(f"Graph replays back to back (recompute {recompute}): {m['replay']}\n")
                print(tables[-1], flush=True)
            if m["by_op"]:
                tables.append(f"### recompute {recompute}, {mode}: the aten ops' own GPU time by caller\n\n{m['by_op']}")
            tables.append(f"### recompute {recompute}, {mode}: torch.profiler, 3 steps, by self CPU time\n\n```\n"
                          + m["events"].table(sort_by="self_cpu_time_total", row_limit=12)[:5000] + "\n```\n")
            tables.append(f"### recompute {recompute}, {mode}: the same 3 steps' kernels, by GPU time\n\n```\n"
                          + m["events"].table(sort_by="self_device_time_total", row_limit=25,
                                              max_name_column_width=70)[:9000] + "\n```\n")
            eng.step_graphs = None
    lines = [f"# Host time of a small engine step ({torch.cuda.get_device_name()}, {args.layers} layers of the "
             f"Llama-3.1-8B shape, random bf16 weights, varlen attention, 2 jobs: r16 b1 + r64 b4, "
             f"~{args.tokens} tokens a sample, {n_linears} LoRA linears)", "",
             f"Each mode: {args.warmup} steps, then the median of {args.iters} synced steps; GPU busy = torch.profiler's "
             "kernel time over 3 more steps / the median wall. `graphs`: the forward and backward replayed as CUDA "
             "graphs (trainer.step_graphs); the counts are of the timed steps. The last three columns measure busy "
             "on the same steps as their wall: 3 more synced steps under torch.profiler's CUDA activity alone, the "
             "device busy = the union of their kernels', memsets' and copies' intervals (bench/step_trace.py; the "
             "op table's kernel sum above misses part of a replay's kernels and mixes steps of other keys).", "",
             "| recompute | mode | step wall ms | tokens | GPU busy ms | GPU busy % of wall | tok/s | "
             "kernel launches from the host | graph launches | graph counts | traced steps' wall ms | "
             "their device busy ms | busy % (same steps) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|", *rows, "", *tables]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
