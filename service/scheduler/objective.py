"""The planner's objective, shared by its CP-SAT model (`cp.py`) and its warm start
(`warm_start.py`): per-job constants (`PlanContext`), the bounded-wait penalty, the fair-share term Z
(the worst tenant's mean slowdown, in thousandths) and a schedule's total.

Objective (minimised, all integer):
- weighted flow time sum_i w_i * e_i: w_i = (1 + tenant priority) * (10 + task priority) set by
  operators (the task's own priority is clamped to an operator ceiling before it gets here), times
  ``guarantee_boost`` when the task fits in its tenant's unused guaranteed share;
- fair share: F * Z with Z >= each tenant's mean slowdown (arrival to end over duration, in
  thousandths) over its queued and running tasks (planned) and its FAIR_HISTORY latest finished
  ones (``Instance.tenant_history``, measured), times 1 + the tenant's operator priority (a
  weighted fair share; a queued task's slowdown counts (10 + its own priority) / 10 times): the
  worst-off tenant is pulled up, and one whose past tasks waited long gets its next ones sooner
  (the ratio of worst to best tenant drops);
- bounded waiting, counted from arrival, per task and soft: a wait past half the bound costs
  ``urgent`` per unit, past the whole bound ``late`` per unit (far more than any reordering
  gains), so the penalty grows with the wait; a bound is never dropped for the plan. Both start
  ``wait_margin`` (10%) of the bound early, so a task planned near its bound still starts within
  it when running tasks outlast their estimates;
- optionally (``tail`` T > 0, operators' scheduler_tail) T * total weight * the longest planned
  flow time (arrival to end) of a queued task: old long tasks start sooner (p99 completion)
  at some cost in mean completion; off by default (bench/results/scheduler_sim_cpu.md);
- the makespan with coefficient 1 (a tie-break).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from service.scheduler.packing import Placed


@dataclass
class PlanContext:
    """Per-job constants of the objective, keyed by UJob.index."""

    age: dict[int, int]  # units since arrival (>= 0)
    norm: dict[int, int]  # smallest duration (units), slowdown denominator
    deadline: dict[int, int | None]  # soft deadline on the start (units from now)
    half: dict[int, int]  # half the bound plus the margin (units before the deadline)
    urgent: int
    late: int
    fair: int
    tenants: dict[str, list[int]]  # tenant -> job indices (queued)
    fixed: dict[str, tuple[int, int]]  # tenant -> (sum of running tasks' q*flow, count)
    tail: int = 0  # coefficient of the longest flow time (arrival to end) of a queued task
    share: dict[str, int] = field(default_factory=dict)  # tenant -> 1 + its operator priority
    margin: dict[int, int] = field(default_factory=dict)  # wait_margin of the bound (units)
    rank: dict[int, int] = field(default_factory=dict)  # job -> 10 + its own task priority
    held: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # held_spans


def job_weight(ctx: PlanContext, i: int) -> int:
    """Thousandths of slowdown per unit of a queued task's flow time; its own priority p (within
    its tenant's ceiling) makes its slowdown count (10 + p) / 10 times in its tenant's mean."""
    return max(1, round(100 * ctx.rank.get(i, 10) / ctx.norm[i]))


def wait_steps(ctx: PlanContext, i: int) -> list[tuple[int, int]]:
    """(start after which, cost per unit) of the bounded-wait penalty: urgent from half the bound
    (less the margin), a tenth of late within the margin, late past the bound itself."""
    d = ctx.deadline[i]
    assert d is not None
    steps = [(d - ctx.half[i], ctx.urgent), (d, ctx.late)]
    if ctx.margin.get(i):
        steps.append((d - ctx.margin[i], ctx.late // 10))
    return steps


def wait_cost(steps: Sequence[tuple[int, int]], start: int) -> int:
    """The bounded-wait penalty of a start: sum of cost * max(0, start - slack) over its steps."""
    return sum(coef * max(0, start - slack) for slack, coef in steps)


def fair_z(sched: Sequence[Placed], ctx: PlanContext) -> int:
    """The fair-share term's Z of a schedule: the largest weighted mean slowdown of a tenant."""
    sums = {t: ctx.fixed.get(t, (0, 0))[0] for t in set(ctx.tenants) | set(ctx.fixed)}
    for p in sched:
        sums[p.job.tenant] += job_weight(ctx, p.job.index) * (p.end + ctx.age[p.job.index])
    z = 0
    for t, s in sums.items():
        n = len(ctx.tenants.get(t, ())) + ctx.fixed.get(t, (0, 0))[1]
        z = max(z, -(-(ctx.share.get(t, 1) * s) // n)) if n else z
    return z


def objective(sched: Sequence[Placed], ctx: PlanContext) -> int:
    """The objective of a schedule of the queued jobs (same terms as the CP-SAT model)."""
    total = 0
    for p in sched:
        i = p.job.index
        total += p.job.weight * p.end
        if ctx.deadline[i] is not None:
            total += wait_cost(wait_steps(ctx, i), p.start)
    z = fair_z(sched, ctx)
    longest = max((p.end + ctx.age[p.job.index] for p in sched), default=0)
    return total + ctx.fair * z + ctx.tail * longest + max((p.end for p in sched), default=0)
