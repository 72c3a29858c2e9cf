"""Co-location simulation (issue 19, CPU): one executor per task against shared executors that
tasks join, for a stream of tasks of one base model with few survivors after warmup.

Run: python bench/colocate_sim.py [--quick] [--tasks N] [--seeds K] [--loads L,..] [--half H]
     [--out FILE]   (table: bench/results/colocate_sim_cpu.md)

Model (every setting is printed with the table):
- GPUS one-GPU executors' worth of GPUs; tasks from TENANTS tenants arrive as Poisson streams; a
  task has J jobs (4, 8 or 16), each with a batch size from {2, 4, 8} and N samples to train
  (log-normal, median MEDIAN_SAMPLES); early exit: every job trains WARMUP of its samples, then the
  task keeps the best KEEP of its jobs (here: the first ones; which does not matter for time);
- an executor has ROWS sequence rows of admission budget; a job of batch size b takes b rows
  while it trains; jobs are admitted in order (task by task, job by job) as rows free up; a job
  that has finished its warmup gives its rows back until its task's ranking;
- throughput of one backbone pass with r active rows: PEAK * r / (r + HALF) samples/s (a GPU is
  saturated only at many rows: at small total batch the pass is dominated by reading the weights),
  shared by the jobs in proportion to their rows;
- one executor per task: a task waits for a free GPU (first come, first served), loads the model
  (LOAD_S) and frees the GPU when it ends;
- co-location, free GPUs first (what the service does): a queued task takes a warm idle executor
  (no load) or a free GPU (LOAD_S), first come first served; the tasks left join a busy executor
  when service.scheduler.colocation.plan_joins (the production rule: one key, free rows for its
  smallest job, tenants' guarantees and priorities, arrival order, caps, the waiting guard) says
  so, with no load; an executor with no task lingers LINGER_S warm;
- co-location, join first: the same, but plan_joins runs before free GPUs are handed out.
Load: the arrival rate makes sum(one-task-alone run time) / (GPUS x arrival span) equal LOAD.
Metrics: trained samples (warmup of exited jobs included, the same in both modes) per GPU-second
held by executors (load and linger included) and per cluster GPU-second (GPUS x span: first
arrival to last finish); mean and p99 completion (finish - arrival) and mean wait (arrival to
the start of training); mean rows per busy executor-second.
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.scheduler.colocation import (  # noqa: E402
    JoinCandidate,
    LivePlacement,
    WarmExecutor,
    demand,
    plan_joins,
)
from service.scheduler.problem import Instance, NodeSpec, Pinned, TaskSpec  # noqa: E402

GPUS = 8
TENANTS = 3
ROWS = 32
PEAK = 8.0  # samples/s of a saturated backbone pass
HALF: float = 8  # rows at which a pass reaches half of PEAK (--half)
LOAD_S = 120.0
LINGER_S = 300.0
MEDIAN_SAMPLES = 2000
WARMUP = 0.05
KEEP = 0.25
DT = 5.0
KEY = "llama-8b|sft|1024|*"
MAX_WAIT_S = 4 * 3600
MODES = {"one executor per task": "none", "co-located, join first": "join-first",
         "co-located, free GPUs first": "free-first"}


@dataclass
class SimJob:
    batch: int
    need: float
    done: float = 0.0
    state: str = "pending"  # pending | active | ranked (warmup done) | exited | done
    warm: bool = True  # still in its warmup


@dataclass
class SimTask:
    id: str
    tenant: str
    arrival: float
    jobs: list[SimJob]
    start: float | None = None
    finish: float | None = None

    def rows(self) -> int:
        return sum(j.batch for j in self.jobs if j.state in ("pending", "active", "ranked"))

    def open_jobs(self) -> list[SimJob]:
        return [j for j in self.jobs if j.state in ("pending", "active", "ranked")]


@dataclass
class Executor:
    gpu: int
    ready_at: float
    tasks: list[SimTask] = field(default_factory=list)
    idle_since: float | None = None
    held_since: float = 0.0

    def used(self) -> int:
        return sum(j.batch for t in self.tasks for j in t.jobs if j.state == "active")


def stream(seed: int, n: int, load: float) -> list[SimTask]:
    rng = random.Random(seed)
    tasks = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(1.0)
        jobs = [SimJob(rng.choice((2, 4, 8)),
                       min(20 * MEDIAN_SAMPLES, MEDIAN_SAMPLES * math.exp(rng.gauss(0, 0.6))))
                for _ in range(rng.choice((4, 8, 16)))]
        tasks.append(SimTask(f"task{i:04d}", f"tenant{rng.randrange(TENANTS)}", t, jobs))
    alone = sum(run_alone(task) for task in tasks)
    scale = alone / (GPUS * load * tasks[-1].arrival)
    for task in tasks:
        task.arrival *= scale
    return tasks


def run_alone(task: SimTask) -> float:
    """Seconds a task takes alone on one executor (model load included)."""
    copy = SimTask(task.id, task.tenant, 0.0, [SimJob(j.batch, j.need) for j in task.jobs])
    ex = Executor(0, LOAD_S, [copy])
    now = 0.0
    while copy.finish is None:
        now += DT
        step(ex, now)
    return now


def step(ex: Executor, now: float) -> float:
    """Advance one executor by DT; returns the samples trained."""
    if now < ex.ready_at or not ex.tasks:
        return 0.0
    free = ROWS - ex.used()
    for t in ex.tasks:  # admission in order, task by task
        for j in t.jobs:
            if j.state == "pending" and j.batch <= free:
                j.state, free = "active", free - j.batch
    active = [j for t in ex.tasks for j in t.jobs if j.state == "active"]
    rows = sum(j.batch for j in active)
    trained = 0.0
    for j in active:
        rate = PEAK * j.batch / (rows + HALF)
        goal = j.need * WARMUP if j.warm else j.need
        gain = min(rate * DT, goal - j.done)
        j.done += gain
        trained += gain
        if j.done >= goal - 1e-9:
            j.state = "ranked" if j.warm else "done"
    for t in list(ex.tasks):
        if t.start is None and any(j.state != "pending" for j in t.jobs):
            t.start = now - DT
        if all(j.state in ("ranked", "exited", "done") for j in t.jobs) and any(
                j.warm for j in t.jobs):
            keep = max(1, math.ceil(KEEP * len(t.jobs)))
            for k, j in enumerate(t.jobs):
                j.warm = False
                j.state = "pending" if k < keep else "exited"
        if all(j.state in ("exited", "done") for j in t.jobs) and not any(j.warm for j in t.jobs):
            t.finish = now
            ex.tasks.remove(t)
    return trained


def simulate(tasks: list[SimTask], colocate: str) -> dict[str, float]:
    tasks = [SimTask(t.id, t.tenant, t.arrival, [SimJob(j.batch, j.need) for j in t.jobs])
             for t in tasks]
    pending = sorted(tasks, key=lambda t: (t.arrival, t.id))
    queue: list[SimTask] = []
    execs: dict[int, Executor] = {}
    now, held, trained, busy_rows, busy_s = 0.0, 0.0, 0.0, 0.0, 0.0
    while pending or queue or any(e.tasks for e in execs.values()):
        while pending and pending[0].arrival <= now:
            queue.append(pending.pop(0))
        if queue:
            place(queue, execs, now, colocate)
        for e in list(execs.values()):
            held += DT
            rows = e.used() if now >= e.ready_at else 0
            trained += step(e, now + DT)
            if rows:
                busy_rows, busy_s = busy_rows + rows * DT, busy_s + DT
            if not e.tasks:
                e.idle_since = e.idle_since if e.idle_since is not None else now + DT
                if colocate == "none" or now + DT - e.idle_since >= LINGER_S:
                    del execs[e.gpu]
        now += DT
    comp = sorted(t.finish - t.arrival for t in tasks)
    span = max(t.finish for t in tasks) - min(t.arrival for t in tasks)
    return {"per_held": trained / held, "per_cluster": trained / (GPUS * span),
            "mean": statistics.mean(comp), "p99": comp[math.ceil(0.99 * len(comp)) - 1],
            "wait": statistics.mean(t.start - t.arrival for t in tasks),
            "rows": busy_rows / max(busy_s, 1.0)}


def place(queue: list[SimTask], execs: dict[int, Executor], now: float, colocate: str) -> None:
    if colocate == "join-first":
        join(queue, execs, now)
    for t in sorted(queue, key=lambda t: (t.arrival, t.id)):
        warm = sorted(g for g, e in execs.items() if not e.tasks) if colocate != "none" else []
        free = [g for g in range(GPUS) if g not in execs]
        if warm:
            e = execs[warm[0]]
            e.tasks.append(t)
            e.idle_since = None
        elif free:
            execs[free[0]] = Executor(free[0], now + LOAD_S, [t], held_since=now)
        else:
            break  # first come, first served: nothing overtakes the head of the queue
        queue.remove(t)
    if colocate == "free-first" and queue:
        join(queue, execs, now)


def join(queue: list[SimTask], execs: dict[int, Executor], now: float) -> None:
    """The production join rule on the simulated state."""
    node = NodeSpec("n0", "H100", GPUS)
    running = [t for e in execs.values() for t in e.tasks]
    remaining = {t.id: int(sum(j.need - j.done for j in t.open_jobs()) / PEAK) + 60
                 for t in running + queue}
    gpu_of = {t.id: e.gpu for e in execs.values() for t in e.tasks}
    specs = [TaskSpec(t.id, t.tenant, 1, remaining[t.id], state="running",
                      pinned=Pinned("n0", (gpu_of[t.id],), 0)) for t in running]
    specs += [TaskSpec(t.id, t.tenant, 1, remaining[t.id], arrival_s=int(t.arrival - now),
                       max_start_s=int(t.arrival - now) + MAX_WAIT_S) for t in queue]
    inst = Instance([node], specs)
    live = [LivePlacement(f"pl_{t.id}", t.id, t.tenant, KEY, "n0", (e.gpu,), max(1, t.rows()))
            for e in execs.values() for t in e.tasks]
    reports = [WarmExecutor("n0", "H100", KEY, (e.gpu,), tuple(f"pl_{t.id}" for t in e.tasks),
                            max(0, ROWS - sum(t.rows() for t in e.tasks)), ROWS, 0,
                            max(remaining[t.id] for t in e.tasks))
               for e in sorted(execs.values(), key=lambda e: e.gpu) if e.tasks]
    cands = {}
    for t in queue:
        low, total = demand(j.batch for j in t.open_jobs())
        cands[t.id] = JoinCandidate(t.id, KEY, low, total)
    by_id = {t.id: t for t in queue}
    for j in plan_joins(inst, reports, cands, live):
        execs[j.executor.gpus[0]].tasks.append(by_id[j.task_id])
        queue.remove(by_id[j.task_id])


def main() -> None:
    global HALF
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tasks", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=0)
    ap.add_argument("--loads", default="0.7,1.0,1.5,2.0")
    ap.add_argument("--half", type=float, default=HALF,
                    help="rows at which a pass reaches half its peak (measured H100, Llama-3.1-8B "
                         "shape, seq 1024: 8 rows give 95%% of 32 rows' tokens/s, i.e. ~0.4)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    HALF = a.half
    n = a.tasks or (30 if a.quick else 80)
    seeds = list(range(a.seeds or (1 if a.quick else 3)))
    loads = [float(x) for x in a.loads.split(",")]
    lines = [f"CPU simulation (bench/colocate_sim.py; python {platform.python_version()}): "
             f"{GPUS} GPUs, {TENANTS} tenants, one base model, {n} tasks per run, seeds {seeds}; "
             f"jobs 4/8/16 per task, batch 2/4/8, median {MEDIAN_SAMPLES} samples a job, "
             f"warmup {WARMUP:g}, keep {KEEP:g}; {ROWS} rows an executor, pass throughput "
             f"{PEAK:g} x r/(r+{HALF}) samples/s, load {LOAD_S:g} s, linger {LINGER_S:g} s, "
             f"step {DT:g} s. Means over seeds.", "",
             "| load | mode | samples / held GPU-s | samples / cluster GPU-s | mean compl. h | "
             "p99 compl. h | mean wait h | rows per busy executor |",
             "|---|---|---|---|---|---|---|---|"]
    ratios = []
    for load in loads:
        res: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for seed in seeds:
            tasks = stream(seed, n, load)
            for mode, how in MODES.items():
                res[mode].append(simulate(tasks, how))
        mean = {m: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for m, rs in res.items()}
        for mode, m in mean.items():
            lines.append(f"| {load:g} | {mode} | {m['per_held']:.3f} | {m['per_cluster']:.3f} | "
                         f"{m['mean'] / 3600:.2f} | {m['p99'] / 3600:.2f} | "
                         f"{m['wait'] / 3600:.2f} | {m['rows']:.1f} |")
        a_ = mean["one executor per task"]
        for mode in list(MODES)[1:]:
            b_ = mean[mode]
            ratios.append(f"| {load:g} | {mode} | {b_['per_held'] / a_['per_held']:.2f}x | "
                          f"{b_['per_cluster'] / a_['per_cluster']:.2f}x | "
                          f"{b_['mean'] / a_['mean']:.2f}x | {b_['p99'] / a_['p99']:.2f}x |")
    lines += ["", "Co-located against one executor per task (targets: >= 1.5x samples per "
              "GPU-second, p99 completion no worse, i.e. <= 1.00x):", "",
              "| load | mode | samples / held GPU-s | samples / cluster GPU-s | mean compl. | "
              "p99 compl. |", "|---|---|---|---|---|---|", *ratios]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
