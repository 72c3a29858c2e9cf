"""Tenant quotas in the plan: quota reclaim (which running tasks of tenants over their guaranteed
share to preempt for a queued task of a tenant under its own) and the weight boost of queued
tasks that fit in their tenant's unused guaranteed share.

Quotas (``tenant_guaranteed_gpus``): a tenant may borrow idle GPUs beyond its guaranteed share
(up to its hard cap, if any); when a tenant under its guarantee has a queued task that cannot
start, running tasks of tenants over their guarantee are chosen for preemption (Plan.preempt,
most recently started first, on the node where the fewest GPUs must be freed) and the task is
planned at 0 on that node. The caller pauses them at a checkpoint and requeues them.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.scheduler.cp import SolveOptions
from service.scheduler.packing import Placed, UJob
from service.scheduler.problem import Instance


def reclaim(inst: Instance, jobs: Sequence[UJob], pinned: Sequence[Placed],
            node_caps: Sequence[int]) -> tuple[list[str], dict[int, int]]:
    """Quota reclaim (planner's module docstring): running task ids to preempt and, per queued
    job index that gets the freed GPUs, its node."""
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
