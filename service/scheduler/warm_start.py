"""The planner's warm start: the best, by the objective, of several list schedules (Smith's rule on
w/(g*d) with urgent tasks first, w/d, arrival order (conservative backfilling), and the previous
plan's order merged with new tasks by the same rule), so a new arrival is never queued behind a
stale hint. CP-SAT's first solution, and the plan kept when the search finds nothing better.
"""

from __future__ import annotations

from service.scheduler.objective import PlanContext, objective
from service.scheduler.packing import Placed, UJob, list_schedule


def warm_start_plan(jobs: list[UJob], node_caps: list[int], tenant_caps: dict[str, int],
                pinned: list[Placed], ctx: PlanContext) -> list[Placed]:
    """Best of several list schedules by the objective (planner's module docstring)."""
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
