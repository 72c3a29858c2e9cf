"""CP-SAT inter-task planner: every unfinished task gets g GPUs of one node for its estimated
duration; minimise makespan, then priority-weighted completion. Pure: no database, no clock.

Model (times are integers in units of ``SolveOptions.unit_s`` seconds, 0 = now; durations are
rounded up, earliest starts up, latest starts down):
- task i has a start s_i in [release_i, max_start_i] and an end e_i; for each node n that is up
  and big enough, an optional interval (s_i, d_in, e_i) present iff y_in; exactly one y_in is 1.
- per node a cumulative of the present intervals (demand g_in, capacity = its GPU count). This is
  exact: packing.assign_gpus turns any cumulative-feasible schedule into concrete GPU indices
  (proof in packing's docstring), and the tests check that no GPU is ever double-booked.
- running tasks are fixed intervals [0, remaining) on their node and GPUs; they never move.
- per tenant with a limit, a cumulative over all its tasks (running ones included).
- phase 1 minimises the makespan M >= e_i. Redundant constraints tighten its lower bound: the
  energy bound sum g*d <= C*M (total and per node) and a pooled cumulative that sees all up GPUs
  as one node (each task at its smallest demand), which alone often proves optimality; phase 2 fixes M to the best found and minimises sum w_i * e_i, with
  w_i = 1 + max(priority, 0). Both phases are hinted: by the previous plan repaired by list
  scheduling (stable replans), else by list scheduling longest-first.
Tasks that fit no up node (or exceed their tenant's limit) are reported in Plan.unschedulable;
if bounded waiting makes the model infeasible the bounds are dropped and Plan.relaxed_waiting set.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from service.scheduler.packing import Option, Placed, UJob, assign_gpus, list_schedule


@dataclass(frozen=True)
class NodeSpec:
    id: str
    gpu_type: str
    gpu_count: int
    up: bool = True


@dataclass(frozen=True)
class Pinned:
    """Where a running task runs: its node, GPUs and start (seconds, <= 0: before now)."""

    node_id: str
    gpu_indices: tuple[int, ...]
    start_s: int = 0


@dataclass(frozen=True)
class Hint:
    """The task's placement in the previous plan (start in seconds from now)."""

    node_id: str
    start_s: int
    gpu_indices: tuple[int, ...] = ()


@dataclass(frozen=True)
class TaskSpec:
    """An unfinished task. ``duration_s`` is the (remaining, for running tasks) estimate;
    ``by_gpu_type`` overrides (gpus_needed, duration_s) per GPU type."""

    id: str
    tenant: str
    gpus_needed: int
    duration_s: int
    priority: int = 0
    state: str = "queued"  # queued | running
    pinned: Pinned | None = None
    hint: Hint | None = None
    earliest_start_s: int = 0
    max_start_s: int | None = None  # bounded waiting: never planned to start later than this
    by_gpu_type: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def need(self, gpu_type: str) -> tuple[int, int]:
        return self.by_gpu_type.get(gpu_type, (self.gpus_needed, self.duration_s))


@dataclass(frozen=True)
class Instance:
    nodes: Sequence[NodeSpec]
    tasks: Sequence[TaskSpec]
    tenant_max_gpus: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Assignment:
    task_id: str
    node_id: str
    gpu_indices: tuple[int, ...]
    start_s: int
    end_s: int
    pinned: bool = False


@dataclass
class Plan:
    assignments: dict[str, Assignment]
    unschedulable: dict[str, str]  # task id -> why it cannot be placed
    status: str  # OPTIMAL | FEASIBLE | HEURISTIC (list scheduling fallback) | EMPTY
    makespan_s: int
    makespan_bound_s: int
    weighted_completion_s: int
    solve_time_s: float
    relaxed_waiting: bool = False
    makespan_time_s: float = 0.0  # wall time of phase 1 (model build + makespan solve)

    @property
    def gap(self) -> float:
        """Relative optimality gap of the makespan (0.0 = proven optimal)."""
        if self.makespan_s <= 0:
            return 0.0
        return max(0.0, (self.makespan_s - self.makespan_bound_s) / self.makespan_s)


@dataclass(frozen=True)
class SolveOptions:
    unit_s: int = 1
    time_limit_s: float = 1.0  # phase 1 (makespan)
    secondary_time_limit_s: float = 0.5  # phase 2 (weighted completion); 0 disables it
    workers: int = 2
    seed: int = 0


def weight(priority: int) -> int:
    return 1 + max(0, min(int(priority), 100))


def _units_up(seconds: float, unit: int) -> int:
    return int(math.ceil(seconds / unit))


def _build_jobs(inst: Instance, unit: int
                ) -> tuple[list[UJob], list[Placed], dict[str, str], bool]:
    node_index = {n.id: i for i, n in enumerate(inst.nodes)}
    queued: list[UJob] = []
    pinned: list[Placed] = []
    bad: dict[str, str] = {}
    clamped = False  # a latest start before the earliest start is moved up to it
    for t in inst.tasks:
        if t.pinned is not None:
            ni = node_index.get(t.pinned.node_id)
            if ni is None or not inst.nodes[ni].up:
                bad[t.id] = f"running on node {t.pinned.node_id} which is down or unknown"
                continue
            start = math.floor(t.pinned.start_s / unit) if t.pinned.start_s < 0 else 0
            end = max(1, _units_up(t.duration_s, unit))
            job = UJob(len(queued) + len(pinned), t.id, t.tenant, weight(t.priority), start, None,
                       [Option(ni, len(t.pinned.gpu_indices), end - start)],
                       pinned_gpus=tuple(t.pinned.gpu_indices), pinned_start=start)
            pinned.append(Placed(job, job.options[0], start))
            continue
        limit = inst.tenant_max_gpus.get(t.tenant)
        options = []
        for ni, n in enumerate(inst.nodes):
            g, d = t.need(n.gpu_type)
            if n.up and 0 < g <= n.gpu_count and (limit is None or g <= limit):
                options.append(Option(ni, g, max(1, _units_up(d, unit))))
        if not options:
            largest = max((n.gpu_count for n in inst.nodes if n.up), default=0)
            g = min(t.need(n.gpu_type)[0] for n in inst.nodes) if inst.nodes else t.gpus_needed
            if limit is not None and g > limit:
                bad[t.id] = f"needs {g} GPUs, over tenant {t.tenant}'s limit of {limit}"
            else:
                bad[t.id] = f"needs {g} GPUs on one node; the largest up node has {largest}"
            continue
        release = max(0, _units_up(t.earliest_start_s, unit))
        max_start = None
        if t.max_start_s is not None:
            max_start = math.floor(t.max_start_s / unit)
            clamped = clamped or max_start < release
            max_start = max(release, max_start)
        job = UJob(len(queued) + len(pinned), t.id, t.tenant, weight(t.priority), release,
                   max_start, options)
        if t.hint is not None and t.hint.node_id in node_index:
            hn = node_index[t.hint.node_id]
            if any(o.node == hn for o in options):
                job.hint_node, job.hint_gpus = hn, tuple(t.hint.gpu_indices)
                job.hint_start = max(release, math.floor(t.hint.start_s / unit))
        queued.append(job)
    return queued, pinned, bad, clamped


def _tenant_caps(inst: Instance, pinned: Sequence[Placed]) -> dict[str, int]:
    caps = {}
    for tenant, limit in inst.tenant_max_gpus.items():
        running = sum(p.option.gpus for p in pinned if p.job.tenant == tenant)
        caps[tenant] = max(limit, running)  # a lowered limit never evicts running tasks
    return caps


def _hint_schedule(jobs: list[UJob], node_caps: list[int], tenant_caps: dict[str, int],
                   pinned: list[Placed]) -> list[Placed]:
    """Previous-plan order first (repaired by list scheduling), then new tasks in the best of
    three orders: longest, largest-area and widest first (by bounded waiting deadline first)."""
    hinted = sorted((j for j in jobs if j.hint_node is not None),
                    key=lambda j: (j.hint_start or 0, j.index))
    best: list[Placed] = []
    for rule in (lambda o: (o.duration, o.gpus), lambda o: (o.gpus * o.duration, o.duration),
                 lambda o: (o.gpus, o.duration)):
        fresh = sorted((j for j in jobs if j.hint_node is None),
                       key=lambda j, r=rule: (
                           j.max_start if j.max_start is not None else 10**12,
                           tuple(-x for x in max(r(o) for o in j.options)), j.index))
        sched = list_schedule(hinted + fresh, node_caps, tenant_caps, pinned, follow_hints=True)
        if not best or _score(sched) < _score(best):
            best = sched
    return best


def _score(sched: Sequence[Placed]) -> tuple[int, int, int]:
    late = sum(p.job.max_start is not None and p.start > p.job.max_start for p in sched)
    return (late, max((p.end for p in sched), default=0),
            sum(p.job.weight * p.end for p in sched))


def _respects_waiting(sched: Sequence[Placed]) -> bool:
    return all(p.job.max_start is None or p.start <= p.job.max_start for p in sched)


def solve(inst: Instance, opts: SolveOptions | None = None) -> Plan:
    """Plan every task of the instance; never raises for tasks that cannot be placed."""
    opts = opts or SolveOptions()
    t0 = time.perf_counter()
    unit = opts.unit_s
    jobs, pinned, bad, clamped = _build_jobs(inst, unit)
    node_caps = [n.gpu_count if n.up else 0 for n in inst.nodes]
    tenant_caps = _tenant_caps(inst, pinned)
    greedy = _hint_schedule(jobs, node_caps, tenant_caps, pinned)
    relaxed = clamped
    result = None
    t1 = time.perf_counter()
    if jobs:
        result = _solve_cp(jobs, pinned, greedy, node_caps, tenant_caps, opts, use_waiting=True)
        if result is None and any(j.max_start is not None for j in jobs):
            relaxed = True
            result = _solve_cp(jobs, pinned, greedy, node_caps, tenant_caps, opts,
                               use_waiting=False)
    if result is not None:
        sched, status, bound, t1 = result
    else:
        sched, status = greedy, ("HEURISTIC" if jobs else "EMPTY")
        t1 = time.perf_counter()
        relaxed = relaxed or not _respects_waiting(greedy)
        bound = _lower_bound(jobs, pinned, node_caps)
    placed = list(pinned) + sched
    gpus = assign_gpus(placed, node_caps)
    out = {}
    for p in placed:
        start = p.job.pinned_start if p.job.pinned_gpus is not None else p.start
        out[p.job.task_id] = Assignment(
            p.job.task_id, inst.nodes[p.option.node].id, gpus[p.job.task_id],
            start * unit, p.end * unit, pinned=p.job.pinned_gpus is not None)
    makespan = max((p.end for p in placed), default=0)
    return Plan(out, bad, status, makespan * unit, min(bound, makespan) * unit,
                sum(p.job.weight * p.end for p in sched) * unit,
                time.perf_counter() - t0, relaxed, t1 - t0)


def heuristic_makespan(inst: Instance, unit_s: int = 1) -> int:
    """Makespan (seconds) of the list-scheduling plan that hints the solver (a baseline)."""
    jobs, pinned, _, _ = _build_jobs(inst, unit_s)
    node_caps = [n.gpu_count if n.up else 0 for n in inst.nodes]
    sched = _hint_schedule(jobs, node_caps, _tenant_caps(inst, pinned), pinned)
    return max([p.end for p in sched] + [p.end for p in pinned] + [0]) * unit_s


def _lower_bound(jobs: Sequence[UJob], pinned: Sequence[Placed], node_caps: Sequence[int]) -> int:
    cap = sum(node_caps)
    energy = sum(min(o.gpus * o.duration for o in j.options) for j in jobs)
    energy += sum(p.end * p.option.gpus for p in pinned)
    lb = max([j.release + min(o.duration for o in j.options) for j in jobs]
             + [p.end for p in pinned] + [0])
    return max(lb, math.ceil(energy / cap) if cap else 0)


def _solve_cp(jobs: list[UJob], pinned: list[Placed], greedy: list[Placed],
              node_caps: list[int], tenant_caps: dict[str, int], opts: SolveOptions,
              use_waiting: bool) -> tuple[list[Placed], str, int, float] | None:
    greedy_ok = _respects_waiting(greedy) or not use_waiting
    pin_end = max((p.end for p in pinned), default=0)
    if greedy_ok:
        horizon = max(p.end for p in greedy)
    else:  # any left-shifted feasible schedule ends by this serial bound
        horizon = (max([pin_end] + [j.release for j in jobs])
                   + sum(max(o.duration for o in j.options) for j in jobs))
    horizon = max(horizon, pin_end)
    m = cp_model.CpModel()
    start, end, pres = {}, {}, {}
    node_iv: list[list] = [[] for _ in node_caps]
    tenant_iv: dict[str, list] = {t: [] for t in tenant_caps}
    energy = []
    node_energy: list[list] = [[] for _ in node_caps]
    pooled: list[tuple] = []
    for j in jobs:
        dmin = min(o.duration for o in j.options)
        hi = horizon - dmin
        if use_waiting and j.max_start is not None:
            hi = min(hi, j.max_start)
        if hi < j.release:
            return None
        s = m.new_int_var(j.release, hi, f"s{j.index}")
        e = m.new_int_var(j.release + dmin, horizon, f"e{j.index}")
        start[j.index], end[j.index] = s, e
        for o in j.options:
            y = m.new_bool_var(f"y{j.index}_{o.node}")
            pres[j.index, o.node] = y
            iv = m.new_optional_interval_var(s, o.duration, e, y, f"iv{j.index}_{o.node}")
            node_iv[o.node].append((iv, o.gpus))
            if j.tenant in tenant_iv:
                tenant_iv[j.tenant].append((iv, o.gpus))
            energy.append(o.gpus * o.duration * y)
            node_energy[o.node].append(o.gpus * o.duration * y)
        m.add_exactly_one(pres[j.index, o.node] for o in j.options)
        # Pooled relaxation: all up GPUs as one node, each task at its smallest demand. Redundant
        # but it lifts the lower bound far above the energy bound (see the benchmark notes).
        dmax = max(o.duration for o in j.options)
        size = m.new_int_var(dmin, dmax, f"d{j.index}") if dmax > dmin else dmin
        pooled.append((m.new_interval_var(s, size, e, f"all{j.index}"),
                       min(o.gpus for o in j.options)))
    for p in pinned:
        iv = m.new_fixed_size_interval_var(0, p.end, f"pin{p.job.index}")
        node_iv[p.option.node].append((iv, p.option.gpus))
        if p.job.tenant in tenant_iv:
            tenant_iv[p.job.tenant].append((iv, p.option.gpus))
    for cap, ivs in zip(node_caps, node_iv, strict=True):
        if ivs:
            m.add_cumulative([iv for iv, _ in ivs], [g for _, g in ivs], cap)
    for p in pinned:
        pooled.append((m.new_fixed_size_interval_var(0, p.end, f"allpin{p.job.index}"),
                       p.option.gpus))
    m.add_cumulative([iv for iv, _ in pooled], [g for _, g in pooled], sum(node_caps))
    for tenant, ivs in tenant_iv.items():
        if ivs:
            m.add_cumulative([iv for iv, _ in ivs], [g for _, g in ivs], tenant_caps[tenant])
    makespan = m.new_int_var(max(pin_end, 0), horizon, "makespan")
    m.add_max_equality(makespan, [*end.values(), pin_end])
    pinned_energy = sum(p.end * p.option.gpus for p in pinned)
    m.add(sum(energy) + pinned_energy <= sum(node_caps) * makespan)
    for n, cap in enumerate(node_caps):  # the same energy bound per node
        if node_energy[n]:
            m.add(sum(node_energy[n])
                  + sum(p.end * p.option.gpus for p in pinned if p.option.node == n)
                  <= cap * makespan)
    m.add_hint(makespan, max([pin_end] + [p.end for p in greedy]))
    for p in greedy:
        m.add_hint(start[p.job.index], p.start)
        m.add_hint(end[p.job.index], p.end)
        for o in p.job.options:
            m.add_hint(pres[p.job.index, o.node], o.node == p.option.node)
    m.minimize(makespan)
    solver = _solver(opts, opts.time_limit_s)
    st = solver.solve(m)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    status = "OPTIMAL" if st == cp_model.OPTIMAL else "FEASIBLE"
    bound = int(math.ceil(solver.best_objective_bound - 1e-6))
    best = int(solver.value(makespan))
    sched = _read(solver, jobs, start, pres)
    t_phase1 = time.perf_counter()
    if opts.secondary_time_limit_s > 0:
        m.clear_hints()
        m.add_hint(makespan, best)
        for j in jobs:
            m.add_hint(start[j.index], solver.value(start[j.index]))
            m.add_hint(end[j.index], solver.value(end[j.index]))
            for o in j.options:
                m.add_hint(pres[j.index, o.node], solver.value(pres[j.index, o.node]))
        m.add(makespan <= best)
        m.minimize(sum(j.weight * end[j.index] for j in jobs))
        solver2 = _solver(opts, opts.secondary_time_limit_s)
        if solver2.solve(m) in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            sched = _read(solver2, jobs, start, pres)
    return sched, status, bound, t_phase1


def _solver(opts: SolveOptions, limit: float) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = limit
    solver.parameters.num_workers = opts.workers
    solver.parameters.random_seed = opts.seed
    # Presolve's symmetry reductions can break a feasible hint (ortools 9.15 reports "Presolve
    # broke a feasible hint" in debug mode); keeping symmetries keeps the hint usable.
    solver.parameters.keep_symmetry_in_presolve = True
    return solver


def _read(solver: cp_model.CpSolver, jobs: list[UJob], start: dict, pres: dict) -> list[Placed]:
    out = []
    for j in jobs:
        opt = next(o for o in j.options if solver.boolean_value(pres[j.index, o.node]))
        out.append(Placed(j, opt, int(solver.value(start[j.index]))))
    return out
