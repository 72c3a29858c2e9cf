"""Host time of a small engine step: where Python and launches spend it (issue 32).

A step after the warmup ranking trains few jobs on a few thousand tokens; at 32 layers of the
Llama-3.1-8B shape it is bound by the host, not the GPU. This script builds the engine on
`--layers` layers (random bf16 weights), attaches 2 jobs (rank 16 batch 1, rank 64 batch 4) on
samples of ~`--tokens` tokens, and reports: the step's wall time (synced), the GPU's busy time
in it (torch.profiler's kernel time), the host time per LoRA linear and per kernel launch, the
top functions by own host time (cProfile), and a launch microbenchmark of one fused kernel
(`Tuned` launch vs the JIT function called directly).

    python bench/host_profile.py [--layers 8] [--recompute 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
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
from trainer.jobs import TrainJob  # noqa: E402


def build(layers: int, recompute: bool, tokens: int) -> MultiLoraEngine:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(llama8b_config(layers), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    ex = []
    for _ in range(64):
        n = int(torch.randint(tokens // 2, tokens * 3 // 2, (), generator=g))
        ids = torch.randint(0, 128000, (n,), generator=g).tolist()
        ex.append(Example(tuple(ids), tuple([-100] * (n // 3) + ids[n // 3:])))
    eng = MultiLoraEngine(model, ex, 0, gradient_checkpointing=recompute, attention="varlen")
    eng.attach(TrainJob("a", lora_rank=16, lora_alpha=32, learning_rate=1e-4, batch_size=1, max_steps=10**6, seed=1))
    eng.attach(TrainJob("b", lora_rank=64, lora_alpha=128, learning_rate=1e-4, batch_size=4, max_steps=10**6, seed=2))
    return eng


def main() -> None:  # noqa: PLR0915
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--recompute", type=int, default=1)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    eng = build(args.layers, bool(args.recompute), args.tokens)
    n_linears = len(eng.layer_list)
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    walls, toks = [], []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        rep = eng.step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        toks.append(rep.tokens)
    wall = statistics.median(walls)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 3
    launches = sum(e.count for e in events if e.key in ("cuLaunchKernel", "cudaLaunchKernel", "cuLaunchKernelEx",
                                                          "cudaLaunchKernelExC")) / 3
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    # launch microbenchmark: one fused shrink at the step's shape, table launch vs direct JIT call
    from kernels import fused_lora as fl

    micro = {}
    try:
        x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
        lay_arena = eng.arena.to(torch.bfloat16)
        offs = torch.tensor([0, 1024, 2048], device="cuda")
        ranks = torch.tensor([16, 64], device="cuda", dtype=torch.int32)
        scales = torch.ones(2, device="cuda")
        woff = torch.tensor([0, 16 * 4096], device="cuda")
        c = fl._Ctx(x, 2, 64, offs, ranks, scales)
        p = torch.empty(2048, 64, device="cuda", dtype=torch.float32)

        def table() -> None:
            fl._shrink_launch(c, x, lay_arena, fl._arena_rank_major(4096), woff, p, 16)

        for name, fn in (("table launch", table),):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(500):
                fn()
            host = (time.perf_counter() - t0) / 500
            torch.cuda.synchronize()
            micro[name] = host * 1e6
    except Exception as e:  # noqa: BLE001 (the microbenchmark is a side reading)
        micro["error"] = repr(e)[:200]
    lines = [f"# Host time of a small engine step ({torch.cuda.get_device_name()}, {args.layers} layers, "
             f"recompute {bool(args.recompute)}, 2 jobs: r16 b1 + r64 b4, ~{args.tokens} tokens a sample)", "",
             f"- step wall (median of {args.iters}, synced): {wall * 1e3:.1f} ms for {statistics.median(toks):.0f} "
             f"tokens; GPU busy {gpu_us / 1e3:.1f} ms ({gpu_us / 1e3 / (wall * 1e3):.0%} of the wall)",
             f"- LoRA linears: {n_linears}; wall per linear {wall * 1e3 / n_linears:.3f} ms; kernel launches per "
             f"step {launches:.0f} ({launches / n_linears:.1f} per linear)",
             f"- launch microbenchmark (host us per call): {micro}", "",
             "## cProfile, 3 steps, by own time", "", "```", s.getvalue()[:9000], "```", "",
             "## torch.profiler, 3 steps, by self CPU time", "", "```",
             events.table(sort_by="self_cpu_time_total", row_limit=25)[:9000], "```"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
