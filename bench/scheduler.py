"""Inter-task scheduler benchmark (CPU, 2 CP-SAT workers): solve time and optimality gap on random
instances, and a discrete-event replay of a Poisson task stream against greedy packing baselines.

Run: python3 bench/scheduler.py [--quick] [--out bench/results/scheduler_cpu.md]
Prints one markdown table. Static rows: median over seeds of CP-SAT phase-1 wall time (model
build + makespan solve), the makespan gap to CP-SAT's proven lower bound, and the makespan
relative to the list-scheduling plan (best of longest/largest-area/widest first) that hints
it. Simulation rows: mean over seeds of makespan (last finish - first arrival) and mean
completion time (finish - arrival), each plan checked for double-booked GPUs as it runs.
"""

from __future__ import annotations

import argparse
import heapq
import math
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.scheduler.estimator import (  # noqa: E402
    Estimator,
    JobProgress,
    ModelShape,
    TaskWork,
    gpu_spec,
)
from service.scheduler.planner import (  # noqa: E402
    Hint,
    Instance,
    NodeSpec,
    Pinned,
    SolveOptions,
    TaskSpec,
    heuristic_makespan,
    solve,
)

MODELS = {"8B": (8e9, 0.5), "32B": (32e9, 0.3), "70B": (70e9, 0.2)}  # params, share of tasks
ESTIMATOR = Estimator({k: ModelShape.guess(int(p)) for k, (p, _) in MODELS.items()})
H100 = gpu_spec("H100")


def draw_task(rng: random.Random) -> tuple[str, int, int]:
    """(model, gpus, estimated seconds) of a task: 8 jobs, 2k-40k samples (log-uniform)."""
    model = rng.choices(list(MODELS), [w for _, w in MODELS.values()])[0]
    samples = int(math.exp(rng.uniform(math.log(2000), math.log(40000))))
    jobs = [JobProgress(rng.choice([4, 8])) for _ in range(8)]
    work = TaskWork(model, samples, 1, 512, 2048, jobs)
    g, d = ESTIMATOR.estimate(work, "H100", H100)
    return model, g, d


def static_instance(kind: str, n_tasks: int, n_nodes: int, seed: int) -> Instance:
    rng = random.Random(seed)
    nodes = [NodeSpec(f"n{i}", "H100", 8) for i in range(n_nodes)]
    tasks = []
    for i in range(n_tasks):
        if kind == "uniform":  # load-bound: durations of one order of magnitude
            g, d = rng.choices([1, 2, 4], [0.4, 0.35, 0.25])[0], rng.randint(50, 150) * 60
        else:  # the estimator's durations for the 8B/32B/70B mix (heavy-tailed)
            _, g, d = draw_task(rng)
        tasks.append(TaskSpec(f"t{i}", f"tenant{rng.randrange(4)}", g, d,
                              priority=rng.randrange(3)))
    return Instance(nodes, tasks)


def bench_static(seeds: list[int], rows: list[list[str]]) -> None:
    for n_tasks, n_nodes, limit in ((11, 1, 1.0), (50, 8, 1.0), (200, 32, 4.0)):
        for kind in ("uniform", "estimator"):
            times, gaps, rel, statuses = [], [], [], []
            for seed in seeds:
                inst = static_instance(kind, n_tasks, n_nodes, seed)
                plan = solve(inst, SolveOptions(unit_s=60, time_limit_s=limit,
                                                secondary_time_limit_s=0.0))
                assert not plan.unschedulable
                times.append(plan.makespan_time_s)
                gaps.append(plan.gap)
                rel.append(plan.makespan_s / heuristic_makespan(inst, 60))
                statuses.append(plan.status)
            opt = sum(s == "OPTIMAL" for s in statuses)
            rows.append([f"static {n_tasks} tasks / {8 * n_nodes} GPUs ({n_nodes} nodes)",
                         f"CP-SAT {kind} durations, limit {limit:g} s",
                         f"{statistics.median(times):.2f}", f"{statistics.median(gaps):.1%}",
                         f"max {max(gaps):.1%}", f"{opt}/{len(seeds)} optimal",
                         f"{statistics.median(rel):.3f}x list sched.", ""])


# ---------------------------------------------------------------- discrete-event simulation
@dataclass
class SimTask:
    id: str
    tenant: str
    gpus: int
    est_s: int
    actual_s: int
    arrival: float
    start: float | None = None
    finish: float | None = None
    node: str | None = None
    gpu_indices: tuple[int, ...] = ()


def stream(seed: int, n_tasks: int, gpus_total: int, load: float) -> list[SimTask]:
    """Poisson arrivals at `load` times the cluster's capacity (by actual GPU-seconds)."""
    rng = random.Random(seed)
    drawn = []
    for i in range(n_tasks):
        _, g, d = draw_task(rng)
        actual = max(1, int(d * rng.uniform(0.4, 1.0)))  # early exit shortens every task
        drawn.append((i, g, d, actual))
    mean_work = statistics.mean(g * a for _, g, _, a in drawn)
    rate = load * gpus_total / mean_work
    t, out = 0.0, []
    for i, g, d, a in drawn:
        t += rng.expovariate(rate)
        out.append(SimTask(f"t{i}", f"tenant{i % 4}", g, d, a, t))
    return out


class Cluster:
    def __init__(self, nodes: list[NodeSpec]) -> None:
        self.nodes = nodes
        self.busy: dict[str, dict[int, str]] = {n.id: {} for n in nodes}

    def free(self, node: str) -> list[int]:
        count = next(n.gpu_count for n in self.nodes if n.id == node)
        return [g for g in range(count) if g not in self.busy[node]]

    def take(self, task: SimTask, node: str, gpus: tuple[int, ...]) -> None:
        clash = [g for g in gpus if g in self.busy[node]]
        assert not clash, f"GPU double-booked: {node} {clash}"
        for g in gpus:
            self.busy[node][g] = task.id
        task.node, task.gpu_indices = node, gpus

    def release(self, task: SimTask) -> None:
        for g in task.gpu_indices:
            del self.busy[task.node][g]


def greedy_policy(order: str):
    keys = {"FIFO": lambda t: (t.arrival,), "shortest-first": lambda t: (t.est_s, t.arrival),
            "largest-first": lambda t: (-t.gpus, -t.est_s, t.arrival)}

    def decide(now: float, queue: list[SimTask], running: list[SimTask], cluster: Cluster):
        starts = []
        for task in sorted(queue, key=keys[order]):
            fits = [(len(cluster.free(n.id)) - task.gpus, n.id) for n in cluster.nodes
                    if len(cluster.free(n.id)) >= task.gpus]
            if fits:  # best fit: the node left fullest
                _, node = min(fits)
                gpus = tuple(cluster.free(node)[:task.gpus])
                cluster.take(task, node, gpus)
                starts.append(task)
        return starts, None
    return decide


def makespan_lower_bound(tasks: list[SimTask], gpus_total: int) -> float:
    """Clairvoyant bound on any policy's makespan (actual durations, preemption and splitting
    across nodes allowed): max over arrivals a of a + (GPU-seconds arriving at or after a) / C,
    and max of arrival + actual duration."""
    first = min(t.arrival for t in tasks)
    tail = max(t.arrival + t.actual_s for t in tasks)
    work = 0.0
    for t in sorted(tasks, key=lambda t: -t.arrival):
        work += t.gpus * t.actual_s
        tail = max(tail, t.arrival + work / gpus_total)
    return tail - first


def cpsat_policy(unit_s: int, limit: float, secondary: bool = True):
    state: dict[str, tuple[str, float, tuple[int, ...]]] = {}  # previous plan: node, abs start

    def decide(now: float, queue: list[SimTask], running: list[SimTask], cluster: Cluster):
        specs = []
        for t in running:
            remaining = max(1, int(math.ceil(t.start + t.est_s - now)))
            specs.append(TaskSpec(t.id, t.tenant, t.gpus, remaining, state="running",
                                  pinned=Pinned(t.node, t.gpu_indices,
                                                int(math.floor(t.start - now)))))
        for t in queue:
            hint = None
            if t.id in state:
                node, start, gpus = state[t.id]
                hint = Hint(node, max(0, int(start - now)), gpus)
            specs.append(TaskSpec(t.id, t.tenant, t.gpus, t.est_s, hint=hint))
        plan = solve(Instance(cluster.nodes, specs),
                     SolveOptions(unit_s=unit_s, time_limit_s=limit,
                                  secondary_time_limit_s=limit / 2 if secondary else 0.0))
        assert not plan.unschedulable, plan.unschedulable
        starts, wake = [], None
        for t in queue:
            a = plan.assignments[t.id]
            state[t.id] = (a.node_id, now + a.start_s, a.gpu_indices)
            if a.start_s == 0:
                cluster.take(t, a.node_id, a.gpu_indices)
                starts.append(t)
            else:
                wake = now + a.start_s if wake is None else min(wake, now + a.start_s)
        return starts, wake
    return decide


def simulate(tasks: list[SimTask], nodes: list[NodeSpec], decide) -> tuple[float, float]:
    tasks = [SimTask(**{**t.__dict__}) for t in tasks]
    cluster = Cluster(nodes)
    events: list[tuple[float, int, str, str]] = []  # (time, order, kind, task id)
    for t in tasks:
        heapq.heappush(events, (t.arrival, 1, "arrive", t.id))
    by_id = {t.id: t for t in tasks}
    queue: list[SimTask] = []
    running: list[SimTask] = []
    woken: set[float] = set()
    while events:
        now, _, kind, tid = heapq.heappop(events)
        if kind == "arrive":
            queue.append(by_id[tid])
        elif kind == "finish":
            task = by_id[tid]
            task.finish = now
            running.remove(task)
            cluster.release(task)
        while events and events[0][0] <= now:  # handle simultaneous events in one replan
            _, _, k2, t2 = heapq.heappop(events)
            if k2 == "arrive":
                queue.append(by_id[t2])
            elif k2 == "finish":
                by_id[t2].finish = now
                running.remove(by_id[t2])
                cluster.release(by_id[t2])
        if not queue:
            continue
        starts, wake = decide(now, queue, running, cluster)
        for task in starts:
            task.start = now
            queue.remove(task)
            running.append(task)
            heapq.heappush(events, (now + task.actual_s, 0, "finish", task.id))
        if wake is not None and wake > now and wake not in woken:
            woken.add(wake)
            heapq.heappush(events, (wake, 2, "wake", ""))
    assert all(t.finish is not None for t in tasks), "a task never ran"
    first = min(t.arrival for t in tasks)
    makespan = max(t.finish for t in tasks) - first
    mean_completion = statistics.mean(t.finish - t.arrival for t in tasks)
    return makespan, mean_completion


def bench_simulation(seeds: list[int], n_tasks: int, rows: list[list[str]]) -> None:
    nodes = [NodeSpec(f"n{i}", "H100", 8) for i in range(4)]
    policies = {"FIFO": greedy_policy("FIFO"),
                "shortest-first": greedy_policy("shortest-first"),
                "largest-first": greedy_policy("largest-first"),
                "CP-SAT replan": cpsat_policy(60, 0.5),
                "CP-SAT replan, makespan only (no secondary term)": cpsat_policy(60, 0.5, False)}
    results: dict[str, list[tuple[float, float]]] = {p: [] for p in policies}
    replan_times: list[float] = []
    bounds = []
    for seed in seeds:
        tasks = stream(seed, n_tasks, 32, load=2.0)
        bounds.append(makespan_lower_bound(tasks, 32))
        for name, policy in policies.items():
            t0 = time.perf_counter()
            results[name].append(simulate(tasks, nodes, policy))
            if name == "CP-SAT replan":
                replan_times.append(time.perf_counter() - t0)
    mk = {p: statistics.mean(r[0] for r in v) for p, v in results.items()}
    ct = {p: statistics.mean(r[1] for r in v) for p, v in results.items()}
    best_mk = min(mk[p] for p in policies if not p.startswith("CP-SAT"))
    best_ct = min(ct[p] for p in policies if not p.startswith("CP-SAT"))
    for p in policies:
        per_seed = " ".join(f"{r[0] / 3600:.2f}" for r in results[p])
        rows.append([f"simulation {n_tasks} tasks x {len(seeds)} seeds, 32 GPUs (4 nodes)", p,
                     "", "", f"makespan {mk[p] / 3600:.2f} h ({per_seed})",
                     f"mean completion {ct[p] / 3600:.2f} h",
                     f"makespan {mk[p] / best_mk:.3f}x best baseline",
                     f"completion {ct[p] / best_ct:.3f}x best baseline"])
    lb = statistics.mean(bounds)
    rows.append([f"simulation {n_tasks} tasks x {len(seeds)} seeds, 32 GPUs (4 nodes)",
                 "clairvoyant lower bound (preemptive, actual durations)", "", "",
                 f"makespan {lb / 3600:.2f} h ("
                 + " ".join(f"{b / 3600:.2f}" for b in bounds) + ")", "",
                 f"makespan {lb / best_mk:.3f}x best baseline", ""])
    rows.append(["simulation", "CP-SAT wall time per seed (all replans, with secondary)", "",
                 "", "", "", f"{statistics.median(replan_times):.0f} s", ""])


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer seeds and tasks")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    seeds = [0, 1] if args.quick else [0, 1, 2, 3, 4]
    rows: list[list[str]] = []
    bench_static(seeds, rows)
    bench_simulation(seeds[:2] if args.quick else seeds[:3], 30 if args.quick else 60, rows)
    head = ["case", "method", "solve s (median)", "gap (median)", "gap/makespan", "status",
            "vs reference", "completion"]
    lines = [f"device: CPU {_cpu_name()}, "
             f"2 CP-SAT workers, python {platform.python_version()}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
