"""Co-location in the plan (docs/architecture.md, issue 19): queued tasks join warm shared executors, and the
planner sees each shared executor's GPUs once. Pure: no database, no clock (loop.py feeds it).

A node's heartbeat reports its shared executors (contract.protocol.ExecutorReport): key, GPUs,
hosted placements, free and total sequence rows. Only fresh reports count (node up, report
younger than node_timeout_s: ``fresh_executors``), and only as the database confirms them
(``usable_executors``): a busy executor's GPUs are held by live placements of its key on exactly
its GPUs, none of them being stopped; a warm idle one's GPUs by none.

``colocate_instance`` gives the CP-SAT planner each group of live placements that share GPUs as
one pinned occupant of those GPUs until the group's last task ends (of no real tenant), with every
hosted task pinned on zero GPUs: no GPU is counted twice. Quota reclaim may take a shared
executor's GPUs only when every task it hosts is of a tenant beyond its guaranteed share: all of
them are then paused at a checkpoint and requeued (one hosted task paused frees rows, not GPUs).
One it may not take holds its GPUs to reclaim as any running task does, until every task it
hosts is being stopped.

Free GPUs first: the planner decides who starts now on GPUs (every priority, guarantee and
waiting bound holds); only queued tasks it does not start now join a busy executor
(``plan_joins``, after solving). Joining ahead of free GPUs trained as much per held GPU-second
but lengthened completions (time-sharing a backbone while GPUs idle): bench/colocate_sim.py,
bench/results/colocate_sim_cpu.md. The rules of a join: ``plan_joins``; of a warm idle executor:
``prefer_warm``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from contract.states import TaskState
from service.scheduler.encode import weight
from service.scheduler.executors import (  # noqa: F401 - the plan's view of them, re-exported
    LivePlacement,
    NodeReports,
    WarmExecutor,
    by_shared_gpus,
    fresh_executors,
    shared_groups,
    task_shares,
    tenant_usage,
    usable_executors,
)
from service.scheduler.problem import Assignment, Instance, Pinned, Plan, TaskSpec

SHARED_TENANT = ""  # the pinned occupant of a shared executor belongs to no tenant


@dataclass(frozen=True)
class JoinCandidate:
    """A queued task that could join: its key, demand (smallest unfinished job's batch size) and
    rows (all unfinished jobs' batch sizes), and its (GPUs, seconds) per GPU type."""

    task_id: str
    key: str
    demand_rows: int
    rows: int


@dataclass(frozen=True)
class Join:
    task_id: str
    tenant: str
    executor: WarmExecutor
    rows: int  # rows of the admission budget the join takes
    share: float  # GPUs counted to its tenant at join time
    duration_s: int


@dataclass
class _Group:
    rows: int
    gpus: int


def plan_joins(inst: Instance, executors: Sequence[WarmExecutor],
               candidates: Mapping[str, JoinCandidate], live: Sequence[LivePlacement],
               starting: Mapping[str, int] | None = None,
               pausing: Collection[str] = ()) -> list[Join]:
    """Which queued tasks of ``inst`` join which busy executors now; ``starting``: the queued
    tasks the plan starts now on GPUs, with their GPU counts (they neither join nor wait, and
    their GPUs count against their tenants' caps); ``pausing``: the running tasks the plan
    preempts (quota reclaim frees their GPUs). The rules:
    - a task may join an executor with its colocation_key, on one GPU (an adapter-parallel task, or an
      executor on several GPUs, never joins), when the executor's free rows (minus rows of joins it
      has not reported yet) cover the task's demand: its smallest unfinished job's batch size (a job
      of batch size B takes B rows of the admission budget);
    - a joining task takes min(its rows, free rows), its rows being the batch sizes of its unfinished
      jobs summed; the executor admits what fits and queues the rest;
    - who joins first: tasks of tenants under their guaranteed share, then by planner weight
      (operator priorities), then arrival, then id; each picks the executor with the most free rows
      (then node and GPU order);
    - a tenant's usage counts each hosted task as a share of its executor's GPUs by rows:
      gpus x rows_t / sum of the hosted tasks' rows (one task alone: all its GPUs); a join is refused
      when the tenant's usage, the GPUs of its tasks the plan starts now and that share would pass
      its max_gpus; and the planner counts a tenant's hosted shares against its max_gpus until each
      hosted task ends (Instance.tenant_held_gpus, rounded up at each time), so a tenant holding half
      a GPU under a cap of 1 starts no whole-GPU task before that share is released;
    - bounded waiting: a join that would keep an executor's GPUs past its current end is refused
      while another waiting task (not joining) is urgent (past half its waiting bound) or of a tenant
      under its guaranteed share: the executor drains and its GPUs go to the plan;
    - quota reclaim: no task joins an executor whose tasks the plan pauses (their GPUs go to a task
      owed its guaranteed share, which a join would keep from it).
    """
    starting = starting or {}
    specs = {t.id: t for t in inst.tasks if t.pinned is None and t.id not in starting}
    usage = tenant_usage(live)
    capped = dict(usage)  # what counts against a cap now: the plan's starts too
    for t in inst.tasks:
        if t.id in starting:
            capped[t.tenant] = capped.get(t.tenant, 0.0) + starting[t.id]
    guar = inst.tenant_guaranteed_gpus
    caps = inst.tenant_max_gpus
    gpu_type = {n.id: n.gpu_type for n in inst.nodes if n.up}
    groups: dict[str, _Group] = {}
    open_: list[WarmExecutor] = []  # no task it hosts is paused by the plan
    for ex in executors:
        on = [p for p in live if p.node_id == ex.node_id and set(p.gpus) & set(ex.gpus)]
        groups[ex.ref] = _Group(sum(max(1, p.rows) for p in on), len(ex.gpus))
        if not any(p.task_id in pausing for p in on):
            open_.append(ex)
    joinable = {tid for tid, c in candidates.items() if tid in specs and any(
        _fits(specs[tid], c, ex, gpu_type) for ex in open_)}
    blocked = any(_waits_hard(t, usage, guar) for t in specs.values() if t.id not in joinable)

    def order(t: TaskSpec) -> tuple:
        under = usage.get(t.tenant, 0.0) < guar.get(t.tenant, 0)
        return (not under, -weight(t.priority, t.tenant_priority),
                t.arrival_s if t.arrival_s is not None else 0, t.id)

    joins: list[Join] = []
    for t in sorted((specs[tid] for tid in joinable), key=order):
        c = candidates[t.id]
        fits = [ex for ex in open_ if _fits(t, c, ex, gpu_type)]
        fits.sort(key=lambda ex: (-ex.free_rows, ex.node_id, ex.gpus))
        for ex in fits:
            duration = t.need(ex.gpu_type)[1]
            if blocked and duration > ex.hold_end_s:
                continue  # it would keep GPUs that a task waiting too long needs
            take = min(max(c.rows, c.demand_rows), ex.free_rows)
            g = groups[ex.ref]
            share = g.gpus * take / (g.rows + take)
            cap = caps.get(t.tenant)
            if cap is not None and capped.get(t.tenant, 0.0) + share > cap + 1e-9:
                continue
            ex.free_rows -= take
            ex.hold_end_s = max(ex.hold_end_s, duration)
            ex.placement_ids = (*ex.placement_ids, f"join:{t.id}")
            g.rows += take
            usage[t.tenant] = usage.get(t.tenant, 0.0) + share
            capped[t.tenant] = capped.get(t.tenant, 0.0) + share
            joins.append(Join(t.id, t.tenant, ex, take, share, duration))
            break
    return joins


def _fits(t: TaskSpec, c: JoinCandidate, ex: WarmExecutor, gpu_type: Mapping[str, str]) -> bool:
    if ex.idle or ex.node_id not in gpu_type or c.key != ex.key or len(ex.gpus) != 1:
        return False
    return t.need(ex.gpu_type)[0] == 1 and ex.free_rows >= max(1, c.demand_rows)


def _waits_hard(t: TaskSpec, usage: Mapping[str, float], guar: Mapping[str, int]) -> bool:
    """A waiting task that is urgent or of a tenant under its guaranteed share."""
    if usage.get(t.tenant, 0.0) < guar.get(t.tenant, 0):
        return True
    if t.max_start_s is None:
        return False
    arrival = t.arrival_s if t.arrival_s is not None else 0
    bound = t.max_start_s - arrival
    return -arrival >= bound / 2


@dataclass
class CoState:
    """What loop.py gathers for co-location before solving (see the module docstring)."""

    colocated: Colocated
    busy: list[WarmExecutor] = field(default_factory=list)
    idle: list[WarmExecutor] = field(default_factory=list)
    candidates: dict[str, JoinCandidate] = field(default_factory=dict)
    live: list[LivePlacement] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)  # task id -> colocation key

    def joins(self, inst: Instance, plan: Plan) -> list[Join]:
        """Joins after ``plan`` (solved on ``colocated.instance``): tasks it starts now on GPUs
        neither join nor wait, and no task joins an executor it pauses."""
        if not self.busy:
            return []
        return plan_joins(inst, self.busy, self.candidates, self.live, plan.starts_now(),
                          self.colocated.pausing(plan))


@dataclass
class Colocated:
    """The instance the planner solves and what it hides: the occupant ids (one per shared
    executor) and the task ids pinned on zero GPUs."""

    instance: Instance
    occupants: dict[str, list[str]] = field(default_factory=dict)  # occupant id -> task ids

    def pausing(self, plan: Plan) -> list[str]:
        """The running tasks ``plan`` preempts: an occupant stands for every task it hosts."""
        return [t for v in plan.preempt for t in self.occupants.get(v, [v])]


def colocate_instance(inst: Instance, usage: Mapping[str, float] | None = None,
                      shares: Mapping[str, float] | None = None) -> Colocated:
    """Give each group of running tasks that share GPUs one occupant (module docstring). With
    tenants' ``usage``, an occupant whose every hosted task may be preempted and is of a tenant
    beyond its guaranteed share may be chosen by quota reclaim: loop.py then pauses every task it
    hosts. Any other is of a tenant of its own whose guaranteed share is its GPUs: reclaim never
    takes it, and counts its GPUs busy until every task it hosts is being stopped (to
    quotas.reclaim, a running task that is not preemptible is being stopped: GPUs as good as
    free). Each hosted task's share of its executor's GPUs (``shares``, task_shares; an equal
    split where unknown) stays its tenant's until it ends: Instance.tenant_held_gpus, counted
    against the tenant's hard cap."""
    tasks = list(inst.tasks)
    pinned = [t for t in tasks if t.pinned is not None]
    groups = by_shared_gpus(pinned, lambda t: (t.pinned.node_id, t.pinned.gpu_indices)
                             if t.pinned is not None else ("", ()))
    shared = sorted((sorted(g, key=lambda m: m.id) for g in groups if len(g) > 1),
                    key=lambda g: g[0].id)
    hosted = {m.id for ms in shared for m in ms}
    new_tasks = []
    for t in tasks:
        if t.id in hosted and t.pinned is not None:
            t = replace(t, pinned=Pinned(t.pinned.node_id, (), t.pinned.start_s),
                        gpus_needed=0, preemptible=False)
        new_tasks.append(t)
    out = Colocated(inst)
    guar = dict(inst.tenant_guaranteed_gpus)
    held = {t: list(h) for t, h in inst.tenant_held_gpus.items()}
    for ms in shared:
        spots = [m.pinned for m in ms if m.pinned is not None]
        node = spots[0].node_id
        gpus = tuple(sorted({g for s in spots for g in s.gpu_indices}))
        start = min(s.start_s for s in spots)
        occupant = f"executor:{node}:{','.join(map(str, gpus))}"
        lent = usage is not None and all(
            m.preemptible and usage.get(m.tenant, 0.0) > guar.get(m.tenant, 0) for m in ms)
        stopped = not any(m.preemptible for m in ms)  # every task it hosts is being stopped
        tenant = SHARED_TENANT
        if not lent and not stopped:  # reclaim may not take it, yet it runs on (docstring)
            tenant, guar[occupant] = occupant, len(gpus)
        new_tasks.append(TaskSpec(
            id=occupant, tenant=tenant, gpus_needed=len(gpus),
            duration_s=max(m.duration_s for m in ms), state=TaskState.RUNNING.value,
            pinned=Pinned(node, gpus, start), arrival_s=start, preemptible=not stopped))
        out.occupants[occupant] = [m.id for m in ms]
        for m in ms:
            share = (shares or {}).get(m.id, len(gpus) / len(ms))
            held.setdefault(m.tenant, []).append((float(m.duration_s), share))
    out.instance = replace(inst, tasks=new_tasks, tenant_guaranteed_gpus=guar,
                           tenant_held_gpus=held)
    return out


def demand(batch_sizes: Iterable[int]) -> tuple[int, int]:
    """(smallest batch size, sum of batch sizes) of a task's unfinished jobs; (0, 0) if none."""
    sizes = [max(1, int(b)) for b in batch_sizes]
    return (min(sizes), sum(sizes)) if sizes else (0, 0)


def prefer_warm(plan: Plan, idle: Sequence[WarmExecutor], keys: Mapping[str, str],
                gpu_type: Mapping[str, str]) -> dict[str, Assignment]:
    """Move tasks the plan starts now onto warm idle executors of their key. A warm idle
    executor's GPUs are free GPUs to the planner: it decides who starts now, so every priority,
    guarantee and waiting bound holds, and a task of another key may take them (its daemon stops
    the idle executor first). After solving, this moves a one-GPU task of the executor's key that
    the plan starts now onto the warm GPU (no model load): by relabelling two GPUs of the same
    node in the plan, or from another node of its GPU type when the warm GPU is free in the plan
    for the task's whole run.

    Returns the changed assignments (task id -> new); ``plan.assignments`` is updated too.
    ``gpu_type`` (node id -> type): a task moves to another node only of its own node's type, as
    on another type it would need other GPUs or time than the plan gives it."""
    changed: dict[str, Assignment] = {}
    a = plan.assignments
    taken: set[str] = set()
    for ex in sorted(idle, key=lambda e: (e.node_id, e.gpus)):
        if not ex.idle or len(ex.gpus) != 1:
            continue
        g = ex.gpus[0]
        on_it = [x for x in a.values() if x.node_id == ex.node_id and g in x.gpu_indices]
        if any(x.pinned for x in on_it):
            continue
        if any(x.start_s == 0 and keys.get(x.task_id) == ex.key for x in on_it):
            continue  # the plan already starts its key there
        now = sorted((x for x in a.values() if not x.pinned and x.start_s == 0
                      and x.task_id not in taken and keys.get(x.task_id) == ex.key
                      and len(x.gpu_indices) == 1
                      and gpu_type.get(x.node_id) == ex.gpu_type),
                     key=lambda x: (x.node_id != ex.node_id, x.task_id))
        for x in now:
            if x.node_id == ex.node_id:
                moved = _swap(a, ex.node_id, x.gpu_indices[0], g)
            elif not any(y.start_s < x.end_s for y in on_it):
                moved = {x.task_id: replace(x, node_id=ex.node_id, gpu_indices=ex.gpus)}
            else:
                continue
            a.update(moved)
            changed.update(moved)
            taken.add(x.task_id)
            break
    return changed


def _swap(a: Mapping[str, Assignment], node: str, g1: int, g2: int) -> dict[str, Assignment]:
    """Relabel GPUs g1 and g2 of a node in every unpinned assignment (none pinned holds them)."""
    out = {}
    for x in a.values():
        if x.node_id == node and not x.pinned and {g1, g2} & set(x.gpu_indices):
            swapped = tuple(sorted(g2 if i == g1 else g1 if i == g2 else i
                                   for i in x.gpu_indices))
            out[x.task_id] = replace(x, gpu_indices=swapped)
    return out
