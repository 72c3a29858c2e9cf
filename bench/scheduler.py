"""Static planner benchmark (CPU): one replan of a random queue with the production settings.

Run: python bench/scheduler.py [--seeds 3] [--long-work 3.0] [--out FILE]
For 50 tasks / 64 GPUs and 200 tasks / 256 GPUs (8-GPU nodes; 4 tenants; GPU counts 1/2/4/8;
Pareto durations; arrivals spread over the last 2 h; bound 4 h from arrival) it reports, per
seed, the planner's wall time with the production work limit (service/core/config.py), its objective
against its own warm start, against a long run (``--long-work`` deterministic time of CP-SAT's
full portfolio, LP bounds included: the best plan known) and against CP-SAT's proven lower bound
of that long run. A second table plans
instances of known optimum (``packable``: waves of tasks that exactly partition every node;
optimum = every task at its release) and reports the gap to it. Times are wall and CPU seconds
(CPU: this process, CP-SAT's one search thread included; wall depends on the load
of the shared machine, the plan does not: deterministic work limit). The online behaviour
(completion times, waits, fairness against baselines) is bench/scheduler_sim.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.core.config import Settings  # noqa: E402
from service.scheduler import planner  # noqa: E402
from service.scheduler.loop import solve_options  # noqa: E402
from service.scheduler.packing import Placed  # noqa: E402
from service.scheduler.planner import SolveOptions, solve  # noqa: E402
from service.scheduler.problem import Instance, NodeSpec, TaskSpec  # noqa: E402


def instance(n_tasks: int, n_nodes: int, seed: int) -> Instance:
    rng = random.Random(seed)
    nodes = [NodeSpec(f"n{i}", "H100", 8) for i in range(n_nodes)]
    tasks = []
    for i in range(n_tasks):
        g = rng.choices((1, 2, 4, 8), (0.45, 0.3, 0.15, 0.1))[0]
        d = int(min(12 * 3600, 600 * rng.paretovariate(1.5)))
        arrival = -rng.randrange(0, 7200)
        tasks.append(TaskSpec(f"t{i}", f"tenant{i % 4}", g, d, arrival_s=arrival,
                              max_start_s=arrival + 4 * 3600, priority=rng.choice((0, 0, 5))))
    return Instance(nodes, tasks)


def packable(n_tasks: int, n_nodes: int, seed: int, waves: int = 3) -> Instance:
    """An instance of known optimum: the tasks come in ``waves``, wave k released at k * 4 h with
    durations of at most 4 h, and each wave's GPU counts partition every node's 8 GPUs exactly
    (random splits of 8; the tasks are shuffled, so the partitions must be found). Every term of
    the objective only grows with a task's end, and every task can end at its release plus its
    duration: the optimum is the plan that starts each task at its release."""
    rng = random.Random(1000 + seed)
    wave = 4 * 3600
    tasks = []
    for k in range(waves):
        count = n_tasks // waves + (k < n_tasks % waves)
        parts = [[8] for _ in range(n_nodes)]
        while sum(len(p) for p in parts) < count:
            node = rng.choice([p for p in parts if any(g > 1 for g in p)])
            g = node.pop(rng.choice([i for i, g in enumerate(node) if g > 1]))
            cut = rng.randint(1, g - 1)
            node += [cut, g - cut]
        sizes = [g for node in parts for g in node]
        rng.shuffle(sizes)
        for g in sizes:
            d = int(min(wave, 600 * rng.paretovariate(1.5)))
            tasks.append(TaskSpec(f"t{len(tasks)}", f"tenant{len(tasks) % 4}", g, d,
                                  arrival_s=-rng.randrange(0, 7200), earliest_start_s=k * wave,
                                  priority=rng.choice((0, 0, 5))))
    return Instance([NodeSpec(f"n{i}", "H100", 8) for i in range(n_nodes)], tasks)


def optimum(inst: Instance, opts: SolveOptions) -> int:
    """The objective of the plan that starts every task at its release (a lower bound of any
    plan; for a packable instance it is feasible, so it is the optimum)."""
    jobs, pinned, _, specs = planner.build_jobs(inst, opts.unit_s, opts)
    ctx = planner.plan_context(jobs, pinned, specs, opts.unit_s, opts)
    return planner.objective([Placed(j, j.options[0], j.release) for j in jobs], ctx)


def warm_objective(inst: Instance, opts: SolveOptions) -> int:
    jobs, pinned, _, specs = planner.build_jobs(inst, opts.unit_s, opts)
    caps = [n.gpu_count for n in inst.nodes]
    ctx = planner.plan_context(jobs, pinned, specs, opts.unit_s, opts)
    ctx.held = planner.held_spans(inst, opts.unit_s)
    sched = planner.warm_start_plan(jobs, caps, planner.tenant_capacities(inst, pinned, ctx.held), pinned,
                                ctx)
    return planner.objective(sched, ctx)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--long-work", type=float, default=3.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--known-only", action="store_true", help="only the known-optimum table")
    a = ap.parse_args()
    prod = solve_options(Settings())
    # The reference: CP-SAT's full portfolio (4 interleaved workers, LP bounds) for --long-work.
    long = dataclasses.replace(prod, work_limit=a.long_work, time_limit_s=300, portfolio=True,
                               workers=4)
    lines = [f"CPU: this 2-core x86 box (shared), python {platform.python_version()}; "
             f"production work limit {prod.work_limit}, long run {a.long_work}.", "",
             "| case | seed | wall / CPU s | status | vs warm start | vs long run | long run vs its "
             "bound | same plan twice |", "|---|---|---|---|---|---|---|---|"]
    for n_tasks, n_nodes in ((50, 8), (200, 32)):
        for seed in range(a.seeds if not a.known_only else 0):
            inst = instance(n_tasks, n_nodes, seed)
            t0, c0 = time.perf_counter(), time.process_time()
            plan = solve(inst, prod)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            again = solve(inst, prod)
            ref = solve(inst, long)
            best = min(ref.weighted_completion_s, plan.weighted_completion_s)
            lines.append(
                f"| {n_tasks} tasks / {8 * n_nodes} GPUs | {seed} | {wall:.2f} / {cpu:.2f} | "
                f"{plan.status} | {plan.weighted_completion_s / warm_objective(inst, prod):.4f} | "
                f"{plan.weighted_completion_s / best:.4f} | "
                f"{best / max(1, ref.objective_bound):.4f} | "
                f"{again.assignments == plan.assignments} |")
            print(lines[-1], flush=True)
    lines += ["", "Known optimum (3 waves released 4 h apart; each wave's GPU counts partition every "
              "node exactly; optimum = every task starts at its release):", "",
              "| case | seed | wall / CPU s | status | vs optimum | warm start vs optimum | "
              "started at release |", "|---|---|---|---|---|---|---|"]
    for n_tasks, n_nodes in ((50, 8), (200, 32)):
        for seed in range(a.seeds):
            inst = packable(n_tasks, n_nodes, seed)
            t0, c0 = time.perf_counter(), time.process_time()
            plan = solve(inst, prod)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            best = optimum(inst, prod)
            release = {t.id: t.earliest_start_s for t in inst.tasks}
            now = sum(x.start_s == release[k] for k, x in plan.assignments.items())
            lines.append(
                f"| {n_tasks} tasks / {8 * n_nodes} GPUs | {seed} | {wall:.2f} / {cpu:.2f} | "
                f"{plan.status} | {plan.weighted_completion_s / best:.4f} | "
                f"{warm_objective(inst, prod) / best:.4f} | {now}/{n_tasks} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
