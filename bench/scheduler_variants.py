"""Planner variants and p99 definitions on bench/scheduler_sim.py's simulator (the "Tried in
session 9" and pooled tables of bench/results/scheduler_sim_cpu.md). Not the production planner:
a variant patches service.scheduler.planner inside this process only.

Run:
  python bench/scheduler_variants.py VARIANT [--cells 1.3:exact,2.0:2x] [--seeds 5]
  python bench/scheduler_variants.py --pooled      (the committed planner, every row)

VARIANT: "ref" (the committed planner) or "+"-joined parts: g=A (a queued task's flow-time
weight times g^A, g its GPUs), d=B (times max(1, d / 30 min)^B, d its estimated duration),
keepurg (the waiting penalty's urgent cost from the unscaled weights, times the mean factor).
Prints planner / best baseline of mean, p99 and fairness ratio per cell, means over the seeds,
100 tasks per run; --pooled prints p95 and p99 over the completions of all seeds together.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import scheduler_sim as sim  # noqa: E402

from service.core.config import Settings  # noqa: E402
from service.scheduler import planner  # noqa: E402

BASELINES = [p for p in sim.POLICIES if p != "planner"]


_patched: list[str] = []  # a pool worker runs many cases: patch the planner once per process


def patch(variant: str) -> None:
    if _patched:
        assert _patched == [variant]
        return
    _patched.append(variant)
    parts = [p for p in variant.split("+") if p and p != "ref"]
    exps = {k: float(v or 0.5) for k, _, v in (p.partition("=") for p in parts) if k in "gd"}
    if not exps:
        return
    build, context = planner.build_jobs, planner.plan_context
    unscaled: dict[int, int] = {}

    def scaled_build(inst, unit, opts):  # noqa: ANN001, ANN202
        jobs, pinned, bad, specs = build(inst, unit, opts)
        for j in jobs:
            g = min(o.gpus for o in j.options)
            d_min = min(o.duration for o in j.options) * unit / 60
            f = g ** exps.get("g", 0.0) * max(1.0, d_min / 30) ** exps.get("d", 0.0)
            unscaled[j.index] = j.weight
            j.weight = max(1, round(j.weight * f))
        return jobs, pinned, bad, specs

    def unscaled_urgent(jobs, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        ctx = context(jobs, *a, **k)
        if jobs:
            w0 = [unscaled[j.index] for j in jobs]
            ctx.urgent = round(2 * max(w0) * sum(j.weight for j in jobs) / sum(w0))
        return ctx

    planner.build_jobs = scaled_build
    if "keepurg" in parts:
        planner.plan_context = unscaled_urgent


def run(args: tuple[str, str, float, str, int]) -> tuple[tuple, list[float], dict]:
    variant, policy, load, error, seed = args
    tasks = sim.stream(seed, 100, load, error)
    if policy == "planner":
        patch(variant)
        decide = sim.planner_policy(Settings())
    else:
        decide = sim.easy_backfill if policy == "EASY backfill" else sim.queue_policy(policy)
    done = sim.simulate(tasks, decide)
    return args, sorted(t.finish - t.arrival for t in done), sim.metrics(done)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant", nargs="?", default="ref")
    ap.add_argument("--cells", default="1.3:exact,1.3:2x,2.0:exact,2.0:2x")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--pooled", action="store_true")
    a = ap.parse_args()
    cells = ([(ld, e) for ld in sim.LOADS for e in sim.ERRORS] if a.pooled else
             [(float(c.split(":")[0]), c.split(":")[1]) for c in a.cells.split(",")])
    todo = [(a.variant, p, ld, e, s) for ld, e in cells for s in range(a.seeds)
            for p in sim.POLICIES]
    todo.sort(key=lambda c: c[1] != "planner")  # the long planner runs first
    comps: dict[tuple, list[float]] = {}
    mets: dict[tuple, dict] = {}
    with multiprocessing.Pool(2) as pool:
        for args, comp, m in pool.imap_unordered(run, todo):
            comps[args[1:]], mets[args[1:]] = comp, m
    seeds = range(a.seeds)
    for ld, e in cells:
        if a.pooled:
            out = []
            for q in (0.95, 0.99):
                at = {}
                for p in sim.POLICIES:
                    pooled = sorted(c for s in seeds for c in comps[(p, ld, e, s)])
                    at[p] = pooled[math.ceil(q * len(pooled)) - 1]
                best = min(BASELINES, key=at.get)
                out.append(f"pooled p{round(q * 100)} {at['planner'] / at[best]:.3f} ({best})")
            print(f"{ld} {e}: " + "; ".join(out))
            continue
        mean = {k: {p: statistics.mean(mets[(p, ld, e, s)][k] for s in seeds)
                    for p in sim.POLICIES} for k in ("mean", "p99", "fair")}
        ratio = [mean[k]["planner"] / min(mean[k][p] for p in BASELINES)
                 for k in ("mean", "p99", "fair")]
        print(f"{a.variant} {ld} {e}: " + " / ".join(f"{r:.3f}" for r in ratio))


if __name__ == "__main__":
    main()
