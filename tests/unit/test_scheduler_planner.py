"""Properties of the CP-SAT planner over random instances (hypothesis), and on small instances
its makespan against an independent brute force (serial schedule generation over all orders)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.scheduler.planner import (
    Hint,
    Instance,
    NodeSpec,
    Pinned,
    Plan,
    SolveOptions,
    TaskSpec,
    solve,
)

FAST = SolveOptions(time_limit_s=2.0, secondary_time_limit_s=0.5, workers=2)
HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def instances(draw: st.DrawFn, max_tasks: int = 7, waiting: bool = True,
              allow_down: bool = True) -> Instance:
    n_nodes = draw(st.integers(1, 3))
    nodes = [NodeSpec(f"n{i}", draw(st.sampled_from(["H100", "A100"])), draw(st.integers(1, 4)),
                      up=draw(st.booleans()) if allow_down and i > 0 else True)
             for i in range(n_nodes)]
    tasks: list[TaskSpec] = []
    for i, node in enumerate(nodes):  # at most one running task per node, on a GPU prefix
        if node.up and draw(st.booleans()):
            g = draw(st.integers(1, node.gpu_count))
            gpus = tuple(draw(st.permutations(range(node.gpu_count)))[:g])
            tasks.append(TaskSpec(f"r{i}", draw(st.sampled_from("AB")), g, draw(st.integers(1, 5)),
                                  state="running",
                                  pinned=Pinned(node.id, gpus, -draw(st.integers(0, 3)))))
    for i in range(draw(st.integers(0, max_tasks))):
        max_start = draw(st.one_of(st.none(), st.integers(0, 8))) if waiting else None
        tasks.append(TaskSpec(
            f"t{i}", draw(st.sampled_from("AB")), draw(st.integers(1, 5)), draw(st.integers(1, 6)),
            priority=draw(st.integers(0, 3)), earliest_start_s=draw(st.integers(0, 3)),
            max_start_s=max_start))
    limits = {}
    if draw(st.booleans()):
        limits["A"] = draw(st.integers(1, 4))
    return Instance(nodes, tasks, limits)


def check_plan(inst: Instance, plan: Plan) -> None:
    nodes = {n.id: n for n in inst.nodes}
    by_id = {t.id: t for t in inst.tasks}
    assert set(plan.assignments) | set(plan.unschedulable) == set(by_id)
    assert not set(plan.assignments) & set(plan.unschedulable)
    up_sizes = [n.gpu_count for n in inst.nodes if n.up]
    for tid, reason in plan.unschedulable.items():
        t = by_id[tid]
        limit = inst.tenant_max_gpus.get(t.tenant)
        if t.pinned is None:  # only tasks that really fit nowhere are refused
            assert all(t.gpus_needed > c for c in up_sizes) or (
                limit is not None and t.gpus_needed > limit), reason
        else:
            assert not nodes[t.pinned.node_id].up
    for tid, a in plan.assignments.items():
        t = by_id[tid]
        node = nodes[a.node_id]
        assert node.up, "a down node holds nothing"
        assert len(a.gpu_indices) == t.gpus_needed == len(set(a.gpu_indices))
        assert all(0 <= g < node.gpu_count for g in a.gpu_indices)
        if t.pinned is not None:
            assert a.pinned and a.node_id == t.pinned.node_id
            assert a.gpu_indices == tuple(t.pinned.gpu_indices) and a.start_s == t.pinned.start_s
            assert a.end_s == t.duration_s
        else:
            assert a.start_s >= t.earliest_start_s and a.end_s - a.start_s == t.duration_s
            if t.max_start_s is not None and not plan.relaxed_waiting:
                assert a.start_s <= t.max_start_s
    items = list(plan.assignments.values())
    for a, b in itertools.combinations(items, 2):  # no GPU double-booked
        if a.node_id == b.node_id and set(a.gpu_indices) & set(b.gpu_indices):
            assert a.end_s <= max(b.start_s, 0) or b.end_s <= max(a.start_s, 0), (a, b)
    for tenant, limit in inst.tenant_max_gpus.items():
        mine = [a for a in items if by_id[a.task_id].tenant == tenant]
        running = sum(len(a.gpu_indices) for a in mine if a.pinned)
        for t in {max(a.start_s, 0) for a in mine}:
            used = sum(len(a.gpu_indices) for a in mine if a.start_s <= t < a.end_s)
            assert used <= max(limit, running)
    assert plan.makespan_s == max((a.end_s for a in items), default=0)


@HYP
@given(instances())
def test_plans_are_valid(inst: Instance) -> None:
    check_plan(inst, solve(inst, FAST))


def brute_force_makespan(inst: Instance) -> int:
    """Optimal makespan by serial schedule generation over every task order and node choice
    (the active schedules it yields contain an optimal one). Time-indexed, independent code."""
    horizon = 1 + sum(t.duration_s for t in inst.tasks) + 10
    up = [i for i, n in enumerate(inst.nodes) if n.up]
    queued = [t for t in inst.tasks if t.pinned is None]
    opts = [[i for i in up if t.gpus_needed <= inst.nodes[i].gpu_count] for t in queued]
    best = max([t.duration_s for t in inst.tasks if t.pinned is not None] + [0])
    run_best = None
    for order in itertools.permutations(range(len(queued))):
        for choice in itertools.product(*(opts[k] for k in order)):
            use = {i: [0] * horizon for i in up}
            ten = {k: [0] * horizon for k in inst.tenant_max_gpus}
            for t in inst.tasks:
                if t.pinned is not None:
                    ni = next(i for i, n in enumerate(inst.nodes) if n.id == t.pinned.node_id)
                    for x in range(t.duration_s):
                        use[ni][x] += t.gpus_needed
                        if t.tenant in ten:
                            ten[t.tenant][x] += t.gpus_needed
            end = best
            for k, ni in zip(order, choice, strict=True):
                t = queued[k]
                cap_n = inst.nodes[ni].gpu_count
                cap_t = inst.tenant_max_gpus.get(t.tenant)
                s = t.earliest_start_s
                while True:
                    span = range(s, s + t.duration_s)
                    if all(use[ni][x] + t.gpus_needed <= cap_n for x in span) and (
                            cap_t is None or all(ten[t.tenant][x] + t.gpus_needed <= cap_t
                                                 for x in span)):
                        break
                    s += 1
                for x in range(s, s + t.duration_s):
                    use[ni][x] += t.gpus_needed
                    if cap_t is not None:
                        ten[t.tenant][x] += t.gpus_needed
                end = max(end, s + t.duration_s)
            run_best = end if run_best is None else min(run_best, end)
    return best if run_best is None else run_best


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(max_tasks=5, waiting=False, allow_down=False))
def test_makespan_equals_brute_force(inst: Instance) -> None:
    # Keep only tasks that fit somewhere, and tenant limits no running task already exceeds.
    big = max(n.gpu_count for n in inst.nodes)
    running = {k: sum(t.gpus_needed for t in inst.tasks if t.pinned and t.tenant == k)
               for k in "AB"}
    limits = {k: v for k, v in inst.tenant_max_gpus.items() if v >= max(running[k], 1)}
    tasks = [t for t in inst.tasks if t.pinned is not None or (
        t.gpus_needed <= big and t.gpus_needed <= limits.get(t.tenant, big))]
    inst = Instance(inst.nodes, tasks, limits)
    plan = solve(inst, SolveOptions(time_limit_s=10.0, secondary_time_limit_s=0.0))
    assert plan.status in ("OPTIMAL", "EMPTY")
    assert plan.makespan_s == brute_force_makespan(inst)


def test_oversized_task_is_reported_not_fatal() -> None:
    inst = Instance([NodeSpec("n0", "H100", 8), NodeSpec("n1", "H100", 8, up=False)],
                    [TaskSpec("huge", "A", 16, 100), TaskSpec("ok", "A", 4, 50),
                     TaskSpec("capped", "B", 4, 10)], {"B": 2})
    plan = solve(inst, FAST)
    assert set(plan.unschedulable) == {"huge", "capped"}
    assert "16 GPUs" in plan.unschedulable["huge"] and "limit" in plan.unschedulable["capped"]
    assert plan.assignments["ok"].start_s == 0


def test_priority_breaks_ties_in_start_order() -> None:
    nodes = [NodeSpec("n0", "H100", 1)]
    for hi in ("a", "b"):
        tasks = [TaskSpec(x, "A", 1, 10, priority=5 if x == hi else 0) for x in ("a", "b")]
        plan = solve(Instance(nodes, tasks), FAST)
        assert plan.assignments[hi].start_s == 0 and plan.makespan_s == 20


def test_weighted_completion_orders_short_high_priority_first() -> None:
    tasks = [TaskSpec("long", "A", 2, 30), TaskSpec("short", "B", 2, 5, priority=3)]
    plan = solve(Instance([NodeSpec("n0", "H100", 2)], tasks), FAST)
    assert plan.assignments["short"].start_s == 0
    assert plan.assignments["long"].start_s == 5


def test_bounded_waiting_holds_and_relaxes_when_impossible() -> None:
    node = [NodeSpec("n0", "H100", 1)]
    old = TaskSpec("old", "A", 1, 20, max_start_s=0)
    new = TaskSpec("new", "B", 1, 2, priority=50)  # would go first on weighted completion
    plan = solve(Instance(node, [old, new]), FAST)
    assert plan.assignments["old"].start_s == 0 and not plan.relaxed_waiting
    running = TaskSpec("run", "C", 1, 15, state="running", pinned=Pinned("n0", (0,), -5))
    plan = solve(Instance(node, [running, old]), FAST)
    assert plan.relaxed_waiting and plan.assignments["old"].start_s == 15


def test_pinned_tasks_stay_put_across_replans() -> None:
    rng = random.Random(7)
    nodes = [NodeSpec(f"n{i}", "H100", 4) for i in range(3)]
    queued = [TaskSpec(f"t{i}", "AB"[i % 2], rng.choice([1, 2, 4]), rng.randint(5, 40))
              for i in range(12)]
    running: dict[str, TaskSpec] = {}
    now = 0
    for step in range(5):
        plan = solve(Instance(nodes, list(running.values()) + queued), FAST)
        check_plan(Instance(nodes, list(running.values()) + queued), plan)
        for tid, spec in running.items():
            a = plan.assignments[tid]
            assert (a.node_id, a.gpu_indices) == (spec.pinned.node_id, spec.pinned.gpu_indices)
        # Advance to the first completion; start what the plan starts by then.
        nxt = min(a.end_s for a in plan.assignments.values())
        started = {a.task_id for a in plan.assignments.values()
                   if not a.pinned and a.start_s <= nxt}
        now = nxt
        new_running = {}
        for tid, a in plan.assignments.items():
            if a.end_s <= nxt:
                continue  # finished
            if a.pinned or tid in started:
                spec = running.get(tid) or next(t for t in queued if t.id == tid)
                new_running[tid] = TaskSpec(
                    tid, spec.tenant, spec.gpus_needed, a.end_s - nxt, state="running",
                    pinned=Pinned(a.node_id, a.gpu_indices, a.start_s - nxt))
        running = new_running
        queued = [TaskSpec(t.id, t.tenant, t.gpus_needed, t.duration_s,
                           hint=Hint(plan.assignments[t.id].node_id,
                                     plan.assignments[t.id].start_s - nxt))
                  for t in queued if t.id not in started]
        queued.append(TaskSpec(f"new{step}", "A", 2, 10))
    assert now > 0


def test_previous_plan_hint_keeps_an_optimal_plan_stable() -> None:
    nodes = [NodeSpec("n0", "H100", 2), NodeSpec("n1", "H100", 2)]
    tasks = [TaskSpec(f"t{i}", "A", 1 + i % 2, 10 + 3 * i) for i in range(6)]
    first = solve(Instance(nodes, tasks), FAST)
    hinted = [TaskSpec(t.id, t.tenant, t.gpus_needed, t.duration_s,
                       hint=Hint(first.assignments[t.id].node_id, first.assignments[t.id].start_s,
                                 first.assignments[t.id].gpu_indices)) for t in tasks]
    second = solve(Instance(nodes, hinted), FAST)
    assert second.makespan_s == first.makespan_s
    moved = [t for t in second.assignments
             if second.assignments[t] != first.assignments[t]]
    assert len(moved) <= len(tasks) // 2, moved


@pytest.mark.parametrize("unit", [1, 60])
def test_time_unit_rounds_durations_up(unit: int) -> None:
    tasks = [TaskSpec("a", "A", 1, 61), TaskSpec("b", "A", 1, 30, earliest_start_s=1)]
    plan = solve(Instance([NodeSpec("n0", "H100", 1)], tasks),
                 SolveOptions(unit_s=unit, time_limit_s=1.0))
    for a in plan.assignments.values():
        assert a.start_s % unit == 0 and a.end_s % unit == 0
        assert a.end_s - a.start_s >= {"a": 61, "b": 30}[a.task_id]
