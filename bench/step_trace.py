"""The gaps between a replayed step's kernels on the device (issue 40: a 2-job step's fixed cost).

bench/replay_wall.py found a graphed 2-job step at 32 layers of the Llama-3.1-8B shape busy in kernels 82-86% of
its wall while its graph spans 97-98% of it: the rest is the device's own time between the graph's kernels. This
script replays the same step (bench/host_profile.py's engine, after `--warmup` steps) under torch.profiler (CUDA
activity only), exports the trace and reports, over the kernels, memsets and copies of `--steps` steps in device
order: their count a step, their own time, the gaps between consecutive ones (the sum, by the kind of the work
after the gap and by the pair of kernel names around it), and the streams they ran on.

    python bench/step_trace.py [--layers 32] [--tokens 290] [--recompute 0] [--out FILE] [--trace FILE.json.gz]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


_WORK = ("kernel", "gpu_memset", "gpu_memcpy")


def short(name: str) -> str:
    """A kernel's name without its template arguments and parameters (a family of kernels, one name)."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name.replace("void ", "").split("::")[-1][:48]


def device_work(trace: dict) -> list[dict]:
    """The trace's kernels, memsets and copies in the order they started on the device."""
    work = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in _WORK]
    return sorted(work, key=lambda e: e["ts"])


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, as disjoint intervals in order."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def busy_us(work: list[dict]) -> float:
    """The device's busy time over `work` (from `device_work`): the union of its intervals (work on several
    streams at once counted once)."""
    return sum(b - a for a, b in union([(e["ts"], e["ts"] + e["dur"]) for e in work]))


def kind(e: dict) -> str:
    """A work item's family: a kernel's short name, else its category (memset, copy)."""
    return short(e["name"]) if e["cat"] == "kernel" else e["cat"]


def profiled_steps(eng, steps: int) -> tuple[object, float]:  # noqa: ANN001
    """`steps` synced engine steps under torch.profiler (CUDA activity only: a replay makes no host op to
    trace): the profile and the wall ms a step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return prof, wall * 1e3 / steps


def traced_work(prof) -> list[dict]:  # noqa: ANN001
    """A profile's device work in device order (`device_work` of its exported trace)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        return device_work(json.loads(path.read_text()))


def traced_busy(eng, steps: int) -> tuple[float, float]:  # noqa: ANN001
    """`steps` synced engine steps (`profiled_steps`): the device's busy ms a step (the union of its kernels',
    memsets' and copies' intervals) and the wall ms a step of the same steps."""
    prof, wall = profiled_steps(eng, steps)
    return busy_us(traced_work(prof)) / 1e3 / steps, wall


def report(work: list[dict], steps: int, wall_ms: float) -> tuple[dict, list[str]]:
    """The numbers of `work` (from `device_work`) a step, against the steps' wall a step, and markdown tables
    of where its gaps are."""
    if not work:
        return {"work_a_step": 0}, ["(no device work traced)"]
    streams = collections.Counter(e.get("args", {}).get("stream") for e in work)
    own = sum(e["dur"] for e in work)
    span = work[-1]["ts"] + work[-1]["dur"] - work[0]["ts"]
    by_next: dict[str, list[float]] = collections.defaultdict(list)
    by_pair: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    gaps = []
    end = work[0]["ts"] + work[0]["dur"]
    for prev, e in zip(work, work[1:], strict=False):
        gap = e["ts"] - end
        end = max(end, e["ts"] + e["dur"])
        if gap > 200:  # between steps (the host's part): not the graph's own
            continue
        gap = max(gap, 0.0)  # overlapping work on another stream
        gaps.append(gap)
        by_next[kind(e)].append(gap)
        by_pair[(kind(prev), kind(e))].append(gap)
    busy = busy_us(work) / 1e3 / steps
    numbers = {"work_a_step": len(work) / steps, "own_ms_a_step": own / 1e3 / steps,
               "span_ms_a_step": span / 1e3 / steps, "busy_ms_a_step": busy, "wall_ms_a_step": wall_ms,
               "busy_of_wall": busy / wall_ms,
               "gap_ms_a_step": sum(gaps) / 1e3 / steps, "median_gap_us": sorted(gaps)[len(gaps) // 2] if gaps else 0,
               "streams": dict(streams)}
    lines = ["| work after the gap | a step | gaps ms a step | mean gap us |", "|---|---|---|---|"]
    for k, g in sorted(by_next.items(), key=lambda kv: -sum(kv[1]))[:25]:
        lines.append(f"| {k} | {len(g) / steps:.0f} | {sum(g) / 1e3 / steps:.2f} | {sum(g) / len(g):.2f} |")
    lines += ["", "| before | after | a step | gaps ms a step | mean gap us |", "|---|---|---|---|---|"]
    for (a, b), g in sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:30]:
        lines.append(f"| {a} | {b} | {len(g) / steps:.0f} | {sum(g) / 1e3 / steps:.2f} | {sum(g) / len(g):.2f} |")
    own_by = collections.defaultdict(lambda: [0, 0.0])
    for e in work:
        entry = own_by[kind(e)]
        entry[0] += 1
        entry[1] += e["dur"]
    lines += ["", "| work | a step | own ms a step | mean us |", "|---|---|---|---|"]
    for k, (n, us) in sorted(own_by.items(), key=lambda kv: -kv[1][1])[:30]:
        lines.append(f"| {k} | {n / steps:.0f} | {us / 1e3 / steps:.2f} | {us / n:.2f} |")
    return numbers, lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=290)
    ap.add_argument("--recompute", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--trace", default="", help="where the exported trace goes (gzip JSON)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    from host_profile import build  # (host_profile imports traced_busy from here)

    eng = build(args.layers, bool(args.recompute), args.tokens)
    for _ in range(args.warmup):
        eng.step()
    torch.cuda.synchronize()
    before = dict(eng.step_graphs.stats())
    prof, wall = profiled_steps(eng, args.steps)
    after = eng.step_graphs.stats()
    work = traced_work(prof)
    if args.trace:
        with gzip.open(args.trace, "wt") as f:
            json.dump({"traceEvents": work}, f)
    numbers, lines = report(work, args.steps, wall)
    head = [f"# The gaps between a replayed step's kernels ({torch.cuda.get_device_name()}, {args.layers} layers of "
            f"the Llama-3.1-8B shape, random bf16 weights, 2 jobs: r16 b1 + r64 b4, ~{args.tokens} tokens a sample, "
            f"recompute {bool(args.recompute)})", "",
            f"{args.warmup} steps, then {args.steps} under torch.profiler (CUDA activity). Graph counts over them: "
            f"{ {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} }.", "",
            f"Numbers a step: {numbers}", ""]
    text = "\n".join(head + lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
