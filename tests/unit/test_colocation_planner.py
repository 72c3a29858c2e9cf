"""Co-location in the plan (service.scheduler.colocation), on small instances with a known answer:
who joins a warm shared executor and who does not, the tenant shares, the bounded-waiting guard,
and the instance the planner then solves (a shared executor's GPUs counted once)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from service.scheduler.colocation import (
    SHARED_TENANT,
    JoinCandidate,
    LivePlacement,
    NodeReports,
    WarmExecutor,
    colocate_instance,
    demand,
    fresh_executors,
    plan_joins,
    prefer_warm,
    task_shares,
    tenant_usage,
    usable_executors,
)
from service.scheduler.planner import SolveOptions, solve
from service.scheduler.problem import Assignment, Instance, NodeSpec, Pinned, Plan, TaskSpec

K = "tiny|sft|128|*"  # a colocation_key
OTHER = "tiny|sft|256|*"
NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def ex(node: str = "n0", gpus: tuple[int, ...] = (0,), key: str = K, hosted: tuple[str, ...] = (
        "pl_a",), free: int = 8, total: int = 16, hold: int = 3600) -> WarmExecutor:
    return WarmExecutor(node, "H100", key, gpus, hosted, free, total, 0,
                        hold if hosted else 0)


def queued(tid: str, tenant: str = "t1", gpus: int = 1, duration: int = 1800, **kw) -> TaskSpec:
    return TaskSpec(tid, tenant, gpus, duration, arrival_s=kw.pop("arrival_s", 0), **kw)


def running(tid: str, tenant: str = "t1", node: str = "n0", gpus: tuple[int, ...] = (0,),
            duration: int = 3600) -> TaskSpec:
    return TaskSpec(tid, tenant, len(gpus), duration, state="running",
                    pinned=Pinned(node, gpus, -600), arrival_s=-600)


def live(pid: str, task: str, tenant: str = "t1", gpus: tuple[int, ...] = (0,), rows: int = 8,
         key: str = K, node: str = "n0") -> LivePlacement:
    return LivePlacement(pid, task, tenant, key, node, gpus, rows)


def inst(tasks: list[TaskSpec], gpus: int = 1, nodes: int = 1, **kw) -> Instance:
    return Instance([NodeSpec(f"n{i}", "H100", gpus) for i in range(nodes)], tasks, **kw)


def cand(tid: str, key: str = K, low: int = 4, rows: int = 8) -> JoinCandidate:
    return JoinCandidate(tid, key, low, rows)


BUSY = [live("pl_a", "a")]


def joined(joins) -> dict[str, str]:  # noqa: ANN001
    return {j.task_id: j.executor.ref for j in joins}


def test_same_key_joins_a_busy_executor_and_takes_its_rows() -> None:
    i = inst([running("a"), queued("b")])
    e = ex()
    joins = plan_joins(i, [e], {"b": cand("b", rows=6)}, BUSY)
    assert joined(joins) == {"b": "n0:0"}
    assert joins[0].rows == 6 and e.free_rows == 2
    assert abs(joins[0].share - 6 / 14) < 1e-9  # 1 GPU x its rows / (hosted 8 + its 6)


def test_who_does_not_join() -> None:
    i = inst([running("a"), queued("b", gpus=2), queued("c"), queued("d")], gpus=2)
    cases = {"b": cand("b"),  # adapter-parallel: two GPUs
             "c": cand("c", key=OTHER),  # another base model / max_seq_len
             "d": cand("d", low=9, rows=9)}  # its smallest job does not fit in 8 free rows
    assert plan_joins(i, [ex()], cases, BUSY) == []
    # an executor on two GPUs (adapter parallel) hosts no other task
    two = ex(gpus=(0, 1))
    assert plan_joins(i, [two], {"c": cand("c")}, [live("pl_a", "a", gpus=(0, 1))]) == []


def test_rows_run_out_in_priority_order() -> None:
    i = inst([running("a"), queued("low", tenant="t2", arrival_s=-900),
              queued("high", tenant="t3", tenant_priority=5)])
    c = {"low": cand("low", rows=8), "high": cand("high", rows=8)}
    assert joined(plan_joins(i, [ex()], c, BUSY)) == {"high": "n0:0"}
    # equal weights: the older arrival first
    i = inst([running("a"), queued("new", arrival_s=-10), queued("old", arrival_s=-900)])
    c = {"new": cand("new"), "old": cand("old")}
    assert joined(plan_joins(i, [ex()], c, BUSY)) == {"old": "n0:0"}


def test_a_tenant_under_its_guarantee_joins_first() -> None:
    i = inst([running("a"), queued("rich", tenant="t2", tenant_priority=9),
              queued("owed", tenant="t3")], tenant_guaranteed_gpus={"t3": 1})
    c = {"rich": cand("rich"), "owed": cand("owed")}
    assert joined(plan_joins(i, [ex()], c, BUSY)) == {"owed": "n0:0"}


def test_the_hard_cap_counts_co_located_shares() -> None:
    # t2 already uses one whole GPU on n1 and 0.5 of n0's executor; its cap is 1.5
    hosted = [live("pl_a", "a", rows=8), live("pl_x", "x", tenant="t2", rows=8),
              live("pl_y", "y", tenant="t2", gpus=(0,), node="n1", rows=4)]
    usage = tenant_usage(hosted)
    assert usage == {"t1": 0.5, "t2": 1.5}
    i = inst([running("a"), running("x", tenant="t2"),
              running("y", tenant="t2", node="n1"), queued("b", tenant="t2")], nodes=2,
             tenant_max_gpus={"t2": 2})
    e = ex(hosted=("pl_a", "pl_x"), free=8, total=24)
    got = plan_joins(i, [e], {"b": cand("b", rows=8)}, hosted)
    assert joined(got) == {"b": "n0:0"}  # 1.5 + 1 x 8/24 <= 2
    e = ex(hosted=("pl_a", "pl_x"), free=8, total=24)
    i = inst(list(i.tasks), nodes=2, tenant_max_gpus={"t2": 1})  # 1.5 already over 1
    assert plan_joins(i, [e], {"b": cand("b", rows=8)}, hosted) == []


def test_a_join_does_not_outlast_the_executor_while_an_urgent_task_waits_for_gpus() -> None:
    # "w" (another key, 1 GPU) has waited 3 h of its 4 h bound; no GPU is free anywhere
    waiter = queued("w", arrival_s=-3 * 3600, max_start_s=3600)
    long, short = queued("long", duration=7200), queued("short", duration=600)
    i = inst([running("a"), waiter, long, short])
    c = {"long": cand("long"), "short": cand("short"), "w": cand("w", key=OTHER)}
    got = plan_joins(i, [ex(hold=3600)], c, BUSY)
    assert joined(got) == {"short": "n0:0"}  # ends before the executor would anyway
    # when the plan starts the waiter now on a free GPU, both join
    e = ex(hold=3600, free=16)
    assert set(joined(plan_joins(i, [e], c, BUSY, starting={"w": 1}))) == {"long", "short"}


def test_tasks_the_plan_starts_now_do_not_join() -> None:
    i = inst([running("a"), queued("b"), queued("c")], gpus=2)
    c = {"b": cand("b"), "c": cand("c")}
    assert joined(plan_joins(i, [ex(free=16)], c, BUSY, starting={"b": 1})) == {"c": "n0:0"}


def test_an_idle_executor_is_never_joined_before_the_plan() -> None:
    i = inst([queued("same")], gpus=2)
    assert plan_joins(i, [ex(gpus=(1,), hosted=(), free=16)], {"same": cand("same")}, []) == []


def assignment(tid: str, node: str, gpus: tuple[int, ...], start: int = 0, end: int = 600,
               pinned: bool = False) -> Assignment:
    return Assignment(tid, node, gpus, start, end, pinned)


H100S = {"n0": "H100", "n1": "H100"}  # the nodes' GPU types where a test's plan has no instance


def plan_of(*xs: Assignment) -> Plan:
    return Plan({x.task_id: x for x in xs}, {}, "TEST", 0, 0, 0, 0.0)


def where(plan: Plan) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {t: (x.node_id, x.gpu_indices) for t, x in plan.assignments.items()}


def test_a_task_the_plan_starts_now_moves_onto_a_warm_gpu_of_its_key() -> None:
    keys = {"same": K, "other": OTHER, "next": OTHER}
    warm = ex(gpus=(1,), hosted=(), free=16)
    # same node: GPUs 0 and 1 are relabelled in the plan, the later task follows its GPU
    p = plan_of(assignment("same", "n0", (0,)), assignment("other", "n0", (1,)),
                assignment("next", "n0", (1,), 600, 900))
    moved = prefer_warm(p, [warm], keys, H100S)
    assert set(moved) == {"same", "other", "next"}
    assert where(p) == {"same": ("n0", (1,)), "other": ("n0", (0,)), "next": ("n0", (0,))}
    # another node: only when the warm GPU is free in the plan for the task's whole run
    p = plan_of(assignment("same", "n1", (0,)), assignment("other", "n0", (1,), 700, 900))
    prefer_warm(p, [warm], keys, H100S)
    assert where(p)["same"] == ("n0", (1,))
    p = plan_of(assignment("same", "n1", (0,)), assignment("other", "n0", (1,), 300, 900))
    assert prefer_warm(p, [warm], keys, H100S) == {}


def test_the_warm_gpu_is_not_given_against_the_plan() -> None:
    keys = {"same": K, "two": K, "other": OTHER}
    warm = ex(gpus=(1,), hosted=(), free=16)
    later = plan_of(assignment("same", "n0", (0,), start=600, end=900))  # not now
    two = plan_of(assignment("two", "n0", (0, 2)))  # adapter parallel
    held = plan_of(assignment("same", "n0", (0,)), assignment("run", "n0", (1,), -60, 600,
                                                              pinned=True))
    for p in (later, two, held):
        before = where(p)
        assert prefer_warm(p, [warm], keys, H100S) == {} and where(p) == before
    # the planner gives the only GPU to a heavier task of another key: the warm GPU goes with it
    i = inst([queued("same"), queued("other", tenant="t2", tenant_priority=9)])
    plan = solve(i, SolveOptions(unit_s=60))
    prefer_warm(plan, [ex(gpus=(0,), hosted=(), free=16)], keys, H100S)
    assert plan.assignments["other"].start_s == 0 and plan.assignments["same"].start_s > 0


def test_shared_gpus_are_one_occupant_in_the_planner() -> None:
    a, x = running("a", duration=3600), running("x", tenant="t2", duration=7200)
    waiting = queued("q", tenant="t3")
    col = colocate_instance(inst([a, x, waiting]))
    [occ] = col.occupants
    assert col.occupants[occ] == ["a", "x"]
    by_id = {t.id: t for t in col.instance.tasks}
    assert by_id[occ].pinned.gpu_indices == (0,) and by_id[occ].duration_s == 7200
    # reclaim may not take it (no usage given), yet it is not being stopped: a tenant of its own
    assert by_id[occ].preemptible and by_id[occ].tenant == occ
    assert col.instance.tenant_guaranteed_gpus[occ] == 1
    assert by_id["a"].pinned.gpu_indices == () and by_id["x"].gpus_needed == 0
    plan = solve(col.instance, SolveOptions(unit_s=60))
    # the only GPU frees when the last hosted task ends: the queued task starts then
    assert plan.assignments["q"].start_s == 7200
    assert plan.assignments["q"].gpu_indices == (0,)


def test_reports_that_are_stale_or_of_a_down_node_are_not_used() -> None:
    report = [{"key": K, "gpu_indices": [0], "placement_ids": ["pl_a"], "free_rows": 8,
               "total_rows": 16}]
    fresh = NodeReports("n0", "H100", 1, True, report, NOW - timedelta(seconds=10))
    old = NodeReports("n1", "H100", 1, True, report, NOW - timedelta(seconds=31))
    down = NodeReports("n2", "H100", 1, False, report, NOW)
    bad = NodeReports("n3", "H100", 1, True, [{"key": K, "gpu_indices": [3], "free_rows": 1,
                                               "total_rows": 1}, {"nonsense": 1}], NOW)
    got = fresh_executors([old, down, bad, fresh], NOW, timeout_s=30)
    assert [(e.node_id, e.gpus, e.free_rows) for e in got] == [("n0", (0,), 8)]


def test_the_database_must_agree_with_a_report() -> None:
    e = ex(hosted=("pl_a",), free=8)
    # a published join not yet in the report takes its rows
    got = usable_executors([e], [live("pl_a", "a"), live("pl_b", "b", rows=6)], {"a": 60, "b": 90})
    assert got[0].free_rows == 2 and got[0].hold_end_s == 90
    # its GPU now runs a task of another key: not usable
    assert usable_executors([e], [live("pl_z", "z", key=OTHER)], {}) == []
    # its tasks are being stopped (pause, quota reclaim): nothing joins it
    stopping = LivePlacement("pl_a", "a", "t1", K, "n0", (0,), 8, stopping=True)
    assert usable_executors([e], [stopping], {"a": 60}) == []
    # every task it reported has ended: warm and idle, all rows free
    [idle] = usable_executors([e], [], {})
    assert idle.idle and idle.free_rows == 16 and idle.hold_end_s == 0
    # an idle report whose GPU another key took since; or a join published since (not reported)
    assert usable_executors([ex(hosted=(), free=16)], [live("pl_z", "z", key=OTHER)], {}) == []
    [busy] = usable_executors([ex(hosted=(), free=16)], [live("pl_b", "b", rows=6)], {"b": 90})
    assert busy.placement_ids == ("pl_b",) and busy.free_rows == 10 and busy.hold_end_s == 90


def test_demand_and_determinism() -> None:
    assert demand([8, 4, 16]) == (4, 28) and demand([]) == (0, 0)
    i = inst([running("a"), *[queued(f"q{k}", tenant=f"t{k % 3}") for k in range(6)]])
    c = {f"q{k}": cand(f"q{k}", rows=3) for k in range(6)}
    runs = [joined(plan_joins(i, [ex(free=8)], c, BUSY)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 2


def test_quota_reclaim_takes_a_shared_executor_only_from_borrowers() -> None:
    a, x = running("a", tenant="t1"), running("x", tenant="t2")
    owed = queued("q", tenant="t3")
    shares = {"t1": 0.5, "t2": 0.5}
    i = inst([a, x, owed], tenant_guaranteed_gpus={"t3": 1})
    col = colocate_instance(i, shares)
    [occ] = col.occupants
    assert solve(col.instance, SolveOptions(unit_s=60)).preempt == [occ]
    # t1 is within its own guarantee: its task is not paused for t3, so neither is the executor
    i = inst([a, x, owed], tenant_guaranteed_gpus={"t3": 1, "t1": 1})
    assert solve(colocate_instance(i, shares).instance, SolveOptions(unit_s=60)).preempt == []
    # without usage (no reclaim information) a shared executor is never a victim
    i = inst([a, x, owed], tenant_guaranteed_gpus={"t3": 1})
    assert solve(colocate_instance(i).instance, SolveOptions(unit_s=60)).preempt == []


def test_no_task_joins_an_executor_the_plan_reclaims() -> None:
    # n0's only GPU runs "a" (t1, no guarantee) in an executor of key K; "owed" (t3, another key)
    # is owed a GPU: quota reclaim pauses "a" and starts "owed" there now
    a, owed, b = running("a"), queued("owed", tenant="t3"), queued("b", tenant="t2")
    hosted = [live("pl_a", "a")]
    c = {"b": cand("b"), "owed": cand("owed", key=OTHER)}
    i = inst([a, owed, b], tenant_guaranteed_gpus={"t3": 1})
    col = colocate_instance(i, tenant_usage(hosted))
    plan = solve(col.instance, SolveOptions(unit_s=60))
    assert plan.preempt == ["a"] and where(plan)["owed"] == ("n0", (0,))
    starting = plan.starts_now()
    assert starting == {"owed": 1} and col.pausing(plan) == ["a"]
    # "b" would hold the GPU being freed (and keep "owed" from it for its whole run)
    assert plan_joins(i, [ex()], c, hosted, starting, col.pausing(plan)) == []
    # no guarantee owed: "a" runs on and "b" joins it
    i = inst([a, owed, b])
    plan = solve(colocate_instance(i, tenant_usage(hosted)).instance, SolveOptions(unit_s=60))
    starting = plan.starts_now()
    assert plan.preempt == [] and joined(plan_joins(i, [ex()], c, hosted, starting)) == {
        "b": "n0:0"}


def test_reclaim_counts_a_shared_executor_it_may_not_take_as_busy() -> None:
    # GPU 0: "a" (t1, within its guarantee) and "x" (t2) share an executor; GPU 1: "y" (t2).
    # t3 is owed a GPU: reclaim takes y's, not one it counts free because the executor may not
    # be taken (only a task being stopped frees its GPUs by itself)
    a, x = running("a", tenant="t1", duration=7200), running("x", tenant="t2", duration=7200)
    y = running("y", tenant="t2", gpus=(1,), duration=7200)
    hosted = [live("pl_a", "a"), live("pl_x", "x", tenant="t2"),
              live("pl_y", "y", tenant="t2", gpus=(1,))]
    i = inst([a, x, y, queued("q", tenant="t3")], gpus=2,
             tenant_guaranteed_gpus={"t3": 1, "t1": 1})
    plan = solve(colocate_instance(i, tenant_usage(hosted)).instance, SolveOptions(unit_s=60))
    assert plan.preempt == ["y"] and where(plan)["q"] == ("n0", (1,))
    assert plan.assignments["q"].start_s == 0
    # every task it hosts is being stopped: its GPU is as good as free, nothing else is paused
    stopping = [replace(t, preemptible=False) for t in (a, x)]
    i = inst([*stopping, y, queued("q", tenant="t3")], gpus=2,
             tenant_guaranteed_gpus={"t3": 1, "t1": 1})
    col = colocate_instance(i, tenant_usage(hosted))
    assert solve(col.instance, SolveOptions(unit_s=60)).preempt == []
    # one that reclaim may take is of no tenant
    i = inst([a, x, y, queued("q", tenant="t3")], gpus=2, tenant_guaranteed_gpus={"t3": 1})
    col = colocate_instance(i, tenant_usage(hosted))
    [occ] = col.occupants
    assert {t.id: t for t in col.instance.tasks}[occ].tenant == SHARED_TENANT


def test_a_task_moves_to_a_warm_gpu_of_another_node_only_of_its_gpu_type() -> None:
    # on another GPU type the task needs other GPUs and time than the plan gives it
    warm = ex(gpus=(1,), hosted=(), free=16)  # on n0 (H100)
    keys = {"same": K}
    p = plan_of(assignment("same", "n1", (0,)))
    assert prefer_warm(p, [warm], keys, {"n0": "H100", "n1": "A100"}) == {}
    assert where(p)["same"] == ("n1", (0,))
    p = plan_of(assignment("same", "n1", (0,)))
    assert set(prefer_warm(p, [warm], keys, H100S)) == {"same"}
    assert where(p)["same"] == ("n0", (1,))


def test_a_tenants_shares_of_shared_executors_count_against_its_cap() -> None:
    # n0:0 is one executor hosting "a" (t1) and "x" (t2), 8 rows each: t1 holds half a GPU for
    # the hour "a" has left; n0:1 is free. t1's queued whole-GPU task "q" would make 1.5 GPUs.
    a = running("a", tenant="t1", duration=3600)
    x = running("x", tenant="t2", duration=7200)
    q = queued("q", tenant="t1")
    hosted = [live("pl_a", "a", tenant="t1"), live("pl_x", "x", tenant="t2")]
    shares = task_shares(hosted)
    assert shares == {"a": 0.5, "x": 0.5} and tenant_usage(hosted) == {"t1": 0.5, "t2": 0.5}
    opts = SolveOptions(unit_s=60)
    for cap, start in ((1, 3600), (2, 0)):  # capped at 1: q waits for "a"; at 2 it starts now
        i = inst([a, x, q], gpus=2, tenant_max_gpus={"t1": cap})
        col = colocate_instance(i, tenant_usage(hosted), shares)
        assert col.instance.tenant_held_gpus == {"t1": [(3600.0, 0.5)], "t2": [(7200.0, 0.5)]}
        plan = solve(col.instance, opts)
        assert "q" not in plan.unschedulable and plan.assignments["q"].start_s == start, cap
    # without the shares (an equal split) the same; a tenant without a cap is not held back
    i = inst([a, x, q], gpus=2, tenant_max_gpus={"t1": 1})
    assert solve(colocate_instance(i).instance, opts).assignments["q"].start_s == 3600
    i = inst([a, x, q], gpus=2, tenant_max_gpus={"t2": 1})
    assert solve(colocate_instance(i, tenant_usage(hosted), shares).instance,
                 opts).assignments["q"].start_s == 0


def test_no_join_takes_a_tenant_over_its_cap_with_what_the_plan_starts() -> None:
    # t1 (cap 1) has "w" starting now on a whole GPU: its "b" may not also join "a"'s executor
    i = inst([running("a", tenant="t2"), queued("w"), queued("b")], tenant_max_gpus={"t1": 1})
    c = {"b": cand("b")}
    hosted = [live("pl_a", "a", tenant="t2")]
    assert plan_joins(i, [ex()], c, hosted, starting={"w": 1}) == []
    assert joined(plan_joins(i, [ex()], c, hosted)) == {"b": "n0:0"}  # nothing else of t1's
    i = replace(i, tenant_max_gpus={"t1": 2})
    assert joined(plan_joins(i, [ex()], c, hosted, starting={"w": 1})) == {"b": "n0:0"}
