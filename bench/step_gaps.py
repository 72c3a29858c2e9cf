"""Where a replayed small step leaves the GPU idle, and what the host does meanwhile (issue 40).

A 2-job step of ~1.4k tokens at 32 layers of the Llama-3.1-8B shape replays its forward and
backward as one CUDA graph, yet the GPU idles ~8% of its wall (bench/host_profile.py, session 45:
124.4 ms a step, 113.8 ms busy). This script builds host_profile's engine (2 jobs, r16 b1 + r64 b4,
varlen, no recompute, graphs), labels the host's parts of a step (torch.profiler record_function:
the step, the batch's packing, the graph buffers' fill, the replay, the norms and the sync, the
update), profiles `--steps` steps, and reports every interval in which no kernel or copy ran on the
device, with the host parts that ran during it.

    python bench/step_gaps.py [--layers 32] [--tokens 290] [--steps 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_profile import build  # noqa: E402
from step_trace import union  # noqa: E402
from task_e2e_data import emit  # noqa: E402

LABELS = {  # (module, owner, attribute) -> the label of its host time
    ("trainer.engine", "MultiLoraEngine", "step"): "step",
    ("trainer.step_graphs", None, "pack_flat"): "pack",
    ("trainer.step_graphs", "StepGraphs", "_fill"): "fill",
    ("trainer.arena", "AdapterArena", "layout_offsets"): "layout",
    ("trainer.engine", None, "sync_and_update"): "update",  # the sync and every job's update (session 50)
    ("trainer.step_update", None, "update_on_device"): "update_on_device",
    ("trainer.jobs", None, "multi_adamw"): "adamw",
    ("torch.cuda.graphs", "CUDAGraph", "replay"): "replay",
}


def _labelled(fn, label: str):  # noqa: ANN001, ANN202
    @functools.wraps(fn)
    def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
        with torch.profiler.record_function(f"@{label}"):
            return fn(*a, **k)
    return run


def label_host_parts() -> None:
    import importlib

    for (mod, owner, attr), label in LABELS.items():
        m = importlib.import_module(mod)
        target = getattr(m, owner) if owner else m
        setattr(target, attr, _labelled(getattr(target, attr), label))
    import trainer.jobs as jobs_mod
    import trainer.step_update as update_mod  # the step's update is called from there (session 50)
    update_mod.update_jobs = _labelled(jobs_mod.update_jobs, "update_jobs")


def gaps_of(events: list, min_us: float) -> tuple[list[tuple[float, float]], dict, float, float]:
    """The device's idle intervals inside the host's labelled steps, and the host time of each
    label (and of each CUDA runtime call) inside them."""
    cuda = torch.autograd.DeviceType.CUDA
    busy = union([(e.time_range.start, e.time_range.end) for e in events if e.device_type == cuda])
    steps = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == "@step")
    lo, hi = steps[0][0], steps[-1][1]
    gaps, t = [], lo
    for a, b in busy:
        if b <= lo:
            continue
        if a > t and a - t >= min_us:
            gaps.append((t, min(a, hi)))
        t = max(t, b)
        if t >= hi:
            break
    if hi - t >= min_us:
        gaps.append((t, hi))
    host = [e for e in events if e.device_type != cuda and (e.name.startswith("@") or e.name.startswith("cuda"))]
    share: dict[str, float] = defaultdict(float)
    for a, b in gaps:
        for e in host:
            o = min(b, e.time_range.end) - max(a, e.time_range.start)
            if o > 0:
                share[e.name] += o
    return gaps, share, hi - lo, sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in busy)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=290)
    ap.add_argument("--warmup", type=int, default=14)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    label_host_parts()
    eng = build(args.layers, False, args.tokens)
    walls = []
    for i in range(args.warmup):
        t0 = time.perf_counter()
        rep = eng.step()
        torch.cuda.synchronize()
        if i >= args.warmup // 2:
            walls.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eng.step()
        torch.cuda.synchronize()
    events = list(prof.events())
    gaps, share, span, busy = gaps_of(events, args.min_gap_us)
    idle = sum(b - a for a, b in gaps)
    n = args.steps
    lines = [f"# Device idle in a replayed small step ({torch.cuda.get_device_name()}, {args.layers} layers of the "
             f"Llama-3.1-8B shape, 2 jobs r16 b1 + r64 b4, ~{args.tokens} tokens a sample, no recompute)", "",
             f"Unprofiled step wall (median of {len(walls)}): **{statistics.median(walls) * 1e3:.1f} ms**, "
             f"{rep.tokens} tokens; graphs {eng.step_graphs.stats()}.",
             f"Profiled {n} steps: {span / 1e3 / n:.1f} ms a step, device busy {busy / 1e3 / n:.1f} ms, idle "
             f"{idle / 1e3 / n:.1f} ms a step in {len(gaps) / n:.1f} gaps of >= {args.min_gap_us:.0f} us.", "",
             "| host part (label or CUDA runtime call) | its time inside the idle, ms a step |", "|---|---|"]
    lines += [f"| {k} | {v / 1e3 / n:.2f} |" for k, v in sorted(share.items(), key=lambda kv: -kv[1])[:25]]
    lines += ["", "Gaps of the last step (start after the step's start, ms; length, us):", ""]
    last = max(e.time_range.start for e in events if e.name == "@step")
    lines += [f"- +{(a - last) / 1e3:.2f} ms: {b - a:.0f} us" for a, b in gaps if a >= last]
    emit("\n".join(lines) + "\n", {}, args)


if __name__ == "__main__":
    main()
