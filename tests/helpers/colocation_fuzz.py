"""A fuzz of the co-location path of service.scheduler.loop.replan: random states the service
could produce, the same call sequence as loop.colocation() + replan() without the database, and
invariants on the result (no exception; every task assigned or unschedulable; no GPU booked twice
once joins and warm moves apply; caps, rows, keys and reclaim respected). Session 10 found three
bugs with it (commit c83b106: about 1% of states failed before) and ran 10,000+ states clean.
tests/slow/test_colocation_fuzz.py runs a few hundred states; scripts/dev/fuzz_colocation.py
runs many (python scripts/dev/fuzz_colocation.py N SEED [--weird] [--stop-first] [--verbose]).
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from service.scheduler.colocation import (
    CoState,
    JoinCandidate,
    LivePlacement,
    NodeReports,
    colocate_instance,
    demand,
    fresh_executors,
    prefer_warm,
    task_shares,
    tenant_usage,
    usable_executors,
)
from service.scheduler.loop import _shares_gpus
from service.scheduler.planner import SolveOptions, solve
from service.scheduler.problem import Hint, Instance, NodeSpec, Pinned, TaskSpec

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)
TIMEOUT = 30.0
TYPES = ["H100", "A100", "L40"]


@dataclass
class World:
    nodes: list[NodeSpec]
    reports: list[NodeReports]
    tasks: list[TaskSpec]  # the Instance's (queued + running)
    live: list[LivePlacement]  # every live placement (pausing tasks' included)
    keys: dict[str, str]  # every task's colocation key
    sizes: dict[str, list[int]]  # unfinished jobs' batch sizes
    caps: dict[str, int]
    guar: dict[str, int]
    history: dict[str, tuple[float, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def gen(rng: random.Random, weird: bool = False, dup_reports: bool = False) -> World:
    n_nodes = rng.randint(1, 4)
    types = rng.sample(TYPES, rng.randint(1, 2))
    nodes = [NodeSpec(f"n{i}", rng.choice(types), rng.choice([1, 1, 2, 2, 4, 8]),
                      up=rng.random() > 0.15) for i in range(n_nodes)]
    tenants = [f"t{i}" for i in range(rng.randint(1, 4))]
    tprio = {t: rng.choice([0, 0, 0, 1, 5, 10] + ([100, 1000] if weird else []))
             for t in tenants}
    keys_pool = [f"m{i}|sft|{rng.choice([128, 256])}|*" for i in range(rng.randint(1, 3))]
    tasks: list[TaskSpec] = []
    live: list[LivePlacement] = []
    keys: dict[str, str] = {}
    sizes: dict[str, list[int]] = {}
    reports: list[NodeReports] = []
    counter = [0]

    def new_id(prefix: str) -> str:
        counter[0] += 1
        return f"{prefix}{counter[0]}"

    def batch_sizes() -> list[int]:
        n = rng.choice([0, 1, 1, 2, 2, 3, 4])
        out = [rng.choice([1, 2, 4, 4, 8, 8, 16, 32]) for _ in range(n)]
        if out and rng.random() < 0.05:
            out[0] = rng.choice([0, 10**6])
        return out

    def duration() -> int:
        r = rng.random()
        if r < 0.03:
            return 0
        if r < 0.06:
            return rng.randint(10**6, 10**8)
        if r < 0.15:
            return rng.randint(1, 120)
        return rng.randint(60, 6 * 3600)

    def by_type(g_hint: int | None = None) -> dict[str, tuple[int, int]]:
        base_g = g_hint or rng.choice([1, 1, 1, 1, 2, 4])
        d = duration()
        out = {}
        for gt in types:
            g = base_g if rng.random() < 0.8 else rng.choice([1, 2, 4, 16])
            out[gt] = (g, max(0, int(d * rng.choice([1, 1, 0.5, 2, 1.3]))))
        return out

    def running(node: NodeSpec, gpus: tuple[int, ...], key: str, tenant: str | None = None,
                stopping: bool = False, pausing: bool = False) -> LivePlacement:
        tid = new_id("r")
        tenant = tenant or rng.choice(tenants)
        keys[tid] = key
        sizes[tid] = batch_sizes()
        pid = new_id("pl_")
        start = -rng.randint(0, 8 * 3600)
        p = LivePlacement(pid, tid, tenant, key, node.id, tuple(sorted(gpus)),
                          demand(sizes[tid])[1], stopping or pausing)
        live.append(p)
        if not pausing:  # a pausing task (user pause) is not in the instance: not queued|running
            bt = by_type(len(gpus))
            d = bt.get(node.gpu_type, (len(gpus), duration()))[1]
            tasks.append(TaskSpec(tid, tenant, len(gpus), d, priority=rng.randint(-2, 12),
                                  state="running", pinned=Pinned(node.id, tuple(gpus), start),
                                  arrival_s=start - rng.randint(0, 3600),
                                  tenant_priority=tprio[tenant], preemptible=not stopping))
        return p

    for node in nodes:
        execs: list[dict] = []
        free = list(range(node.gpu_count))
        rng.shuffle(free)
        while free:
            kind = rng.choices(["free", "single", "shared", "multi", "warm", "gone", "stale"],
                               [3, 3, 4, 1, 2, 1, 1])[0]
            key = rng.choice(keys_pool)
            flag = rng.random()
            stopping, pausing = flag < 0.08, 0.08 <= flag < 0.12
            if kind == "free":
                free.pop()
            elif kind in ("single", "multi"):
                k = 1 if kind == "single" else rng.randint(1, len(free))
                gpus = tuple(free.pop() for _ in range(k))
                p = running(node, gpus, key, stopping=stopping, pausing=pausing)
                if kind == "multi" or rng.random() < 0.5:  # in an executor of its own
                    free_rows = rng.randint(0, 32)
                    execs.append(dict(key=key, gpu_indices=list(gpus), placement_ids=[p.id],
                                      free_rows=free_rows, total_rows=free_rows + p.rows))
            elif kind == "shared":
                g = free.pop()
                m = rng.randint(1, 4)
                hosted = [running(node, (g,), key, stopping=rng.random() < 0.08,
                                  pausing=rng.random() < 0.04) for _ in range(m)]
                # the report may not list published joins yet, or list ones that ended
                reported = [p.id for p in hosted if rng.random() < 0.85]
                if rng.random() < 0.15:
                    reported.append(new_id("pl_gone"))
                total = rng.choice([8, 16, 32, 64, 0])
                free_rows = rng.randint(0, max(0, total))
                if weird and rng.random() < 0.1:
                    free_rows = total + rng.randint(1, 10)
                execs.append(dict(key=key, gpu_indices=[g], placement_ids=reported,
                                  free_rows=free_rows, total_rows=total,
                                  queued_jobs=rng.randint(0, 3)))
            elif kind == "warm":
                g = free.pop()
                total = rng.choice([8, 16, 64])
                execs.append(dict(key=key, gpu_indices=[g], placement_ids=[],
                                  free_rows=rng.randint(0, total), total_rows=total))
            elif kind == "gone":  # reported busy, but every hosted task has ended
                g = free.pop()
                total = rng.choice([8, 16])
                execs.append(dict(key=key, gpu_indices=[g], placement_ids=[new_id("pl_old")],
                                  free_rows=rng.randint(0, total), total_rows=total))
            elif kind == "stale":  # an idle report, but the GPU went to another key since
                g = free.pop()
                other = rng.choice(keys_pool)
                running(node, (g,), other)
                execs.append(dict(key=key, gpu_indices=[g], placement_ids=[], free_rows=16,
                                  total_rows=16))
        if rng.random() < 0.1:
            execs.append({"nonsense": 1})
        if rng.random() < 0.1:
            execs.append(dict(key="x", gpu_indices=[node.gpu_count + 1], free_rows=1,
                              total_rows=1))
        r = rng.random()
        at = (None if r < 0.1 else NOW - timedelta(seconds=rng.choice([31, 120]))
              if r < 0.25 else NOW - timedelta(seconds=rng.randint(0, 30)))
        reports.append(NodeReports(node.id, node.gpu_type, node.gpu_count, node.up,
                                   execs if execs or rng.random() < 0.5 else None, at))

    n_queued = rng.randint(0, 14)
    for _ in range(n_queued):
        tid = new_id("q")
        tenant = rng.choice(tenants)
        keys[tid] = rng.choice(keys_pool + ["solo|sft|64|*"])
        sizes[tid] = batch_sizes()
        bt = by_type()
        arrival = -rng.choice([0, 0, rng.randint(0, 600), rng.randint(0, 6 * 3600),
                               rng.randint(0, 3 * 86400)])
        max_wait = rng.choice([4 * 3600, 4 * 3600, 600, 3600, 86400])
        hint = None
        if rng.random() < 0.25:
            n = rng.choice(nodes)
            hint = Hint(n.id if rng.random() < 0.9 else "gone-node", rng.randint(0, 7200),
                        tuple(sorted(rng.sample(range(n.gpu_count + 1),
                                                min(n.gpu_count + 1, rng.randint(1, 2))))))
        g, d = next(iter(bt.values()))
        tasks.append(TaskSpec(tid, tenant, g, d, priority=rng.randint(-2, 12), by_gpu_type=bt,
                              tenant_priority=tprio[tenant], arrival_s=min(0, arrival),
                              hint=hint, max_start_s=min(0, arrival) + max_wait))
    if weird and rng.random() < 0.1:  # a node re-registered with fewer GPUs while tasks run
        k = rng.randrange(len(nodes))
        n = nodes[k]
        if n.gpu_count > 1:
            nodes[k] = NodeSpec(n.id, n.gpu_type, n.gpu_count // 2, n.up)
            r = reports[k]
            reports[k] = NodeReports(r.id, r.gpu_type, n.gpu_count // 2, r.up, r.executors,
                                     r.executors_at)
    if dup_reports and rng.random() < 0.1:
        # a report listing one executor twice: worker/shared_hosts.py cannot (one host per GPU set:
        # a new one starts only when no host overlaps its GPUs), so not in --weird
        for r in reports:
            if r.executors:
                r.executors.append(dict(r.executors[0]))
                break
    if weird and rng.random() < 0.1:  # two live placements on overlapping, unequal GPU sets
        big = [n for n in nodes if n.gpu_count >= 2]
        if big:
            n = rng.choice(big)
            running(n, (0, 1), rng.choice(keys_pool))
            running(n, (1,), rng.choice(keys_pool))
    # tasks ordered as build_instance orders them (created_at, id): roughly by arrival
    rng.shuffle(tasks)
    caps = {t: rng.choice([0, 1, 1, 2, 3, 4, 8]) for t in tenants if rng.random() < 0.4}
    guar = {t: rng.choice([1, 1, 2, 4]) for t in tenants if rng.random() < 0.35}
    history = {t: (rng.uniform(1, 40), rng.randint(1, 20)) for t in tenants if rng.random() < 0.3}
    return World(nodes, reports, tasks, live, keys, sizes, caps, guar, history)


def replan(w: World, opts: SolveOptions):  # noqa: ANN201
    """What loop.replan and loop.colocation do with these inputs (no database)."""
    inst = Instance(w.nodes, w.tasks, w.caps, w.guar, w.history)
    executors = fresh_executors(w.reports, NOW, TIMEOUT)
    if not executors and not _shares_gpus(inst):
        co = CoState(colocate_instance(inst))
    else:
        # _live_placements: keys of the live tasks and of every instance task
        keys = dict(w.keys)
        co = CoState(colocate_instance(inst, tenant_usage(w.live), task_shares(w.live)),
                     live=list(w.live), keys=keys)
        ends = {t.id: t.duration_s for t in inst.tasks if t.pinned is not None}
        for ex in usable_executors(executors, w.live, ends):
            (co.idle if ex.idle else co.busy).append(ex)
        for t in inst.tasks:
            if t.pinned is None and t.id in keys:
                low, total = demand(w.sizes.get(t.id, []))
                if total:
                    co.candidates[t.id] = JoinCandidate(t.id, keys[t.id], low, total)
    plan = solve(co.colocated.instance, opts)
    before = copy.deepcopy(plan.assignments)
    idle_snap = copy.deepcopy(co.idle)
    busy_snap = copy.deepcopy(co.busy)
    moved = prefer_warm(plan, co.idle, co.keys, {n.id: n.gpu_type for n in inst.nodes})
    starting = set(plan.starts_now())
    joins = co.joins(inst, plan)
    return inst, co, plan, before, moved, starting, joins, idle_snap, busy_snap


class Fail(Exception):
    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(f"{kind}: {msg}")
        self.kind = kind


def units(s: int, unit: int) -> int:
    return max(1, math.ceil(s / unit))


def check(w: World, out, info: Counter, unit: int) -> None:  # noqa: ANN001, C901
    inst, co, plan, before, moved, starting, joins, idle_snap, busy_snap = out
    nodes = {n.id: n for n in inst.nodes}
    by_id = {t.id: t for t in inst.tasks}
    cinst = co.colocated.instance
    cby_id = {t.id: t for t in cinst.tasks}
    occupants = set(co.colocated.occupants)
    victims = set(plan.preempt)
    # B: coverage
    for t in inst.tasks:
        if t.id not in plan.assignments and t.id not in plan.unschedulable:
            raise Fail("coverage", f"{t.id} neither assigned nor unschedulable")
        if t.id in plan.assignments and t.id in plan.unschedulable:
            raise Fail("coverage", f"{t.id} both assigned and unschedulable")
    extra = set(plan.assignments) | set(plan.unschedulable)
    extra -= set(by_id) | occupants
    if extra:
        raise Fail("coverage", f"unknown ids in plan {extra}")
    for tid, why in plan.unschedulable.items():
        t = cby_id.get(tid)
        if t is not None and t.pinned is None:
            ups = [n for n in inst.nodes if n.up]
            cap = inst.tenant_max_gpus.get(t.tenant)
            ok = all(t.need(n.gpu_type)[0] > n.gpu_count or t.need(n.gpu_type)[0] <= 0
                     or (cap is not None and t.need(n.gpu_type)[0] > cap) for n in ups)
            if not ok:
                raise Fail("unschedulable", f"{tid} refused but fits somewhere: {why}")
    # reclaim's victims: a running task not being stopped, or an occupant whose every hosted task
    # is preemptible and of a tenant beyond its guarantee (by shares)
    shares0 = tenant_usage(w.live)
    for v in victims:
        if v in occupants:
            ms = [by_id[m] for m in co.colocated.occupants[v]]
            if not all(m.preemptible and shares0.get(m.tenant, 0.0) > inst.tenant_guaranteed_gpus
                       .get(m.tenant, 0) for m in ms):
                raise Fail("reclaim", f"occupant {v} taken though it hosts a protected task")
        elif v not in by_id or not by_id[v].preemptible or by_id[v].pinned is None:
            raise Fail("reclaim", f"victim {v} not a preemptible running task")
    # C: the plan after prefer_warm
    spans: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for tid, a in plan.assignments.items():
        t = cby_id[tid]
        n = nodes.get(a.node_id)
        if n is None:
            raise Fail("plan", f"{tid} on unknown node {a.node_id}")
        if len(set(a.gpu_indices)) != len(a.gpu_indices) or (not a.pinned and any(
                not 0 <= g < n.gpu_count for g in a.gpu_indices)):
            raise Fail("plan", f"{tid} bad GPUs {a.gpu_indices} on {n.id}/{n.gpu_count}")
        if a.pinned:
            if t.pinned is None or tid in victims:
                raise Fail("plan", f"{tid} pinned in plan but not in instance")
            if a.node_id != t.pinned.node_id or tuple(a.gpu_indices) != tuple(
                    t.pinned.gpu_indices):
                raise Fail("plan", f"pinned {tid} moved: {a} vs {t.pinned}")
            lo = 0
        else:
            if not n.up:
                raise Fail("plan", f"{tid} planned on down node {n.id}")
            if a.start_s < 0:
                raise Fail("plan", f"{tid} starts in the past")
            if tid in victims:
                if a.start_s < unit:
                    raise Fail("plan", f"victim {tid} restarts at once")
            else:
                g, d = t.need(n.gpu_type)
                if len(a.gpu_indices) != g:
                    raise Fail("plan-gpus", f"{tid} gets {len(a.gpu_indices)} GPUs on "
                               f"{n.gpu_type}, needs {g} (moved: {tid in moved})")
                if a.end_s - a.start_s != units(d, unit) * unit:
                    raise Fail("plan-duration", f"{tid} runs {a.end_s - a.start_s}s on "
                               f"{n.gpu_type}, needs {units(d, unit) * unit} (moved: {tid in moved})")
            lo = a.start_s
        for g in a.gpu_indices:
            spans.setdefault((a.node_id, g), []).append((lo, a.end_s, tid))
    for spot, ss in spans.items():
        ss.sort()
        for (s1, e1, t1), (s2, e2, t2) in zip(ss, ss[1:], strict=False):
            if s2 < e1:
                raise Fail("double-booked", f"{spot}: {t1} [{s1},{e1}) and {t2} [{s2},{e2}) "
                           f"(moved {set(moved)})")
    # tenant caps as the planner defines them (pinned GPUs and held shares: a lowered cap
    # keeps what runs), and at time 0 with co-located shares (task_shares) and this replan's
    # joins: a tenant at or over its cap gets nothing new, one under it stays within it
    shares = task_shares(w.live)
    for tenant, cap in inst.tenant_max_gpus.items():
        mine = [a for tid, a in plan.assignments.items() if cby_id[tid].tenant == tenant]
        # the planner's caps are taken before reclaim: a preempted task comes back under them
        running = sum(len(t.pinned.gpu_indices) for t in cinst.tasks if t.pinned is not None
                      and t.tenant == tenant and nodes[t.pinned.node_id].up)
        hosted = [t for t in cinst.tasks if t.tenant == tenant and t.pinned is not None
                  and not t.pinned.gpu_indices]
        hosted_share = sum(shares.get(t.id, 0.0) for t in hosted)
        limit = max(cap, running + math.ceil(hosted_share - 1e-9))
        for x in mine:
            at = max(0, x.start_s)
            used = sum(len(a.gpu_indices) for a in mine
                       if max(0, a.start_s) <= at < a.end_s)
            if used > limit:
                raise Fail("cap", f"{tenant} uses {used} > {limit} at {at}")
        whole = sum(len(a.gpu_indices) for tid, a in plan.assignments.items()
                    if a.pinned and cby_id[tid].tenant == tenant and tid not in victims)
        new_now = sum(len(a.gpu_indices) for a in mine if not a.pinned and a.start_s == 0)
        joined = sum(j.share for j in joins if j.tenant == tenant)
        if new_now or joined:
            if whole + hosted_share + new_now + joined > limit + 1e-9:
                raise Fail("cap with shares", f"{tenant}: {whole} whole + {hosted_share:.2f} "
                           f"hosted + {new_now} new + {joined:.2f} joined > {limit}")
    # D: prefer_warm
    idle_by = {(e.node_id, e.gpus): e for e in idle_snap}
    for tid, a in moved.items():
        b = before[tid]
        if a.pinned or b.pinned:
            raise Fail("prefer_warm", f"moved pinned {tid}")
        if a.start_s != b.start_s or a.end_s != b.end_s:
            raise Fail("prefer_warm", f"{tid} moved in time")
        if a.node_id != b.node_id:
            ex = idle_by.get((a.node_id, a.gpu_indices))
            if ex is None or co.keys.get(tid) != ex.key or a.start_s != 0:
                raise Fail("prefer_warm", f"{tid} moved to {a} not a warm GPU of its key")
            if nodes[a.node_id].gpu_type != nodes[b.node_id].gpu_type:
                info["prefer_warm cross-type move"] += 1
    if moved:
        info["prefer_warm moved"] += 1
    # E: joins
    if joins:
        info["instances with joins"] += 1
    busy_by = {e.ref: e for e in busy_snap}
    free = {e.ref: e.free_rows for e in busy_snap}
    hold = {e.ref: e.hold_end_s for e in busy_snap}
    usage = tenant_usage(w.live)
    rows = {e.ref: sum(max(1, p.rows) for p in w.live if p.node_id == e.node_id
                       and set(p.gpus) & set(e.gpus)) for e in busy_snap}
    specs = {t.id: t for t in inst.tasks if t.pinned is None and t.id not in starting}
    joinable_ids = set()
    for tid, c in co.candidates.items():
        if tid in specs and any(
                not e.idle and nodes[e.node_id].up and e.key == c.key and len(e.gpus) == 1
                and specs[tid].need(e.gpu_type)[0] == 1 and e.free_rows >= max(1, c.demand_rows)
                for e in busy_snap):
            joinable_ids.add(tid)
    guar = inst.tenant_guaranteed_gpus

    def hard(t: TaskSpec) -> bool:
        if usage.get(t.tenant, 0.0) < guar.get(t.tenant, 0):
            return True
        if t.max_start_s is None:
            return False
        arr = t.arrival_s or 0
        return -arr >= (t.max_start_s - arr) / 2
    blocked = any(hard(t) for t in specs.values() if t.id not in joinable_ids)
    seen = set()
    for j in joins:
        t = by_id.get(j.task_id)
        c = co.candidates.get(j.task_id)
        ex = busy_by.get(j.executor.ref)
        if t is None or t.pinned is not None or j.task_id in starting or c is None:
            raise Fail("join", f"{j.task_id} may not join (pinned/starting/no candidate)")
        if j.task_id in seen:
            raise Fail("join", f"{j.task_id} joins twice")
        seen.add(j.task_id)
        if ex is None:
            raise Fail("join", f"{j.task_id} joins an executor not busy/usable {j.executor.ref}")
        if ex.key != c.key or len(ex.gpus) != 1 or t.need(ex.gpu_type)[0] != 1:
            raise Fail("join", f"{j.task_id} key/gpus mismatch on {ex.ref}")
        if not nodes[ex.node_id].up:
            raise Fail("join", f"{j.task_id} joins on down node")
        f = free[ex.ref]
        if f < max(1, c.demand_rows):
            raise Fail("join-rows", f"{j.task_id} demand {c.demand_rows} > free {f}")
        take = min(max(c.rows, c.demand_rows), f)
        if j.rows != take:
            raise Fail("join-rows", f"{j.task_id} takes {j.rows}, expected {take}")
        free[ex.ref] = f - take
        share = len(ex.gpus) * take / (rows[ex.ref] + take)
        if abs(share - j.share) > 1e-9:
            raise Fail("join-share", f"{j.task_id} share {j.share} expected {share}")
        cap = inst.tenant_max_gpus.get(t.tenant)
        if cap is not None and usage.get(t.tenant, 0.0) + share > cap + 1e-9:
            raise Fail("join-cap", f"{j.task_id} {t.tenant} {usage.get(t.tenant, 0.0)}+{share}"
                       f" > {cap}")
        usage[t.tenant] = usage.get(t.tenant, 0.0) + share
        rows[ex.ref] += take
        if j.duration_s != t.need(ex.gpu_type)[1]:
            raise Fail("join", f"{j.task_id} duration {j.duration_s}")
        if blocked and j.duration_s > hold[ex.ref]:
            raise Fail("join-wait", f"{j.task_id} outlasts {ex.ref} while a task waits hard")
        hold[ex.ref] = max(hold[ex.ref], j.duration_s)
        # the executor's GPUs at time 0 in the plan: held by what runs there (pinned), never by
        # a task the plan starts or restarts
        held_until = busy_snap_end(plan, ex, co)
        if held_until <= 0:
            raise Fail("join-double-booked", f"{j.task_id} joins {ex.ref}, which nothing holds "
                       f"in the plan (victims {sorted(victims)})")
        for g in ex.gpus:
            for s, e, other in spans.get((ex.node_id, g), []):
                if plan.assignments[other].pinned:
                    continue
                if s < held_until:
                    raise Fail("join-double-booked",
                               f"{j.task_id} joins {ex.ref} where the plan runs {other} "
                               f"[{s},{e}) (held until {held_until}, victims {sorted(victims)})")
                if s < j.duration_s:
                    info["join outlasts the executor into a planned task"] += 1
    # F: reality at time 0 (loop.py's `busy` guards the publish): informational
    live_gpus = {(p.node_id, g): p for p in w.live for g in p.gpus}
    for tid, a in plan.assignments.items():
        if a.pinned or a.start_s != 0 or tid in victims:
            continue
        for g in a.gpu_indices:
            p = live_gpus.get((a.node_id, g))
            if p is not None and p.task_id not in victims and not any(
                    p.task_id in co.colocated.occupants.get(v, []) for v in victims):
                info["plan starts now on a GPU a live placement holds"
                     + (" (pausing task)" if p.task_id not in by_id else "")] += 1


def busy_snap_end(plan, ex, co) -> int:  # noqa: ANN001
    """When the plan frees the executor's GPU (its pinned holder's end), 0 if none is pinned."""
    end = 0
    for a in plan.assignments.values():
        if a.pinned and a.node_id == ex.node_id and set(a.gpu_indices) & set(ex.gpus):
            end = max(end, a.end_s)
    return end


def state(seed: int, weird: bool = False, dup_reports: bool = False) -> tuple[World, int]:
    """The state of one seed and the planner unit (s) it is solved with."""
    return (gen(random.Random(seed), weird, dup_reports),
            random.Random(seed * 7 + 1).choice([60, 60, 60, 1, 300]))


def options(unit: int) -> SolveOptions:
    return SolveOptions(unit_s=unit, work_limit=0.02, time_limit_s=5.0)


@dataclass
class Report:
    states: int
    seconds: float
    fails: Counter = field(default_factory=Counter)  # kind -> count
    examples: dict[str, int] = field(default_factory=dict)  # kind -> its first seed
    info: Counter = field(default_factory=Counter)  # what the states exercised


def run(n: int, seed0: int = 0, weird: bool = False, dup_reports: bool = False,
        on_fail: Callable[[int, str], bool] | None = None) -> Report:
    """Fuzz n states, seeds seed0.. (each state's planner unit drawn from its seed);
    on_fail(seed, what) returning True stops at that failure."""
    report = Report(n, 0.0)
    t0 = time.monotonic()
    for seed in range(seed0, seed0 + n):
        w, unit = state(seed, weird, dup_reports)
        try:
            out = replan(w, options(unit))
            check(w, out, report.info, unit)
        except Fail as f:
            kind = f.kind
        except Exception as e:  # noqa: BLE001 - every exception is a finding
            kind = f"exception {type(e).__name__}: {str(e)[:80]}"
        else:
            report.info["instances"] += 1
            report.info["queued tasks"] += sum(t.pinned is None for t in w.tasks)
            report.info["joins"] += len(out[6])
            report.info["occupants"] += len(out[1].colocated.occupants)
            report.info["reclaim victims"] += len(out[2].preempt)
            report.info["busy executors usable"] += len(out[8])
            report.info["idle executors usable"] += len(out[7])
            continue
        report.fails[kind] += 1
        report.examples.setdefault(kind, seed)
        if on_fail is not None and on_fail(seed, kind):
            break
    report.seconds = time.monotonic() - t0
    return report
