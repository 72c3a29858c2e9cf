"""CP-SAT inter-task planner for an online multi-tenant service. Pure: no database, no clock.

Every unfinished task gets g GPUs of one node for its estimated duration. Times are integers in
units of ``SolveOptions.unit_s`` seconds, 0 = now; durations round up.

Deterministic: CP-SAT searches in one thread under a deterministic-time limit (``work_limit``),
so the same instance gives the same plan on a loaded or an idle machine; a wall-clock safety
limit (``time_limit_s``) only applies when that is exceeded by far. The search starts from the
warm start (a complete hint: CP-SAT's first solution) and is large-neighbourhood search only
(``_search_parameters``: many small sub-problems around the best plan), the way that improves
plans most per CPU second at these sizes (bench/results/scheduler_cpu.md).

Parts, each module's docstring telling its part: the instance and the plan (problem), the
instance in integer units (encode), the warm start (warm_start), quota reclaim and the guarantee
boost (quotas), the CP model and its constraints (cp) and objective (objective); this module
plans with them (solve).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence

from service.scheduler.cp import SolveOptions, solve_cp
from service.scheduler.encode import build_jobs, held_spans, plan_context, tenant_capacities
from service.scheduler.objective import objective
from service.scheduler.packing import Option, Placed, UJob, assign_gpus
from service.scheduler.problem import Assignment, Instance, Plan, TaskSpec
from service.scheduler.quotas import boost_guarantee, reclaim
from service.scheduler.warm_start import warm_start_plan

FAIR_HISTORY = 20  # finished tasks per tenant whose slowdowns the fair-share term remembers


def tenant_history(finished: Iterable[tuple[str, float, float]]
                   ) -> dict[str, tuple[float, int]]:
    """The fair-share memory from (tenant, finish time, slowdown) of finished tasks: per tenant
    the sum and count of the slowdowns of its FAIR_HISTORY latest ones."""
    latest: dict[str, list[tuple[float, float]]] = {}
    for tenant, at, slowdown in finished:
        latest.setdefault(tenant, []).append((at, slowdown))
    out = {}
    for tenant, rows in latest.items():
        rows.sort(reverse=True)
        kept = [max(1.0, s) for _, s in rows[:FAIR_HISTORY]]
        out[tenant] = (sum(kept), len(kept))
    return out


def solve(inst: Instance, opts: SolveOptions | None = None) -> Plan:
    """Plan every task of the instance; never raises for tasks that cannot be placed."""
    opts = opts or SolveOptions()
    t0 = time.perf_counter()
    unit = opts.unit_s
    jobs, pinned, bad, specs = build_jobs(inst, unit, opts)
    node_caps = [n.gpu_count if n.up else 0 for n in inst.nodes]
    # caps before reclaim: a lowered cap never evicts running tasks, so a preempted one must be
    # able to come back under it
    held = held_spans(inst, unit)
    tenant_caps = tenant_capacities(inst, pinned, held)
    victims, chosen = reclaim(inst, jobs, pinned, node_caps)
    if victims:  # preempted tasks leave their GPUs now and are planned as queued again
        keep = [p for p in pinned if p.job.task_id not in victims]
        for p in pinned:
            if p.job.task_id in victims:
                spec = specs[p.job.index]
                rest = p.end
                job = UJob(p.job.index, p.job.task_id, p.job.tenant, p.job.weight, 1, None,
                           [Option(p.option.node, p.option.gpus, rest)]
                           + [Option(o, p.option.gpus, rest) for o in range(len(node_caps))
                              if o != p.option.node and node_caps[o] >= p.option.gpus])
                specs[job.index] = TaskSpec(spec.id, spec.tenant, spec.gpus_needed, rest * unit,
                                            spec.priority, arrival_s=spec.arrival_s
                                            if spec.arrival_s is not None
                                            else p.job.pinned_start * unit,
                                            tenant_priority=spec.tenant_priority)
                jobs.append(job)
        pinned = keep
    for j in jobs:
        if j.index in chosen:
            j.options = [o for o in j.options if o.node == chosen[j.index]]
            j.max_start = 0 if j.max_start is None else min(j.max_start, 0)
    boost_guarantee(inst, jobs, pinned, opts)
    ctx = plan_context(jobs, pinned, specs, unit, opts, inst.tenant_history)
    ctx.held = held
    greedy = warm_start_plan(jobs, node_caps, tenant_caps, pinned, ctx)
    t1 = time.perf_counter()
    sched, status, bound = greedy, ("HEURISTIC" if jobs else "EMPTY"), 0
    if jobs:
        result = solve_cp(jobs, pinned, greedy, node_caps, tenant_caps, ctx, opts)
        if result is not None and objective(result[0], ctx) <= objective(greedy, ctx):
            sched, status, bound = result
    placed = list(pinned) + sched
    gpus = assign_gpus(placed, node_caps)
    out = {}
    for p in placed:
        start = p.job.pinned_start if p.job.pinned_gpus is not None else p.start
        out[p.job.task_id] = Assignment(
            p.job.task_id, inst.nodes[p.option.node].id, gpus[p.job.task_id],
            start * unit, p.end * unit, pinned=p.job.pinned_gpus is not None)
    late = {p.job.task_id: (p.start - p.job.max_start) * unit for p in sched
            if p.job.max_start is not None and p.start > max(p.job.max_start, 0)}
    makespan = max((p.end for p in placed), default=0)
    value = objective(sched, ctx)
    return Plan(out, bad, status, makespan * unit, _lower_bound(jobs, pinned, node_caps) * unit,
                value, time.perf_counter() - t0, late, victims, min(bound, value) if jobs else 0,
                t1 - t0)


def heuristic_makespan(inst: Instance, unit_s: int = 1) -> int:
    """Makespan (seconds) of the warm-start plan (a baseline for the benchmark)."""
    opts = SolveOptions(unit_s=unit_s)
    jobs, pinned, _, specs = build_jobs(inst, unit_s, opts)
    node_caps = [n.gpu_count if n.up else 0 for n in inst.nodes]
    ctx = plan_context(jobs, pinned, specs, unit_s, opts)
    ctx.held = held_spans(inst, unit_s)
    sched = warm_start_plan(jobs, node_caps, tenant_capacities(inst, pinned, ctx.held), pinned, ctx)
    return max([p.end for p in sched] + [p.end for p in pinned] + [0]) * unit_s


def _lower_bound(jobs: Sequence[UJob], pinned: Sequence[Placed], node_caps: Sequence[int]) -> int:
    cap = sum(node_caps)
    energy = sum(min(o.gpus * o.duration for o in j.options) for j in jobs)
    energy += sum(p.end * p.option.gpus for p in pinned)
    lb = max([j.release + min(o.duration for o in j.options) for j in jobs]
             + [p.end for p in pinned] + [0])
    return max(lb, math.ceil(energy / cap) if cap else 0)
