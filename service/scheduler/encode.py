"""The planner's instance in the solver's integer terms: tasks as jobs in time units with their
node options (UJob, Placed), flow-time weights, tenant caps and held GPUs, and the objective's
per-job constants (PlanContext): what the warm start, quotas and the CP model of the planner work on."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from service.scheduler.cp import SolveOptions
from service.scheduler.objective import PlanContext
from service.scheduler.packing import Option, Placed, UJob
from service.scheduler.problem import Instance, TaskSpec

FAIR_SCALE = 6  # the default fairness (0.25) is 1.5 mean durations x total weight per slowdown
WEIGHT_SCALE = 100  # flow-time weights are scaled so that the fair-share coefficient is not 0


def weight(priority: int, tenant_priority: int = 0) -> int:
    return (1 + max(0, min(int(tenant_priority), 100))) * (10 + max(0, min(int(priority), 10)))


def _units_up(seconds: float, unit: int) -> int:
    return int(math.ceil(seconds / unit))


def build_jobs(inst: Instance, unit: int, opts: SolveOptions
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


def tenant_capacities(inst: Instance, pinned: Sequence[Placed],
                 held: Mapping[str, Sequence[tuple[int, int]]]) -> dict[str, int]:
    caps = {}
    for tenant, limit in inst.tenant_max_gpus.items():
        running = sum(p.option.gpus for p in pinned if p.job.tenant == tenant)
        running += sum(g for _, g in held.get(tenant, ()))
        caps[tenant] = max(limit, running)  # a lowered limit never evicts running tasks
    return caps


def held_spans(inst: Instance, unit: int) -> dict[str, list[tuple[int, int]]]:
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


def plan_context(jobs: Sequence[UJob], pinned: Sequence[Placed], specs: Mapping[int, TaskSpec],
             unit: int, opts: SolveOptions,
             history: Mapping[str, tuple[float, int]] | None = None) -> PlanContext:
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
    return PlanContext(age, norm, deadline, half, urgent=2 * wmax,
                # Past the bound costs more than any fair-share or tail gain of one unit.
                late=(20 * max(1, len(jobs)) * (wmax + 100 * fair * max(share.values(), default=1))
                      + tail), fair=fair, tenants=tenants,
                fixed=fixed, tail=tail, share=share, margin=margin,
                rank={j.index: 10 + max(0, min(int(specs[j.index].priority), 10)) for j in jobs})
