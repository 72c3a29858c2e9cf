"""What a graphed step's padding costs (issue 40: the 200-step task's 2-job steps run ~8.8% padded rows).

`pack_flat` rounds a step's tokens up to `per_octave` sizes per doubling and a step may replay a
larger capture (a cover), so a step of R real tokens runs a row of L >= R. Today the padding tail is
the last job's rows (every kernel works on it). Whether it is worth making padding free (the step's
real token count among the graph's device ints, the fused GEMM skipping row tiles past it) depends
on what L - R rows cost: tiles and waves may make a few more rows free, or not.

This script builds host_profile's engine (2 jobs, r16 b1 + r64 b4, varlen, no recompute), fixes one
batch of R real tokens, and times the graphed forward + backward (`StepGraphs.forward_backward`, the
update left out) with the row forced to each length L (covers off: each L its own capture), median
of `--iters` replays after a warm-up, synchronised. The losses of every L are checked equal to the
unpadded row's (the padding trains nothing).

    python bench/pad_cost.py [--layers 32] [--tokens 290] [--iters 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_profile import build  # noqa: E402
from task_e2e_data import emit  # noqa: E402

import trainer.step_graphs as sg_mod  # noqa: E402
from trainer.packing import bucket_up, pack_flat  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=290)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if torch.cuda.is_available():
        from kernels.shipped_cache import seed

        seed()  # the shipped kernels, as an executor seeds them: nothing compiles in the timing
    eng = build(args.layers, False, args.tokens)
    graphs = eng.step_graphs
    graphs._cover_for = lambda *_a: None  # each length its own capture (a smaller one could serve its real tokens)
    states = [s for s in eng.jobs.values() if not s.done]
    per_job = [[eng.train_examples[i] for i in s.stream.next_indices(s.spec.batch_size)] for s in states]
    real = sum(len(e.input_ids) for seqs in per_job for e in seqs)
    forced = {"length": real}

    def packed(per_job, pad_id, per_octave=16, max_cells=None, length=None, max_len=None):  # noqa: ANN001, ANN202
        return pack_flat(per_job, pad_id, length=forced["length"], max_len=max_len)

    sg_mod.pack_flat = packed
    fills: list[float] = []  # the graph buffers' fill, host seconds (unprofiled: session 45's profile said 3.6 ms)
    fill = graphs._fill

    def timed_fill(*a):  # noqa: ANN002, ANN202
        t0 = time.perf_counter()
        try:
            return fill(*a)
        finally:
            fills.append(time.perf_counter() - t0)

    graphs._fill = timed_fill
    lengths = sorted({real, real + 32, real + 128, real + 256, bucket_up(real, 4), bucket_up(real, 2),
                      bucket_up(real, 1), bucket_up(real, 1) * 2})
    rows, ref = [], None
    t_all = time.perf_counter()
    for length in lengths:
        forced["length"] = length
        for _ in range(3):  # eager (the class's first), capture, replay
            _, losses = graphs.forward_backward(states, per_job)
        torch.cuda.synchronize()
        walls = []
        fills.clear()
        for _ in range(args.iters):
            t0 = time.perf_counter()
            _, losses = graphs.forward_backward(states, per_job)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        got = torch.cat(losses).double().cpu()
        ref = got if ref is None else ref
        rows.append((length, statistics.median(walls), float((got - ref).abs().max()), statistics.median(fills)))
        print(f"L={length}: {rows[-1][1] * 1e3:.1f} ms, loss diff {rows[-1][2]:.2e}", flush=True)
    base = rows[0][1]
    lines = [f"# What padding costs a graphed 2-job step ({torch.cuda.get_device_name()}, {args.layers} layers of "
             f"the Llama-3.1-8B shape, r16 b1 + r64 b4, no recompute, forward + backward without the update)", "",
             f"One batch of **{real} real tokens**, the row forced to each length (covers off), median of "
             f"{args.iters} replays after a capture; graphs {graphs.stats()}; {time.perf_counter() - t_all:.0f} s.", "",
             "| row length L | padding | ms | ms over L = R | ms per 100 padded rows | max loss diff vs L = R "
             "| host fill ms |", "|---|---|---|---|---|---|---|"]
    for length, wall, diff, fill_s in rows:
        pad = length - real
        per100 = f"{(wall - base) * 1e3 / pad * 100:.2f}" if pad else "-"
        lines.append(f"| {length} | {pad / real:+.1%} | {wall * 1e3:.1f} | {(wall - base) * 1e3:+.1f} | {per100} | "
                     f"{diff:.1e} | {fill_s * 1e3:.2f} |")
    emit("\n".join(lines) + "\n", {}, args)


if __name__ == "__main__":
    main()
