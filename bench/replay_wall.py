"""Where a graphed 2-job step's wall goes beyond its graph (issue 40: the host must not bound a step).

At 32 layers of the Llama-3.1-8B shape (random bf16 weights), 2 jobs (rank 16 batch 1, rank 64 batch 4) on
samples of ~`--tokens` tokens (bench/host_profile.py's engine), after `--warmup` steps (their captures), each
of `--iters` steps is timed on the host and on the device with CUDA events recorded around the graph's
`replay()` call. Every step syncs once (its numbers), so the device is idle when the next one begins; the
events split each step's device timeline into

- `pre`: step start -> replay call (the host packs and fills the key's buffers; the device is idle),
- `graph`: the replay's event pair (the launch's delay, if any, plus the graph),
- `tail`: graph end -> the step's return (its norms and updates, the sync, the host's bookkeeping),

against the same graph's replays back to back (`b2b`: no host between them). `graph - b2b` is what the
launch keeps the device waiting; `pre + tail - update` is the idle a step's host work leaves.

    python bench/replay_wall.py [--layers 32] [--tokens 290] [--recompute 0,1] [--out FILE]
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

from host_profile import back_to_back_ms, build  # noqa: E402
from step_trace import profiled_steps  # noqa: E402


class _Timed:
    """A captured graph whose replays record a CUDA event pair and the launch call's host time."""

    def __init__(self, graph, log: list) -> None:  # noqa: ANN001
        self.graph, self.log = graph, log

    def replay(self) -> None:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        self.graph.replay()
        t1 = time.perf_counter()
        e1.record()
        self.log.append((e0, e1, t1 - t0))


def measure(eng, warmup: int, iters: int) -> dict:  # noqa: ANN001
    for _ in range(warmup):
        eng.step()
    torch.cuda.synchronize()
    sg = eng.step_graphs
    log: list = []
    originals = {}
    for key, entry in sg.entries.items():
        if entry.graph is not None and key.train:
            originals[key] = entry.graph
            entry.graph = _Timed(entry.graph, log)
    if not originals:
        raise SystemExit("no training graph was captured in the warmup steps")
    rows = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = len(log)
        start.record()
        t0 = time.perf_counter()
        rep = eng.step()
        wall = time.perf_counter() - t0
        end.record()
        torch.cuda.synchronize()
        if len(log) != n + 1:
            continue  # a step that captured (a new key) or ran eagerly: not a plain replay
        e0, e1, launch = log[-1]
        rows.append({"wall": wall * 1e3, "device": start.elapsed_time(end), "pre": start.elapsed_time(e0),
                     "graph": e0.elapsed_time(e1), "tail": e1.elapsed_time(end), "launch": launch * 1e3,
                     "tokens": rep.tokens})
    for key, g in originals.items():
        sg.entries[key].graph = g
    kernels_ms, profiled_wall = profiled(eng, iters)
    # the graph alone: replays back to back (the key replayed last: the timed steps' own, as a rule)
    key = max(originals, key=lambda k: sg.entries[k].last)
    b2b = back_to_back_ms(originals[key], iters)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}
    return {"steps": len(rows), "key_tokens": key.tokens, "b2b": b2b, "kernels": kernels_ms,
            "profiled_wall": profiled_wall, **med}


def profiled(eng, steps: int) -> tuple[float, float]:  # noqa: ANN001
    """The kernels' own time a step by torch.profiler's `key_averages` (it misses part of a replay's kernels:
    bench/step_trace.py reads the trace itself) and the wall a step over the same `steps` synced steps, in ms."""
    prof, wall = profiled_steps(eng, steps)
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    return kernel_us / 1e3 / steps, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=290)
    ap.add_argument("--recompute", default="0,1")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    lines = [f"# A graphed 2-job step's wall beyond its graph ({torch.cuda.get_device_name()}, {args.layers} layers "
             f"of the Llama-3.1-8B shape, random bf16 weights, 2 jobs: r16 b1 + r64 b4, ~{args.tokens} tokens a "
             "sample)", "",
             f"{args.warmup} steps, then the medians of {args.iters} synced steps that replayed (ms). `b2b`: the "
             "last replayed key's graph replayed back to back. `graph - b2b`: the launch's delay. `graph / wall`: "
             "the share of a step's wall its graph runs on the device. Then "
             f"{args.iters} more steps under torch.profiler (CUDA activity only): their kernels' own time a step "
             "against their wall a step (`kernels / wall`: the device busy in kernels; the rest of a graph's span "
             "is the gaps between its kernels on the device).", "",
             "| recompute | steps | tokens | key rows | wall | device | pre | graph | b2b | graph - b2b | tail | "
             "launch call (host) | graph / wall | profiled wall | kernels | kernels / wall |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rc in [bool(int(v)) for v in args.recompute.split(",")]:
        eng = build(args.layers, rc, args.tokens)
        m = measure(eng, args.warmup, args.iters)
        lines.append(f"| {rc} | {m['steps']} | {m.get('tokens', 0):.0f} | {m['key_tokens']} | {m.get('wall', 0):.1f} | "
                     f"{m.get('device', 0):.1f} | {m.get('pre', 0):.2f} | {m.get('graph', 0):.1f} | {m['b2b']:.1f} | "
                     f"{m.get('graph', 0) - m['b2b']:.2f} | {m.get('tail', 0):.2f} | {m.get('launch', 0):.2f} | "
                     f"{m.get('graph', 0) / max(m.get('wall', 0), 1e-9):.1%} | {m['profiled_wall']:.1f} | "
                     f"{m['kernels']:.1f} | {m['kernels'] / m['profiled_wall']:.1%} |")
        print(lines[-1], flush=True)
        del eng
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
