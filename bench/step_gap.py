"""Where a replayed small step's wall goes beyond its graph (issue 40): the host's path between two replays.

In the 200-step task a replayed 2-job step at the 1,536-row key takes ~110 ms of wall, while its graph replays
back to back in ~99 ms (session 64, bench/results/session64_h200.md). This script times the gap on the bare
engine (host_profile's 2-job step, CUDA graphs, no recompute): steps run back to back as the executor runs them
(no sync of its own between steps), and each step's host path is cut at its calls:

- pre: from the step's start to the graph call (the jobs' next examples, the token counts, the memory plan);
- graph call: `step_graphs.forward_backward` (the step key, the inputs' fill and copy, the replay's launch), and
  inside it: key (`graph_parts.step_key`: the packing), fill (`StepGraphs._fill`: the pinned mirror and its copy to
  the key's buffers) and graph launch (`CUDAGraph.replay`'s host time);
- ahead: `graph_ahead.capture_next` (a capture of the next step's key, if it makes one);
- launch: the norms and the numbers' concatenation, up to the sync;
- wait: blocked in the sync (the device still running the step);
- update: the jobs' updates launched after the sync (host decisions), or before it (`--device-update`);
- report: the step's report after the update.

After the wait the device has nothing queued but the updates, so the host's time from the wait's end to the next
step's graph launch (update + report + the next step's pre and graph call) is the device's idle between two
steps, less the updates' own device time. It prints the medians and the wall a step against the replays
back to back.

    python3 bench/step_gap.py [--layers 32] [--tokens 290] [--steps 40] [--device-update] [--out FILE]
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

class Clock:
    """Timestamps of one step's cut points (perf_counter seconds)."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()

    def close(self) -> None:
        self.steps.append(self.marks)
        self.marks = {}


def _wrap(owner: object, name: str, before: str, after: str, clock: Clock) -> None:
    own = getattr(owner, name)

    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        clock.mark(before)
        try:
            return own(*args, **kwargs)
        finally:
            clock.mark(after)

    setattr(owner, name, timed)


def instrument(eng, clock: Clock) -> None:  # noqa: ANN001
    """Cut points on the engine's calls (bench only: module attributes and the instance's methods)."""
    import trainer.engine as engine_mod
    import trainer.graph_ahead as graph_ahead
    import trainer.graph_parts as graph_parts
    import trainer.step_update as step_update

    _wrap(eng.step_graphs, "forward_backward", "graph_start", "graph_end", clock)
    _wrap(graph_parts, "step_key", "key_start", "key_end", clock)
    _wrap(eng.step_graphs, "_fill", "fill_start", "fill_end", clock)
    _wrap(torch.cuda.CUDAGraph, "replay", "launch_start", "launch_end", clock)
    _wrap(graph_ahead, "capture_next", "ahead_start", "ahead_end", clock)
    _wrap(engine_mod, "sync_and_update", "sync_start", "sync_end", clock)
    _wrap(step_update, "update_jobs", "update_start", "update_end", clock)
    _wrap(step_update, "update_on_device", "update_start", "update_end", clock)
    _wrap(eng, "_report", "report_start", "report_end", clock)
    own_sync = torch.cuda.Event.synchronize

    def sync(self):  # noqa: ANN001, ANN202
        clock.mark("wait_start")
        try:
            return own_sync(self)
        finally:
            clock.mark("wait_end")

    torch.cuda.Event.synchronize = sync


def segments(m: dict[str, float], nxt: dict[str, float] | None) -> dict[str, float]:
    """One step's segments in ms, and the device's idle estimate (host time from the wait's end to the next
    step's graph call's end)."""
    ms = lambda a, b: (m[b] - m[a]) * 1e3  # noqa: E731
    out = {"pre": ms("step_start", "graph_start"), "graph call": ms("graph_start", "graph_end"),
           "key": ms("key_start", "key_end") if "key_start" in m else 0.0,
           "fill": ms("fill_start", "fill_end") if "fill_start" in m else 0.0,
           "graph launch": ms("launch_start", "launch_end") if "launch_start" in m else 0.0,
           "ahead": ms("ahead_start", "ahead_end") if "ahead_start" in m else 0.0,
           "launch": ms("ahead_end" if "ahead_end" in m else "graph_end", "sync_start"),
           "wait": ms("wait_start", "wait_end"),
           "update": ms("update_start", "update_end") if "update_start" in m else 0.0,
           "report": ms("report_start", "report_end"), "step": ms("step_start", "step_end")}
    if nxt is not None:
        out["host between replays"] = (nxt["graph_end"] - m["wait_end"]) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=290)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device-update", action="store_true", help="the updates decided on the device (before the sync)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from host_profile import back_to_back_ms, build

    import trainer.step_update as step_update

    step_update.DEVICE_UPDATE = args.device_update
    eng = build(args.layers, False, args.tokens)
    for _ in range(args.warmup):
        eng.step()
    torch.cuda.synchronize()
    clock = Clock()
    instrument(eng, clock)
    before = dict(eng.step_graphs.stats())
    own_step = eng.step
    keys = []

    def step():  # noqa: ANN202
        clock.mark("step_start")
        rep = own_step()
        clock.mark("step_end")
        clock.close()
        keys.append(rep.tokens)
        return rep

    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    after = dict(eng.step_graphs.stats())
    counts = {k: after.get(k, 0) - before.get(k, 0) for k in ("replays", "captures", "eager_runs")}
    rows = [segments(m, clock.steps[i + 1] if i + 1 < len(clock.steps) else None)
            for i, m in enumerate(clock.steps) if "wait_end" in m and "graph_end" in m]
    med = {k: statistics.median(r[k] for r in rows if k in r) for k in rows[0] if any(k in r for r in rows)}
    med["host between replays"] = statistics.median(r["host between replays"] for r in rows
                                                    if "host between replays" in r)
    replays = "; ".join(f"{key.tokens} rows: {back_to_back_ms(entry.graph, 10):.1f} ms"
                        for key, entry in eng.step_graphs.entries.items() if entry.graph is not None and key.train)
    lines = [f"# A replayed 2-job step's host path between replays ({torch.cuda.get_device_name()}; {args.layers} layers, "
             f"~{args.tokens}-token samples, recompute off, updates decided on the "
             f"{'device' if args.device_update else 'host'})", "",
             f"{args.steps} steps back to back (no sync of the script's own between them): **{wall:.1f} ms a step**, "
             f"tokens a step median {statistics.median(keys):.0f}; graphs {counts}.",
             f"Replays back to back: {replays}.", "",
             "| segment | ms a step (median) |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in med.items()]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
