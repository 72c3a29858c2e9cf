"""The planner's CP-SAT model: tasks as optional intervals on candidate nodes, GPU capacities
per node, cluster and capped tenant, the objective of `objective.py`, warm-started from the
planner's heuristic schedule and searched by large-neighbourhood search (`SolveOptions`).

Model:
- task i has a start s_i >= release_i and an end e_i; for each candidate node n (up, big enough;
  at most ``max_node_options`` per task, fewer (not under 4) when the tasks times that would
  exceed ``max_options_total``; the warm start's and the hinted node among them) an optional
  interval (s_i, d_in, e_i) present iff y_in; exactly one y_in is 1. Per node a cumulative of
  the present intervals (exact: packing.assign_gpus turns it into GPU indices), plus a redundant
  cumulative of the whole cluster as one pool. Running tasks are fixed intervals [0, remaining)
  on their GPUs.
- per tenant with a hard cap (``tenant_max_gpus``, the borrowing limit) a cumulative over its tasks
  and the GPUs it holds outside them (``tenant_held_gpus``: its shares of shared executors,
  rounded up at each time, as fixed intervals from 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from service.core.config import DEFAULT_SCHEDULER_FAIRNESS
from service.scheduler.objective import PlanContext, fair_z, job_weight, wait_cost, wait_steps
from service.scheduler.packing import Option, Placed, UJob


@dataclass(frozen=True)
class SolveOptions:
    unit_s: int = 1
    work_limit: float = 1.0  # CP-SAT deterministic time (its own work units; ~s on one core)
    time_limit_s: float = 30.0  # wall-clock safety net only
    workers: int = 1  # one search thread (more: interleaved batches, same plan, more CPU)
    seed: int = 0
    # F: 1.0 of the worst tenant's mean slowdown costs F * FAIR_SCALE * mean duration * total
    # weight (the mean spans up to FAIR_HISTORY finished tasks too, hence the scale).
    fairness: float = DEFAULT_SCHEDULER_FAIRNESS
    guarantee_boost: int = 4
    max_node_options: int = 8
    max_options_total: int = 800  # fewer node options per task when many tasks (model size)
    lns_work: float = 0.01  # deterministic time of one neighbourhood search (many small ones)
    portfolio: bool = False  # CP-SAT's full portfolio (bounds, LP; for reference runs: slower)
    tail: float = 0.0  # T: the longest planned flow time costs T * total weight per unit
    wait_margin: float = 0.1  # planned lateness counts from this fraction of the bound early
    secondary_time_limit_s: float = 0.0  # unused (kept for callers of the two-phase planner)


def _candidate_nodes(j: UJob, greedy_node: int, node_caps: Sequence[int],
                     pinned_free_at: Sequence[list[tuple[int, int]]], k: int) -> set[int]:
    """At most k nodes for a job: its warm-start node, its hinted node, then the nodes where its
    GPUs are free soonest given the running tasks (ties by index)."""
    def free_at(o: Option) -> int:
        busy = sorted(pinned_free_at[o.node])  # (end, gpus) of running tasks there
        free = node_caps[o.node] - sum(g for _, g in busy)
        t = 0
        for end, g in busy:
            if free >= o.gpus:
                break
            free += g
            t = end
        return t

    keep = {greedy_node}
    if j.hint_node is not None:
        keep.add(j.hint_node)
    for o in sorted(j.options, key=lambda o: (free_at(o), o.node)):
        if len(keep) >= k:
            break
        keep.add(o.node)
    return keep


# Neighbourhoods whose sub-models cost the most CPU per improvement found on the benchmark
# instances (bench/results/scheduler_cpu.md): none of them improved a plan there.
_SLOW_NEIGHBOURHOODS = ("graph_arc_lns", "graph_cst_lns", "graph_dec_lns", "rnd_cst_lns")


_INT_ROOM = 2 ** 60  # what the waiting penalties may sum to in the CP model (int64: 2^63)
SMALL_QUEUE = 40  # queued tasks up to which a full-problem subsolver joins the neighbourhoods


def _search_parameters(prm, opts: SolveOptions, n_jobs: int = 0) -> None:
    """CP-SAT's parameters. The first solution is the warm start (a complete, feasible hint), so
    the search is large-neighbourhood search only: many small sub-problems (``lns_work`` each)
    around the best plan, in one deterministic thread, until ``work_limit`` deterministic time.
    Each sub-problem costs a copy and presolve of the model that its deterministic time does not
    count, so beyond 100 tasks its work grows with the task count (fewer, larger sub-problems).
    Full-problem subsolvers (LP relaxations, reduced costs, core) and presolve's probing,
    symmetry detection and LP linearisation cost seconds of CPU at 200 tasks to load and
    improved no plan within the production limit (bench/results/scheduler_cpu.md)."""
    prm.max_deterministic_time = opts.work_limit
    prm.max_time_in_seconds = opts.time_limit_s
    prm.num_workers = opts.workers
    prm.interleave_search = True
    prm.random_seed = opts.seed
    prm.keep_symmetry_in_presolve = True  # presolve's symmetry reductions can break the hint
    if opts.portfolio:
        return
    prm.use_lns_only = True
    prm.lns_initial_deterministic_limit = opts.lns_work * max(1.0, n_jobs / 100)
    prm.ignore_subsolvers.extend(_SLOW_NEIGHBOURHOODS)
    prm.linearization_level = 0
    prm.symmetry_level = 0
    prm.cp_model_probing_level = 0
    prm.max_presolve_iterations = 1
    if n_jobs <= SMALL_QUEUE:
        # On a small queue most neighbourhoods are solved outright and count no deterministic
        # time, so LNS alone may never reach work_limit and run into the wall-clock safety instead
        # (seen: 6,945 neighbourhoods in 10 s on a 24-task queue, a plan that depended on the
        # machine's speed). One full-problem subsolver interleaved with the neighbourhoods counts
        # its time, which bounds the search (0.3-0.5 s on the queues that ran away; 0.5% above
        # LNS alone on 20-40-task instances: bench/results/scheduler_sim_cpu.md).
        prm.use_lns_only = False
        prm.subsolvers.append("quick_restart_no_lp")


def solve_cp(jobs: list[UJob], pinned: list[Placed], greedy: list[Placed],
              node_caps: list[int], tenant_caps: dict[str, int], ctx: PlanContext,
              opts: SolveOptions) -> tuple[list[Placed], str, int] | None:
    """The CP model of the queue around the pinned placements, warm-started from `greedy`;
    None where no model fits CP-SAT's integers or the solver found no plan."""
    pin_end = max((p.end for p in pinned), default=0)
    horizon = max([p.end for p in greedy] + [pin_end]) + max(
        max(o.duration for o in j.options) for j in jobs)
    # The waiting penalties' bounds sum to about late x horizon x jobs. Past 2^60 (multi-day
    # tasks, operator priorities, hundreds of tasks) CP-SAT's 64-bit model would overflow: late
    # is lowered to fit while it still outweighs the urgent cost 10 times (the caller keeps the
    # result only if the true objective prefers it to the warm start), else no model at all.
    room = _INT_ROOM // max(1, horizon * len(jobs))
    if ctx.late > room:
        if room < 10 * ctx.urgent:
            return None
        ctx = replace(ctx, late=room)
    cp = _CpModel(node_caps, tenant_caps, ctx, horizon, pin_end)
    running = [[] for _ in node_caps]
    for p in pinned:
        running[p.option.node].append((p.end, p.option.gpus))
    # Node options per task: max_node_options, fewer when that would exceed max_options_total
    # (never under 4): each option is an optional interval in every neighbourhood CP-SAT solves.
    per_task = min(opts.max_node_options,
                   max(4, opts.max_options_total // max(1, len(jobs))))
    gnode = {p.job.index: p.option.node for p in greedy}
    for j in jobs:
        cp.add_job(j, _candidate_nodes(j, gnode[j.index], node_caps, running, per_task))
    cp.add_pinned(pinned)
    cp.add_capacities()
    cp.add_objective()
    cp.add_hint(greedy)
    solver = cp_model.CpSolver()
    _search_parameters(solver.parameters, opts, len(jobs))
    st = solver.solve(cp.m)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    status = "OPTIMAL" if st == cp_model.OPTIMAL else "FEASIBLE"
    return cp.plan(solver, jobs), status, int(math.ceil(solver.best_objective_bound - 1e-6))


class _CpModel:
    """The variables and constraints of `solve_cp`'s model, built in a fixed order (the
    order of variables steers CP-SAT's search: the same calls give the same plan)."""

    def __init__(self, node_caps: list[int], tenant_caps: dict[str, int], ctx: PlanContext,
                 horizon: int, pin_end: int) -> None:
        self.m = cp_model.CpModel()
        self.node_caps, self.tenant_caps, self.ctx = node_caps, tenant_caps, ctx
        self.horizon, self.pin_end = horizon, pin_end
        self.start: dict[int, cp_model.IntVar] = {}
        self.end: dict[int, cp_model.IntVar] = {}
        self.pres: dict[tuple[int, int], cp_model.IntVar] = {}
        self.opts_of: dict[int, list] = {}
        self.node_iv: list[list] = [[] for _ in node_caps]
        self.tenant_iv: dict[str, list] = {t: [] for t in tenant_caps}
        self.pooled: list[tuple] = []
        self.terms: list = []
        self.sizes: dict[int, cp_model.IntVar] = {}
        self.overs: list[tuple[cp_model.IntVar, int, list[tuple[int, int]]]] = []
        self.z = self.makespan = self.longest = None

    def _interval(self, iv, gpus: int, tenant: str, node: int) -> None:  # noqa: ANN001
        self.node_iv[node].append((iv, gpus))
        if tenant in self.tenant_iv:
            self.tenant_iv[tenant].append((iv, gpus))

    def add_job(self, j: UJob, nodes) -> None:  # noqa: ANN001
        """A task's start and end, one optional interval per candidate node (exactly one
        chosen), its interval in the cluster-wide pool, and its weighted end and waiting penalty."""
        m, horizon = self.m, self.horizon
        options = [o for o in j.options if o.node in nodes]
        self.opts_of[j.index] = options
        dmin = min(o.duration for o in options)
        dmax = max(o.duration for o in options)
        s = m.new_int_var(j.release, horizon - dmin, f"s{j.index}")
        e = m.new_int_var(j.release + dmin, horizon, f"e{j.index}")
        self.start[j.index], self.end[j.index] = s, e
        for o in options:
            y = m.new_bool_var(f"y{j.index}_{o.node}")
            self.pres[j.index, o.node] = y
            iv = m.new_optional_interval_var(s, o.duration, e, y, f"iv{j.index}_{o.node}")
            self._interval(iv, o.gpus, j.tenant, o.node)
        m.add_exactly_one(self.pres[j.index, o.node] for o in options)
        size = m.new_int_var(dmin, dmax, f"d{j.index}") if dmax > dmin else dmin
        if dmax > dmin:
            self.sizes[j.index] = size
        self.pooled.append((m.new_interval_var(s, size, e, f"all{j.index}"),
                            min(o.gpus for o in options)))
        self.terms.append(j.weight * e)
        if self.ctx.deadline[j.index] is not None:
            # The waiting penalty sum_k coef_k * max(0, s - slack_k) is convex in s: one
            # variable above each partial sum of its steps (by slack) and above 0.
            steps = sorted(wait_steps(self.ctx, j.index))
            top = sum(coef * max(0, horizon - slack) for slack, coef in steps)
            pen = m.new_int_var(0, top, f"w{j.index}")
            for k in range(1, len(steps) + 1):
                m.add(pen >= sum(coef * (s - slack) for slack, coef in steps[:k]))
            self.overs.append((pen, j.index, steps))
            self.terms.append(pen)

    def add_pinned(self, pinned: list[Placed]) -> None:
        """Running placements as fixed intervals from 0, and capped tenants' held GPUs."""
        m = self.m
        for p in pinned:
            iv = m.new_fixed_size_interval_var(0, p.end, f"pin{p.job.index}")
            self._interval(iv, p.option.gpus, p.job.tenant, p.option.node)
            self.pooled.append((iv, p.option.gpus))
        for tenant, spans in self.ctx.held.items():  # capped tenants only (held_spans): in tenant_iv
            self.tenant_iv[tenant].extend((m.new_fixed_size_interval_var(0, end, f"held_{tenant}_{k}"), g)
                                          for k, (end, g) in enumerate(spans))

    def add_capacities(self) -> None:
        """GPUs per node, in the whole cluster and per capped tenant."""
        m = self.m
        for cap, ivs in zip(self.node_caps, self.node_iv, strict=True):
            if ivs:
                m.add_cumulative([iv for iv, _ in ivs], [g for _, g in ivs], cap)
        m.add_cumulative([iv for iv, _ in self.pooled], [g for _, g in self.pooled], sum(self.node_caps))
        for tenant, ivs in self.tenant_iv.items():
            if ivs:
                m.add_cumulative([iv for iv, _ in ivs], [g for _, g in ivs], self.tenant_caps[tenant])

    def add_objective(self) -> None:
        """Weighted ends + waiting penalties + fair * Z (Z >= every tenant's mean planned
        slowdown, in thousandths) + makespan (+ tail * the longest age-adjusted end)."""
        m, ctx, end, horizon = self.m, self.ctx, self.end, self.horizon
        top = max([1000 * (horizon + max(ctx.age.values(), default=0) + 1) * 4]
                  + [-(-s // n) + 1 for s, n in ctx.fixed.values() if n])
        z = self.z = m.new_int_var(0, max(ctx.share.values(), default=1) * top, "z")
        for tenant, idx in ctx.tenants.items():
            fixed_sum, fixed_n = ctx.fixed.get(tenant, (0, 0))
            m.add(z * (len(idx) + fixed_n) >= ctx.share.get(tenant, 1) * (fixed_sum + sum(
                job_weight(ctx, i) * (end[i] + ctx.age[i]) for i in idx)))
        for tenant, (fixed_sum, fixed_n) in ctx.fixed.items():
            if tenant not in ctx.tenants:
                m.add(z * fixed_n >= ctx.share.get(tenant, 1) * fixed_sum)
        self.makespan = m.new_int_var(0, horizon, "makespan")
        m.add_max_equality(self.makespan, [*end.values(), self.pin_end])
        if ctx.tail:
            self.longest = m.new_int_var(0, horizon + max(ctx.age.values(), default=0), "longest")
            m.add_max_equality(self.longest, [end[i] + ctx.age[i] for i in end])
            self.terms.append(ctx.tail * self.longest)
        m.minimize(sum(self.terms) + ctx.fair * z + self.makespan)

    def add_hint(self, greedy: list[Placed]) -> None:
        """A complete hint (every variable): CP-SAT's first solution is the warm start itself."""
        m, ctx = self.m, self.ctx
        hint_start = {}
        for p in greedy:
            hint_start[p.job.index] = p.start
            m.add_hint(self.start[p.job.index], p.start)
            m.add_hint(self.end[p.job.index], p.end)
            if p.job.index in self.sizes:
                m.add_hint(self.sizes[p.job.index], p.option.duration)
            for o in self.opts_of[p.job.index]:
                m.add_hint(self.pres[p.job.index, o.node], o.node == p.option.node)
        for pen, i, steps in self.overs:
            m.add_hint(pen, wait_cost(steps, hint_start[i]))
        m.add_hint(self.z, fair_z(greedy, ctx))
        m.add_hint(self.makespan, max([p.end for p in greedy] + [self.pin_end]))
        if ctx.tail:
            m.add_hint(self.longest, max(p.end + ctx.age[p.job.index] for p in greedy))

    def plan(self, solver, jobs: list[UJob]) -> list[Placed]:  # noqa: ANN001
        sched = []
        for j in jobs:
            o = next(o for o in self.opts_of[j.index] if solver.boolean_value(self.pres[j.index, o.node]))
            sched.append(Placed(j, o, int(solver.value(self.start[j.index]))))
        return sched
