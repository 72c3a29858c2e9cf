"""Online scheduling simulation: the production planner against honest queue-policy baselines.

Run: python bench/scheduler_sim.py [--quick] [--tasks N] [--seeds K] [--jobs 2] [--out FILE]

Cluster: 4 nodes x 8 GPUs. Four tenants submit tasks as independent Poisson streams; each tenant
has its own mix (tenant0 mostly 1-GPU short tasks ... tenant3 mostly 4-8 GPU long ones); GPU
counts 1/2/4/8, durations Pareto (alpha 1.5, capped at 12 h): heavy-tailed in both. The arrival
rate makes the offered load (GPU-seconds arriving per second / 32) 0.9, 1.3 or 2.0 while tasks
arrive; the run goes on until the last task ends. Every policy sees only estimates: exact,
actual x U(0.7, 1.3) ("30%") or actual x 2^U(-1, 1) ("2x"); a running task's remaining estimate
is its estimate minus its elapsed time (at least one minute).

Policies (all place a task on the fullest node where it fits, all decide on every arrival and
finish): strict FIFO (stops at the first task that does not fit), FIFO with skipping, EASY
backfilling (the first waiting task gets a reservation from the running tasks' estimated ends;
later ones start only if they do not delay it), shortest-first and largest-first (by estimate,
with skipping), and the production planner (service.scheduler.planner.solve) with the production
settings of service/core/config.py, replanned on every event, its previous plan as hints. A replan
is skipped when no waiting task fits anywhere now (the plan could start nothing).
Metrics (per run, then the mean over seeds; "longest wait" is the max over seeds): mean and p99
completion time (finish - arrival), mean wait (first start - arrival), utilisation (busy
GPU-seconds / (32 x (last finish - first arrival))), tenant fairness (worst / best tenant mean
slowdown, slowdown = completion / actual duration), the worst tenant's mean slowdown (lower is
better for every tenant, where the ratio also drops when the best-off tenant does worse), longest
wait of any task.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import multiprocessing
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.core.config import Settings  # noqa: E402
from service.scheduler.encode import FAIR_SCALE  # noqa: E402
from service.scheduler.loop import solve_options  # noqa: E402
from service.scheduler.planner import FAIR_HISTORY, SolveOptions, solve, tenant_history  # noqa: E402
from service.scheduler.problem import Hint, Instance, NodeSpec, Pinned, TaskSpec  # noqa: E402

NODES = [NodeSpec(f"n{i}", "H100", 8) for i in range(4)]
GPUS = sum(n.gpu_count for n in NODES)
TENANTS = 4
# Per tenant: GPU-count weights for 1/2/4/8 GPUs and the Pareto scale of durations (minutes).
MIX = [((0.7, 0.2, 0.1, 0.0), 8), ((0.45, 0.3, 0.2, 0.05), 12),
       ((0.3, 0.3, 0.25, 0.15), 15), ((0.15, 0.25, 0.35, 0.25), 20)]
ERRORS = {"exact": None, "30%": "uniform", "2x": "log2"}
LOADS = (0.9, 1.3, 2.0)
RESTART_S = 60  # a preempted task loses this much (checkpoint at a step boundary, then reload)


@dataclass
class SimTask:
    id: str
    tenant: str
    gpus: int
    actual_s: float
    est_s: float
    arrival: float
    start: float | None = None  # first start
    last_start: float | None = None
    done_s: float = 0.0  # work done by earlier (preempted) runs
    finish: float | None = None
    node: str | None = None
    gpu_indices: tuple[int, ...] = ()
    preemptions: int = 0

    def remaining_actual(self) -> float:
        return self.actual_s - self.done_s

    def remaining_est(self, now: float) -> float:
        ran = self.done_s + (now - self.last_start if self.last_start is not None else 0.0)
        return max(60.0, self.est_s - ran)


def draw(rng: random.Random, tenant: int) -> tuple[int, float]:
    weights, scale_min = MIX[tenant]
    g = rng.choices((1, 2, 4, 8), weights)[0]
    d = min(12 * 3600.0, scale_min * 60 * rng.paretovariate(1.5))
    return g, d


def stream(seed: int, n_tasks: int, load: float, error: str) -> list[SimTask]:
    rng = random.Random(seed * 1000 + 7)
    # Mean GPU-seconds per task from a large fixed sample of the same mix.
    sample = random.Random(12345)
    mean_work = statistics.mean(math.prod(draw(sample, i % TENANTS)) for i in range(20000))
    rate = load * GPUS / mean_work / TENANTS  # per tenant
    clocks = [rng.expovariate(rate) for _ in range(TENANTS)]
    out = []
    for i in range(n_tasks):
        tenant = min(range(TENANTS), key=lambda k: clocks[k])
        g, d = draw(rng, tenant)
        if ERRORS[error] == "uniform":
            est = d * rng.uniform(0.7, 1.3)
        elif ERRORS[error] == "log2":
            est = d * 2 ** rng.uniform(-1, 1)
        else:
            est = d
        out.append(SimTask(f"t{i}", f"tenant{tenant}", g, d, est, clocks[tenant]))
        clocks[tenant] += rng.expovariate(rate)
    return out


class Cluster:
    def __init__(self) -> None:
        self.busy: dict[str, dict[int, str]] = {n.id: {} for n in NODES}
        self.size = {n.id: n.gpu_count for n in NODES}

    def free(self, node: str) -> list[int]:
        return [g for g in range(self.size[node]) if g not in self.busy[node]]

    def best_fit(self, gpus: int, avoid: str | None = None) -> str | None:
        fits = [(len(self.free(n)) - gpus, n != avoid and avoid is not None, n)
                for n in self.busy if len(self.free(n)) >= gpus]
        fits = [f for f in fits if avoid is None or f[2] != avoid] or fits
        return min(fits)[2] if fits else None

    def take(self, task: SimTask, node: str, gpus: tuple[int, ...] | None = None) -> None:
        gpus = gpus if gpus is not None else tuple(self.free(node)[:task.gpus])
        clash = [g for g in gpus if g in self.busy[node]]
        assert not clash and len(gpus) == task.gpus, f"GPU double-booked: {node} {clash}"
        for g in gpus:
            self.busy[node][g] = task.id
        task.node, task.gpu_indices = node, gpus

    def release(self, task: SimTask) -> None:
        for g in task.gpu_indices:
            assert self.busy[task.node].pop(g) == task.id


# ------------------------------------------------------------------------------- baselines
def queue_policy(name: str):
    keys = {"strict FIFO": lambda t: t.arrival, "FIFO+skip": lambda t: t.arrival,
            "shortest-first": lambda t: (t.est_s, t.arrival),
            "largest-first": lambda t: (-t.gpus, -t.est_s, t.arrival)}

    def decide(now, queue, running, cluster):
        starts = []
        for task in sorted(queue, key=keys[name]):
            node = cluster.best_fit(task.gpus)
            if node is None:
                if name == "strict FIFO":
                    break
                continue
            cluster.take(task, node)
            starts.append(task)
        return starts, [], None
    return decide


def easy_backfill(now, queue, running, cluster):
    starts = []
    waiting = sorted(queue, key=lambda t: t.arrival)
    while waiting:  # start from the head while it fits
        node = cluster.best_fit(waiting[0].gpus)
        if node is None:
            break
        cluster.take(waiting[0], node)
        starts.append(waiting.pop(0))
    if not waiting:
        return starts, [], None
    head = waiting[0]
    shadow, res_node, extra = math.inf, None, 0
    for n in cluster.busy:  # earliest time the head fits on a node, from estimated ends
        if cluster.size[n] < head.gpus:
            continue
        free = len(cluster.free(n))
        ends = sorted((now + t.remaining_est(now), t.gpus) for t in running + starts
                      if t.node == n)
        t_fit = now if free >= head.gpus else None
        for end, g in ends:
            if t_fit is not None:
                break
            free += g
            if free >= head.gpus:
                t_fit = end
        if t_fit is not None and t_fit < shadow:
            shadow, res_node, extra = t_fit, n, free - head.gpus
    for task in waiting[1:]:
        for n in sorted(cluster.busy, key=lambda n: (n == res_node, len(cluster.free(n)))):
            if len(cluster.free(n)) < task.gpus:
                continue
            if n == res_node and now + task.est_s > shadow:
                if task.gpus > extra:
                    continue
                extra -= task.gpus
            cluster.take(task, n)
            starts.append(task)
            break
    return starts, [], None


# ------------------------------------------------------------------------------- planner
def production_options(settings: Settings) -> tuple[SolveOptions, int]:
    """The service's own planner options (service.scheduler.loop.solve_options) and bound."""
    return solve_options(settings), settings.scheduler_max_wait_s


def planner_policy(settings: Settings, guaranteed: int | None = None):
    opts, max_wait = production_options(settings)
    hints: dict[str, tuple[str, float, tuple[int, ...]]] = {}  # node, absolute start, GPUs
    stats = {"replans": 0, "solve_s": [], "late_plans": 0, "preempted": 0}
    guar = {f"tenant{k}": guaranteed for k in range(TENANTS)} if guaranteed else {}
    seen: dict[str, SimTask] = {}  # every task the planner has been shown (its finished ones too)

    def decide(now, queue, running, cluster):
        if not guar and not any(cluster.best_fit(t.gpus) for t in queue):
            return [], [], None  # nothing can start now: the plan would start nothing
        specs = []
        seen.update((t.id, t) for t in queue)
        history = tenant_history((t.tenant, t.finish, (t.finish - t.arrival) / max(60.0, t.actual_s))
                                 for t in seen.values() if t.finish is not None)
        for t in running:
            specs.append(TaskSpec(t.id, t.tenant, t.gpus, int(math.ceil(t.remaining_est(now))),
                                  state="running", arrival_s=int(t.arrival - now),
                                  pinned=Pinned(t.node, t.gpu_indices,
                                                int(math.floor(t.last_start - now)))))
        for t in queue:
            h = hints.get(t.id)
            hint = Hint(h[0], max(0, int(h[1] - now)), h[2]) if h else None
            specs.append(TaskSpec(t.id, t.tenant, t.gpus, int(math.ceil(t.remaining_est(now))),
                                  hint=hint, arrival_s=int(t.arrival - now),
                                  max_start_s=int(t.arrival + max_wait - now)))
        plan = solve(Instance(NODES, specs, tenant_guaranteed_gpus=guar,
                              tenant_history=history), opts)
        stats["replans"] += 1
        stats["solve_s"].append(plan.solve_time_s)
        stats["late_plans"] += bool(plan.late)
        assert not plan.unschedulable, plan.unschedulable
        preempt = [t for t in running if t.id in plan.preempt]
        stats["preempted"] += len(preempt)
        for t in preempt:
            cluster.release(t)
        starts, wake = [], None
        for t in queue + preempt:
            a = plan.assignments[t.id]
            hints[t.id] = (a.node_id, now + a.start_s, a.gpu_indices)
            if a.start_s == 0 and t not in preempt:
                cluster.take(t, a.node_id, a.gpu_indices)
                starts.append(t)
            else:
                wake = now + a.start_s if wake is None else min(wake, now + a.start_s)
        return starts, preempt, wake

    decide.stats = stats  # type: ignore[attr-defined]
    return decide


# ------------------------------------------------------------------------------- simulation
def simulate(tasks: list[SimTask], decide) -> list[SimTask]:
    tasks = [replace(t) for t in tasks]
    by_id = {t.id: t for t in tasks}
    cluster = Cluster()
    events: list[tuple[float, int, str, str, int]] = []  # (time, order, kind, task id, epoch)
    for t in tasks:
        heapq.heappush(events, (t.arrival, 1, "arrive", t.id, 0))
    epoch: dict[str, int] = {}
    queue: list[SimTask] = []
    running: list[SimTask] = []
    woken: set[float] = set()
    while events:
        now = events[0][0]
        while events and events[0][0] <= now:  # everything at this instant, then one decision
            _, _, kind, tid, ep = heapq.heappop(events)
            if kind == "arrive":
                queue.append(by_id[tid])
            elif kind == "finish" and epoch.get(tid) == ep:
                task = by_id[tid]
                task.finish = now
                running.remove(task)
                cluster.release(task)
        if not queue:
            continue
        starts, preempt, wake = decide(now, queue, running, cluster)
        for task in preempt:
            running.remove(task)
            task.done_s += max(0.0, now - task.last_start - RESTART_S)
            task.preemptions += 1
            epoch[task.id] = epoch.get(task.id, 0) + 1  # its old finish event is void
            queue.append(task)
        for task in starts:
            if task.start is None:
                task.start = now
            task.last_start = now
            queue.remove(task)
            running.append(task)
            epoch[task.id] = epoch.get(task.id, 0) + 1
            heapq.heappush(events, (now + task.remaining_actual(), 0, "finish", task.id,
                                    epoch[task.id]))
        if wake is not None and wake > now and wake not in woken:
            woken.add(wake)
            heapq.heappush(events, (wake, 2, "wake", "", 0))
    assert all(t.finish is not None for t in tasks), "a task never ran"
    return tasks


def metrics(tasks: list[SimTask]) -> dict[str, float]:
    comp = sorted(t.finish - t.arrival for t in tasks)
    waits = [t.start - t.arrival for t in tasks]
    span = max(t.finish for t in tasks) - min(t.arrival for t in tasks)
    slow: dict[str, list[float]] = {}
    for t in tasks:
        slow.setdefault(t.tenant, []).append((t.finish - t.arrival) / max(60.0, t.actual_s))
    per_tenant = [statistics.mean(v) for v in slow.values()]
    p99 = comp[min(len(comp) - 1, math.ceil(0.99 * len(comp)) - 1)]
    return {"mean": statistics.mean(comp), "p99": p99, "wait": statistics.mean(waits),
            "util": sum(t.gpus * t.actual_s for t in tasks) / (GPUS * span),
            "fair": max(per_tenant) / min(per_tenant), "worst": max(per_tenant),
            "longest": max(waits)}


POLICIES = ["strict FIFO", "FIFO+skip", "EASY backfill", "shortest-first", "largest-first",
            "planner"]


def run_case(args: tuple[str, float, str, int, int]) -> tuple[str, float, str, int, dict, dict]:
    policy, load, error, seed, n_tasks = args
    tasks = stream(seed, n_tasks, load, error)
    extra: dict = {}
    if policy == "planner":
        decide = planner_policy(Settings())
        t0 = time.perf_counter()
        done = simulate(tasks, decide)
        st = decide.stats  # type: ignore[attr-defined]
        extra = {"replans": st["replans"], "wall": time.perf_counter() - t0,
                 "max_solve": max(st["solve_s"], default=0.0),
                 "late_plans": st["late_plans"]}
    elif policy == "EASY backfill":
        done = simulate(tasks, easy_backfill)
    else:
        done = simulate(tasks, queue_policy(policy))
    return policy, load, error, seed, metrics(done), extra


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tasks", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--loads", default="")
    ap.add_argument("--errors", default="")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--resume", type=Path, help="JSON lines of finished cases: kept and added to")
    a = ap.parse_args()
    n_tasks = a.tasks or (40 if a.quick else 100)
    seeds = list(range(a.seeds or (2 if a.quick else 3)))
    loads = [float(x) for x in a.loads.split(",")] if a.loads else list(LOADS)
    errors = a.errors.split(",") if a.errors else list(ERRORS)
    cases = [(p, ld, e, s, n_tasks) for ld in loads for e in errors for s in seeds
             for p in POLICIES]
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    results = []
    if a.resume and a.resume.exists():  # cases a stopped run finished (one JSON line each)
        results = [tuple(json.loads(line)) for line in a.resume.read_text().splitlines()]
    done = {tuple(r[:4]) for r in results}
    todo = [c for c in cases if tuple(c[:4]) not in done]
    # Seed by seed (a partial run has whole seeds), the long planner runs first within a seed.
    todo.sort(key=lambda c: (c[3], c[0] != "planner"))
    log = a.resume.open("a") if a.resume else None
    with multiprocessing.Pool(a.jobs) as pool:
        for r in pool.imap_unordered(run_case, todo, chunksize=1):
            results.append(r)
            if log:
                log.write(json.dumps(r) + "\n")
                log.flush()
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()[0]
    keys = {tuple(c[:4]) for c in cases}
    results = [r for r in results if tuple(r[:4]) in keys]
    agg: dict[tuple, dict[str, list[float]]] = {}
    extras: dict[tuple, list[dict]] = {}
    for policy, load, error, _seed, m, extra in results:
        d = agg.setdefault((load, error, policy), {})
        for k, v in m.items():
            d.setdefault(k, []).append(v)
        if extra:
            extras.setdefault((load, error), []).append(extra)
    s = Settings()
    lines = [f"Machine: this 2-core x86 CPU box ({_cpu()}, shared), python "
             f"{platform.python_version()}. {n_tasks} tasks per run, seeds {seeds}, "
             f"4 nodes x 8 GPUs. Planner settings (service/core/config.py): unit "
             f"{s.scheduler_unit_s} s, work limit {s.scheduler_work_limit}, max wait "
             f"{s.scheduler_max_wait_s} s (wait margin {SolveOptions().wait_margin:g}), "
             f"fairness {s.scheduler_fairness} (scale {FAIR_SCALE}) over each tenant's "
             f"{FAIR_HISTORY} latest finished tasks. Bench wall {wall:.0f} s; 1-min load average "
             f"{load_before:.1f} at start, {load_after:.1f} at end.", "",
             "| load | error | policy | mean compl. h | p99 compl. h | mean wait h | util | "
             "fairness (worst/best) | worst tenant slowdown | longest wait h |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for load in loads:
        for error in errors:
            rows = {p: agg[(load, error, p)] for p in POLICIES}
            mean = {p: statistics.mean(r["mean"]) for p, r in rows.items()}
            p99 = {p: statistics.mean(r["p99"]) for p, r in rows.items()}
            fair = {p: statistics.mean(r["fair"]) for p, r in rows.items()}
            for p, r in rows.items():
                lines.append(
                    f"| {load} | {error} | {p} | {mean[p] / 3600:.2f} | {p99[p] / 3600:.2f} | "
                    f"{statistics.mean(r['wait']) / 3600:.2f} | "
                    f"{statistics.mean(r['util']):.2f} | {fair[p]:.2f} | "
                    f"{statistics.mean(r['worst']):.2f} | {max(r['longest']) / 3600:.2f} |")
            base = [p for p in POLICIES if p != "planner"]
            bm = min(mean[p] for p in base)
            bp = min(p99[p] for p in base)
            bf = min(fair[p] for p in base)
            worst = {p: statistics.mean(r["worst"]) for p, r in rows.items()}
            bw = min(worst[p] for p in base)
            ex = extras.get((load, error), [])
            verdicts.append(
                f"| {load} | {error} | {mean['planner'] / bm:.3f} "
                f"({'met' if mean['planner'] <= 1.02 * bm else 'NOT met'}) | "
                f"{p99['planner'] / bp:.3f} ({'met' if p99['planner'] <= bp else 'NOT met'}) | "
                f"{fair['planner'] / bf:.3f} ({'met' if fair['planner'] <= bf else 'NOT met'}) | "
                f"{worst['planner'] / bw:.3f} | "
                f"{max(max(agg[(load, error, 'planner')]['longest']) / 3600, 0):.2f} h "
                f"(bound {s.scheduler_max_wait_s / 3600:g} h) | "
                f"{sum(e['replans'] for e in ex)} / "
                f"{max((e['max_solve'] for e in ex), default=0):.2f} s | "
                f"{len(agg[(load, error, 'planner')]['mean'])} |")
    lines += ["", "Planner against the best baseline of its row (target: mean <= 1.02x, p99 and "
              "fairness best, i.e. <= 1.00x; no wait over the bound):", "",
              "| load | error | mean compl. vs best | p99 vs best | fairness vs best | "
              "worst tenant slowdown vs best | planner longest wait | replans / slowest solve | "
              "seeds |", "|---|---|---|---|---|---|---|---|---|"]
    lines += verdicts
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
