"""Bench diagnostic: what a training step that captures a step graph holds at its peak.

With LORAPLEX_BENCH_CAPTURE_PEAKS=N set, importing this module wraps the memory plan's step window
(`MemoryPlan.step_start` / `step_end`, the window whose peak the memory model is checked against).
Around each step of at most N jobs, the allocator records its history. After such a step that
captured a graph, the allocations made in the window and still alive at its peak are printed, summed
by the code that made them. Session 35: a 2-job capture at the end of search (a) peaked 26.4, 30.3
and 34.3 GB in three runs of the same step and key (predicted 26.3 GB).
"""
from __future__ import annotations

import os
from collections import Counter

import torch

from trainer.memory_plan import MemoryPlan

MAX_JOBS = int(os.environ.get("LORAPLEX_BENCH_CAPTURE_PEAKS", "0"))
_START, _END = MemoryPlan.step_start, MemoryPlan.step_end
_WATCH: dict[int, int] = {}  # id(memory plan) -> the graphs' capture count at its step's start


def _where(frames: list[dict]) -> str:
    ours = [f for f in frames if any(k in f.get("filename", "") for k in ("/trainer/", "/kernels/"))]
    pick = (ours or frames)[:3]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in pick) or "?"


def peak_holders(events: list[dict], top: int = 12) -> tuple[int, list[tuple[str, int]]]:
    """The window's peak (bytes allocated in it, net of its frees) and what was alive then, by site."""
    live: dict[int, tuple[int, str]] = {}
    cur = best = 0
    at_best: dict[int, tuple[int, str]] = {}
    for e in events:
        action, addr, size = e.get("action"), e.get("addr"), e.get("size", 0)
        if action == "alloc":
            live[addr] = (size, _where(e.get("frames", [])))
            cur += size
            if cur > best:
                best, at_best = cur, dict(live)
        elif action == "free_completed" and addr in live:
            cur -= live.pop(addr)[0]
    sites: Counter[str] = Counter()
    for size, site in at_best.values():
        sites[site] += size
    return best, sites.most_common(top)


def step_start(self: MemoryPlan) -> int | None:
    out = _START(self)
    graphs = self.engine.step_graphs
    if graphs is not None and self.device.type == "cuda" and len(self.engine.jobs) <= MAX_JOBS:
        _WATCH[id(self)] = graphs.captures
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=1_000_000,
                                                 clear_history=True)
    return out


def step_end(self: MemoryPlan, resident: int | None, report: object) -> None:
    captures = _WATCH.pop(id(self), None)
    if captures is not None:
        if self.engine.step_graphs.captures != captures:
            snap = torch.cuda.memory._snapshot()
            events = [e for trace in snap.get("device_traces", []) for e in trace]
            best, sites = peak_holders(events)
            peak = torch.cuda.max_memory_allocated(self.device)
            print(f"capture step, {len(self.engine.jobs)} jobs: peak {peak / 2**30:.2f} GiB, resident "
                  f"{(resident or 0) / 2**30:.2f} GiB, allocated in the window at its peak {best / 2**30:.2f} GiB",
                  flush=True)
            for site, size in sites:
                print(f"  {size / 2**20:10.1f} MiB  {site}", flush=True)
        torch.cuda.memory._record_memory_history(enabled=None)
    _END(self, resident, report)


if MAX_JOBS > 0:
    MemoryPlan.step_start, MemoryPlan.step_end = step_start, step_end
