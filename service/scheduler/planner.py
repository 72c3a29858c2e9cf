"""CP-SAT inter-task planner for an online multi-tenant service. Pure: no database, no clock.

Every unfinished task gets g GPUs of one node for its estimated duration. Times are integers in
units of ``SolveOptions.unit_s`` seconds, 0 = now; durations round up.

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

Objective (minimised, all integer):
- weighted flow time sum_i w_i * e_i: w_i = (1 + tenant priority) * (10 + task priority) set by
  operators (the task's own priority is clamped to an operator ceiling before it gets here), times
  ``guarantee_boost`` when the task fits in its tenant's unused guaranteed share;
- fair share: F * Z with Z >= each tenant's mean slowdown (arrival to end over duration, in
  thousandths) over its queued and running tasks (planned) and its FAIR_HISTORY latest finished
  ones (``Instance.tenant_history``, measured), times 1 + the tenant's operator priority (a
  weighted fair share; a queued task's slowdown counts (10 + its own priority) / 10 times): the worst-off tenant is pulled up, and one whose past tasks waited long
  gets its next ones sooner (the ratio of worst to best tenant drops);
- bounded waiting, counted from arrival, per task and soft: a wait past half the bound costs
  ``urgent`` per unit, past the whole bound ``late`` per unit (far more than any reordering
  gains), so the penalty grows with the wait; a bound is never dropped for the plan. Both start
  ``wait_margin`` (10%) of the bound early, so a task planned near its bound still starts within
  it when running tasks outlast their estimates;
- optionally (``tail`` T > 0, operators' scheduler_tail) T * total weight * the longest planned
  flow time (arrival to end) of a queued task: old long tasks start sooner (p99 completion)
  at some cost in mean completion; off by default (bench/results/scheduler_sim_cpu.md);
- the makespan with coefficient 1 (a tie-break).
Deterministic: CP-SAT searches in one thread under a deterministic-time limit (``work_limit``),
so the same instance gives the same plan on a loaded or an idle machine; a wall-clock safety
limit (``time_limit_s``) only applies when that is exceeded by far. The search starts from the
warm start (a complete hint: CP-SAT's first solution) and is large-neighbourhood search only
(``_search_parameters``: many small sub-problems around the best plan), the way that improves
plans most per CPU second at these sizes (bench/results/scheduler_cpu.md).
Warm start: the best (by this objective) of several list schedules (Smith's rule on w/(g*d) with
urgent tasks first, w/d, arrival order (conservative backfilling), and the previous plan's order
merged with new tasks by the same rule),
so a new arrival is never queued behind a stale hint.
Quotas (``tenant_guaranteed_gpus``): a tenant may borrow idle GPUs beyond its guaranteed share
(up to its hard cap, if any); when a tenant under its guarantee has a queued task that cannot
start, running tasks of tenants over their guarantee are chosen for preemption (Plan.preempt,
most recently started first, on the node where the fewest GPUs must be freed) and the task is
planned at 0 on that node. The caller pauses them at a checkpoint and requeues them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from service.scheduler.cp import SolveOptions, _solve_cp
from service.scheduler.objective import _Ctx, objective
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
    ``by_gpu_type`` overrides (gpus_needed, duration_s) per GPU type. ``arrival_s`` is when it
    was submitted (seconds from now, <= 0; None: now, or its pinned start if running);
    ``max_start_s`` the end of its waiting allowance (arrival + bound, seconds from now, may be
    negative when already overdue): a soft deadline on its start. ``priority`` is the task's own
    (already clamped to its tenant's ceiling), ``tenant_priority`` the operator's for its tenant."""

    id: str
    tenant: str
    gpus_needed: int
    duration_s: int
    priority: int = 0
    state: str = "queued"  # queued | running
    pinned: Pinned | None = None
    hint: Hint | None = None
    earliest_start_s: int = 0
    max_start_s: int | None = None
    by_gpu_type: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    arrival_s: int | None = None
    tenant_priority: int = 0
    preemptible: bool = True  # running: False when it is already being stopped

    def need(self, gpu_type: str) -> tuple[int, int]:
        return self.by_gpu_type.get(gpu_type, (self.gpus_needed, self.duration_s))


@dataclass(frozen=True)
class Instance:
    nodes: Sequence[NodeSpec]
    tasks: Sequence[TaskSpec]
    tenant_max_gpus: Mapping[str, int] = field(default_factory=dict)  # hard cap (borrow limit)
    tenant_guaranteed_gpus: Mapping[str, int] = field(default_factory=dict)  # reclaimable share
    # Per tenant, (sum, count) of the slowdowns of its recently finished tasks (tenant_history).
    tenant_history: Mapping[str, tuple[float, int]] = field(default_factory=dict)
    # Per tenant, GPUs it holds outside its tasks' own: (seconds from now until released, GPUs,
    # fractional), e.g. its tasks' shares of shared executors (whose GPUs an occupant task
    # holds). They count against its hard cap only, never against a node.
    tenant_held_gpus: Mapping[str, Sequence[tuple[float, float]]] = field(default_factory=dict)


FAIR_HISTORY = 20  # finished tasks per tenant whose slowdowns the fair-share term remembers
FAIR_SCALE = 6  # the production fairness 0.25 is 1.5 mean durations x total weight per slowdown


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
    status: str  # OPTIMAL | FEASIBLE | HEURISTIC (warm start kept) | EMPTY
    makespan_s: int
    makespan_bound_s: int
    weighted_completion_s: int  # the objective value of the plan (see the module docstring)
    solve_time_s: float
    late: dict[str, int] = field(default_factory=dict)  # task -> seconds planned past its bound
    preempt: list[str] = field(default_factory=list)  # running tasks to pause and requeue
    objective_bound: int = 0
    makespan_time_s: float = 0.0  # wall time to the warm start (model build included)

    def starts_now(self) -> dict[str, int]:
        """The queued tasks this plan starts now (at 0, on GPUs), with their GPU counts."""
        return {t: len(a.gpu_indices) for t, a in self.assignments.items()
                if not a.pinned and a.start_s == 0}

    @property
    def relaxed_waiting(self) -> bool:
        """Some task is planned to start after its waiting bound (only the late ones are)."""
        return bool(self.late)

    @property
    def gap(self) -> float:
        """Relative gap of the objective to CP-SAT's bound (0.0 = proven optimal)."""
        if self.weighted_completion_s <= 0:
            return 0.0
        return max(0.0, (self.weighted_completion_s - self.objective_bound)
                   / self.weighted_completion_s)


WEIGHT_SCALE = 100  # flow-time weights are scaled so that the fair-share coefficient is not 0


def weight(priority: int, tenant_priority: int = 0) -> int:
    return (1 + max(0, min(int(tenant_priority), 100))) * (10 + max(0, min(int(priority), 10)))


def _units_up(seconds: float, unit: int) -> int:
    return int(math.ceil(seconds / unit))


def _build_jobs(inst: Instance, unit: int, opts: SolveOptions
                ) -> tuple[list[UJob], list[Placed], dict[str, str], dict[int, TaskSpec]]:
    node_index = {n.id: i for i, n in enumerate(inst.nodes)}
    queued: list[UJob] = []
    pinned: list[Placed] = []
    bad: dict[str, str] = {}
    specs: dict[int, TaskSpec] = {}
    for t in inst.tasks:
        w = WEIGHT_SCALE * weight(t.priority, t.tenant_priority)
        if t.pinned is not None:
            ni = node_index.get(t.pinned.node_id)
            if ni is None or not inst.nodes[ni].up:
                bad[t.id] = f"running on node {t.pinned.node_id} which is down or unknown"
                continue
            start = math.floor(t.pinned.start_s / unit) if t.pinned.start_s < 0 else 0
            end = max(1, _units_up(t.duration_s, unit))
            job = UJob(len(queued) + len(pinned), t.id, t.tenant, w, start, None,
                       [Option(ni, len(t.pinned.gpu_indices), end - start)],
                       pinned_gpus=tuple(t.pinned.gpu_indices), pinned_start=start)
            job.preemptible = t.preemptible
            specs[job.index] = t
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
        max_start = None if t.max_start_s is None else math.floor(t.max_start_s / unit)
        job = UJob(len(queued) + len(pinned), t.id, t.tenant, w, release, max_start, options)
        if t.hint is not None and t.hint.node_id in node_index:
            hn = node_index[t.hint.node_id]
            if any(o.node == hn for o in options):
                job.hint_node, job.hint_gpus = hn, tuple(t.hint.gpu_indices)
                job.hint_start = max(release, math.floor(t.hint.start_s / unit))
        specs[job.index] = t
        queued.append(job)
    return queued, pinned, bad, specs


def _tenant_caps(inst: Instance, pinned: Sequence[Placed],
                 held: Mapping[str, Sequence[tuple[int, int]]]) -> dict[str, int]:
    caps = {}
    for tenant, limit in inst.tenant_max_gpus.items():
        running = sum(p.option.gpus for p in pinned if p.job.tenant == tenant)
        running += sum(g for _, g in held.get(tenant, ()))
        caps[tenant] = max(limit, running)  # a lowered limit never evicts running tasks
    return caps


def _held_spans(inst: Instance, unit: int) -> dict[str, list[tuple[int, int]]]:
    """Per capped tenant, spans [0, end) (units) with whole-GPU demands whose sum at each time
    is the ceiling of the GPUs it still holds then (tenant_held_gpus): a tenant holding 0.5 of
    a GPU under a cap of 1 can start no whole-GPU task until it is released, and one holding
    1.2 under a cap of 3 can start one."""
    out: dict[str, list[tuple[int, int]]] = {}
    for tenant, held in inst.tenant_held_gpus.items():
        if tenant not in inst.tenant_max_gpus:
            continue
        spans, total, level = [], 0.0, 0
        # latest release first: total is what the tenant holds just before this release
        for end, g in sorted(((max(1, _units_up(s, unit)), g) for s, g in held if g > 0),
                             reverse=True):
            total += g
            now = math.ceil(total - 1e-9)
            if now > level:
                spans.append((end, now - level))
                level = now
        if spans:
            out[tenant] = spans
    return out


def _context(jobs: Sequence[UJob], pinned: Sequence[Placed], specs: Mapping[int, TaskSpec],
             unit: int, opts: SolveOptions,
             history: Mapping[str, tuple[float, int]] | None = None) -> _Ctx:
    age, norm, deadline, half, margin = {}, {}, {}, {}, {}
    tenants: dict[str, list[int]] = {}
    for j in jobs:
        spec = specs[j.index]
        arrival = spec.arrival_s if spec.arrival_s is not None else 0
        age[j.index] = max(0, -math.floor(arrival / unit))
        norm[j.index] = max(1, min(o.duration for o in j.options))
        bound = (j.max_start + age[j.index]) if j.max_start is not None else 0
        deadline[j.index] = j.max_start
        margin[j.index] = round(opts.wait_margin * bound)
        half[j.index] = max(1, bound // 2) + margin[j.index]
        tenants.setdefault(j.tenant, []).append(j.index)
    fixed: dict[str, tuple[int, int]] = {}
    for p in pinned:
        spec = specs[p.job.index]
        arrival = spec.arrival_s if spec.arrival_s is not None else p.job.pinned_start * unit
        a = max(0, -math.floor(arrival / unit))
        total = max(1, p.end - p.job.pinned_start)
        s, n = fixed.get(p.job.tenant, (0, 0))
        fixed[p.job.tenant] = (s + (1000 * (p.end + a)) // total, n + 1)
    for tenant, (h_sum, h_n) in (history or {}).items():
        if h_n > 0 and (tenant in tenants or tenant in fixed):
            s, n = fixed.get(tenant, (0, 0))
            fixed[tenant] = (s + round(1000 * h_sum), n + h_n)
    share: dict[str, int] = {}
    for spec in specs.values():  # a tenant's slowdown counts 1 + its operator priority times
        share[spec.tenant] = max(share.get(spec.tenant, 1),
                                 1 + max(0, min(int(spec.tenant_priority), 100)))
    wmax = max((j.weight for j in jobs), default=1)
    total_w = sum(j.weight for j in jobs)
    mean_d = sum(norm.values()) / max(1, len(norm))
    fair = max(1, round(opts.fairness * FAIR_SCALE * mean_d * total_w / 1000))
    tail = round(opts.tail * total_w)
    return _Ctx(age, norm, deadline, half, urgent=2 * wmax,
                # Past the bound costs more than any fair-share or tail gain of one unit.
                late=(20 * max(1, len(jobs)) * (wmax + 100 * fair * max(share.values(), default=1))
                      + tail), fair=fair, tenants=tenants,
                fixed=fixed, tail=tail, share=share, margin=margin,
                rank={j.index: 10 + max(0, min(int(specs[j.index].priority), 10)) for j in jobs})


def _warm_start(jobs: list[UJob], node_caps: list[int], tenant_caps: dict[str, int],
                pinned: list[Placed], ctx: _Ctx) -> list[Placed]:
    """Best of several list schedules by the objective (module docstring)."""
    def urgency(j: UJob) -> tuple[int, int]:
        d = ctx.deadline[j.index]
        if d is not None and d - ctx.half[j.index] <= 0:
            return (0, d)  # in the second half of its allowance or overdue: by deadline
        return (1, 0)

    def smith(j: UJob) -> float:
        o = min(j.options, key=lambda o: o.gpus * o.duration)
        return -j.weight / (o.gpus * o.duration)

    def ratio(j: UJob) -> float:
        return -j.weight / ctx.norm[j.index]

    orders = [sorted(jobs, key=lambda j: (urgency(j), smith(j), -ctx.age[j.index], j.index)),
              sorted(jobs, key=lambda j: (urgency(j), ratio(j), -ctx.age[j.index], j.index)),
              sorted(jobs, key=lambda j: (smith(j), j.index)),
              # First come first served (list scheduling in arrival order is conservative
              # backfilling): the oldest tasks, long and wide ones included, first.
              sorted(jobs, key=lambda j: (urgency(j), -ctx.age[j.index], j.index))]
    hinted = any(j.hint_node is not None for j in jobs)
    if hinted:
        # The previous plan's order, new tasks merged in by the same rule at the time they would
        # get: a hinted task keeps its place only against tasks it was already ahead of.
        orders.append(sorted(jobs, key=lambda j: (
            urgency(j), j.hint_start if j.hint_start is not None else 0, smith(j), j.index)))
    best: list[Placed] = []
    best_value = 0
    for k, order in enumerate(orders):
        sched = list_schedule(order, node_caps, tenant_caps, pinned,
                              follow_hints=k == len(orders) - 1 and hinted, held=ctx.held)
        value = objective(sched, ctx)
        if not best or value < best_value:
            best, best_value = sched, value
    return best


def reclaim(inst: Instance, jobs: Sequence[UJob], pinned: Sequence[Placed],
            node_caps: Sequence[int]) -> tuple[list[str], dict[int, int]]:
    """Quota reclaim (module docstring): running task ids to preempt and, per queued job index
    that gets the freed GPUs, its node."""
    guar = inst.tenant_guaranteed_gpus
    if not guar:
        return [], {}
    usage: dict[str, int] = {}
    free = list(node_caps)
    for p in pinned:
        if not p.job.preemptible:  # already being stopped: its GPUs are as good as free
            continue
        usage[p.job.tenant] = usage.get(p.job.tenant, 0) + p.option.gpus
        free[p.option.node] -= p.option.gpus
    live = [p for p in pinned if p.job.preemptible]
    victims: list[str] = []
    chosen: dict[int, int] = {}
    order = sorted(jobs, key=lambda j: (-j.weight, -(j.release), j.index))
    for j in order:
        g_t = guar.get(j.tenant, 0)
        if j.release > 0:
            continue
        opts = [o for o in j.options if usage.get(j.tenant, 0) + o.gpus <= g_t]
        if not opts:
            continue
        if any(free[o.node] >= o.gpus for o in opts):
            o = next(o for o in opts if free[o.node] >= o.gpus)
            free[o.node] -= o.gpus
            usage[j.tenant] = usage.get(j.tenant, 0) + o.gpus
            continue
        best = None
        for o in opts:
            cands = sorted((p for p in live if p.option.node == o.node and p.job.preemptible
                            and usage.get(p.job.tenant, 0) > guar.get(p.job.tenant, 0)),
                           key=lambda p: (-p.job.pinned_start, p.job.index))
            got, pick, over = free[o.node], [], dict(usage)
            for p in cands:
                if got >= o.gpus:
                    break
                if over[p.job.tenant] - p.option.gpus < guar.get(p.job.tenant, 0):
                    continue  # never take a lender below its own guarantee
                pick.append(p)
                over[p.job.tenant] -= p.option.gpus
                got += p.option.gpus
            if got >= o.gpus and (best is None or sum(p.option.gpus for p in pick)
                                  < sum(p.option.gpus for p in best[1])):
                best = (o, pick)
        if best is None:
            continue
        o, pick = best
        for p in pick:
            live.remove(p)
            victims.append(p.job.task_id)
            usage[p.job.tenant] -= p.option.gpus
            free[o.node] += p.option.gpus
        free[o.node] -= o.gpus
        usage[j.tenant] = usage.get(j.tenant, 0) + o.gpus
        chosen[j.index] = o.node
    return victims, chosen


def solve(inst: Instance, opts: SolveOptions | None = None) -> Plan:
    """Plan every task of the instance; never raises for tasks that cannot be placed."""
    opts = opts or SolveOptions()
    t0 = time.perf_counter()
    unit = opts.unit_s
    jobs, pinned, bad, specs = _build_jobs(inst, unit, opts)
    node_caps = [n.gpu_count if n.up else 0 for n in inst.nodes]
    # caps before reclaim: a lowered cap never evicts running tasks, so a preempted one must be
    # able to come back under it
    held = _held_spans(inst, unit)
    tenant_caps = _tenant_caps(inst, pinned, held)
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
    ctx = _context(jobs, pinned, specs, unit, opts, inst.tenant_history)
    ctx.held = held
    greedy = _warm_start(jobs, node_caps, tenant_caps, pinned, ctx)
    t1 = time.perf_counter()
    sched, status, bound = greedy, ("HEURISTIC" if jobs else "EMPTY"), 0
    if jobs:
        result = _solve_cp(jobs, pinned, greedy, node_caps, tenant_caps, ctx, opts)
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


def boost_guarantee(inst: Instance, jobs: Sequence[UJob], pinned: Sequence[Placed],
                    opts: SolveOptions) -> None:
    """Multiply the weight of queued tasks that fit in their tenant's unused guaranteed share."""
    guar = inst.tenant_guaranteed_gpus
    if not guar:
        return
    used: dict[str, int] = {}
    for p in pinned:
        used[p.job.tenant] = used.get(p.job.tenant, 0) + p.option.gpus
    for j in sorted(jobs, key=lambda j: (-j.weight, j.index)):
        g = min(o.gpus for o in j.options)
        if used.get(j.tenant, 0) + g <= guar.get(j.tenant, 0):
            used[j.tenant] = used.get(j.tenant, 0) + g
            j.weight *= opts.guarantee_boost


def heuristic_makespan(inst: Instance, unit_s: int = 1) -> int:
    """Makespan (seconds) of the warm-start plan (a baseline for the benchmark)."""
    opts = SolveOptions(unit_s=unit_s)
    jobs, pinned, _, specs = _build_jobs(inst, unit_s, opts)
    node_caps = [n.gpu_count if n.up else 0 for n in inst.nodes]
    ctx = _context(jobs, pinned, specs, unit_s, opts)
    ctx.held = _held_spans(inst, unit_s)
    sched = _warm_start(jobs, node_caps, _tenant_caps(inst, pinned, ctx.held), pinned, ctx)
    return max([p.end for p in sched] + [p.end for p in pinned] + [0]) * unit_s


def _lower_bound(jobs: Sequence[UJob], pinned: Sequence[Placed], node_caps: Sequence[int]) -> int:
    cap = sum(node_caps)
    energy = sum(min(o.gpus * o.duration for o in j.options) for j in jobs)
    energy += sum(p.end * p.option.gpus for p in pinned)
    lb = max([j.release + min(o.duration for o in j.options) for j in jobs]
             + [p.end for p in pinned] + [0])
    return max(lb, math.ceil(energy / cap) if cap else 0)
