"""API load benchmark: read endpoints under many concurrent clients, with 1 and the default
number of API worker processes (``python -m service.api.serve``, the deployed entrypoint).

Run: python3 bench/api_load.py [--workers 1,default] [--clients 50] [--duration 20]
                               [--out bench/results/api_load_cpu.md]
By default it starts its own stack in a temporary directory (private PostgreSQL + Redis from
service.core.localstack, migrated), seeds one tenant with --tasks finished tasks of --jobs jobs each
(one finished placement each) and, on --curve-tasks of them, a loss curve per job (--steps train
points, a val point every --val-every steps), then for each worker count starts the service and
runs --clients closed-loop clients (each sends its next request when the last one answered) for
--duration seconds per endpoint, after a warm-up: GET /v1/tasks?limit=20 and
GET /v1/tasks/{id}/metrics (a random task with curves). --url/--api-key target a running stack
instead (one row set, its worker count as deployed).

The load generator is one asyncio process with a minimal keep-alive HTTP/1.1 client (no
per-request parsing beyond the status line and Content-Length), so it needs little CPU; the
table reports its CPU use (share of one core) and the machine's CPU use during each run, so a
reader can see whether the server or the generator was the limit. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS_YAML = """\
models:
  - name: tiny-llama
    path: /models/tiny-llama
    parameters: 1000000
    gpus: 1
    max_seq_len: 512
    family: llama
"""


# ---------------------------------------------------------------- the load generator


class HttpConn:
    """One keep-alive HTTP/1.1 connection; GET only, reads Content-Length or chunked bodies."""

    def __init__(self, host: str, port: int, headers: str) -> None:
        self.host, self.port, self.headers = host, port, headers
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> tuple[int, int]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n{self.headers}\r\n"
                          .encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        at = lower.find(b"\r\ncontent-length:")
        if at >= 0:
            end = lower.index(b"\r\n", at + 2)
            body = await self.reader.readexactly(int(lower[at + 17:end]))
            size = len(body)
        elif b"transfer-encoding: chunked" in lower:
            size = await self._chunks()
        else:
            raise RuntimeError(f"response without a length: {head[:200]!r}")
        if b"\r\nconnection: close" in lower:
            await self.close()
        return status, size

    async def _chunks(self) -> int:
        assert self.reader is not None
        size = 0
        while True:
            n = int((await self.reader.readline()).split(b";")[0], 16)
            await self.reader.readexactly(n + 2)
            size += n
            if n == 0:
                return size

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    generator_cpu: float = 0.0  # share of one core used by this process
    machine_cpu: float = 0.0  # share of all cores busy (every process on the machine)
    server_cpu_s: float = 0.0  # CPU seconds of the API processes (when known)
    postgres_cpu_s: float = 0.0  # CPU seconds of the stack's PostgreSQL (when known)
    other_cpu: float = 0.0  # cores busy with anything but the generator, API and PostgreSQL

    def row(self) -> dict[str, float]:
        lat = sorted(self.latencies)
        q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else lat * 99
        return {"rps": len(lat) / self.seconds, "p50": q[49] * 1e3, "p95": q[94] * 1e3,
                "p99": q[98] * 1e3, "max": lat[-1] * 1e3 if lat else 0.0,
                "kb": self.bytes / max(len(lat), 1) / 1024}


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(_stat(int(entry.name))[1])
            except (OSError, IndexError):
                pass
    tree, grew = {root}, True
    while grew:
        new = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= new
        grew = bool(new)
    return sorted(tree - {root})


def tree_cpu_seconds(root: int | None) -> float:
    """CPU time of a process tree (API workers under uvicorn's supervisor, PostgreSQL backends
    under the postmaster): the live processes' own time, plus what the root's children that
    exited already used (cutime, cstime), so a backend that ends mid-run still counts."""
    if root is None:
        return 0.0
    ticks = 0
    for pid in [root, *_descendants(root)]:
        try:
            fields = _stat(pid)
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
        if pid == root:
            ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


async def _client(url: str, headers: str, paths: list[str], until: float, measure_from: float,
                  out: Result, rng: random.Random) -> None:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = HttpConn(host, int(port), headers)
    try:
        while True:
            start = time.perf_counter()
            if start >= until:
                return
            try:
                status, size = await conn.get(rng.choice(paths))
            except (OSError, asyncio.IncompleteReadError, RuntimeError, ValueError):
                status, size = 0, 0
                await conn.close()
            end = time.perf_counter()
            if start >= measure_from and end <= until:
                if status == 200:
                    out.latencies.append(end - start)
                    out.bytes += size
                else:
                    out.errors += 1
    finally:
        await conn.close()


async def load(url: str, api_key: str, paths: list[str], clients: int, duration: float,
               warmup: float, watch: dict[str, int] | None = None, seed: int = 0) -> Result:
    """``clients`` closed-loop clients GET random ``paths`` for warmup + duration seconds; the
    latencies of the last ``duration`` seconds are kept; ``watch`` names the root process ids of
    the API ("server") and of PostgreSQL ("postgres"), whose trees' CPU time is counted."""
    out = Result()
    headers = f"Authorization: Bearer {api_key}\r\n"
    now = time.perf_counter()
    measure_from, until = now + warmup, now + warmup + duration
    rngs = [random.Random(seed * 1000 + i) for i in range(clients)]
    tasks = [asyncio.create_task(_client(url, headers, paths, until, measure_from, out, r))
             for r in rngs]
    await asyncio.sleep(max(0.0, measure_from - time.perf_counter()))
    watch = watch or {}
    server0, pg0 = (tree_cpu_seconds(watch.get(k)) for k in ("server", "postgres"))
    cpu0, (busy0, total0), t0 = time.process_time(), _cpu_times(), time.perf_counter()
    await asyncio.gather(*tasks)
    out.seconds = min(time.perf_counter(), until) - t0
    cpu1, (busy1, total1) = time.process_time(), _cpu_times()
    wall = max(time.perf_counter() - t0, 1e-9)
    out.server_cpu_s = tree_cpu_seconds(watch.get("server")) - server0
    out.postgres_cpu_s = tree_cpu_seconds(watch.get("postgres")) - pg0
    out.generator_cpu = (cpu1 - cpu0) / wall
    out.machine_cpu = (busy1 - busy0) / max(total1 - total0, 1e-9)
    cores = os.cpu_count() or 1
    out.other_cpu = max(0.0, out.machine_cpu * cores - out.generator_cpu
                        - (out.server_cpu_s + out.postgres_cpu_s) / wall)
    return out


# ---------------------------------------------------------------- the stack and its data


@dataclass
class Seed:
    tasks: int
    jobs: int
    curve_tasks: int
    steps: int
    val_every: int


def seed_database(database_url: str, seed: Seed) -> tuple[str, list[str]]:
    """One tenant with seed.tasks finished tasks; (its API key, ids of tasks with loss curves)."""
    from sqlalchemy import insert, text

    from contract.protocol import EvalSettings, TaskSettings
    from service.core.db import make_engine, make_sessionmaker
    from service.models import File, Job, MetricPoint, Node, Placement, Task, new_id
    from service.tenants import create_tenant

    engine = make_engine(database_url)
    session = make_sessionmaker(engine)()
    rng = random.Random(0)
    tenant, key = create_tenant(session, "bench")
    node = Node(name="bench-node", gpu_type="H100", gpu_count=8,
                gpu_memory_bytes=80 * 2**30, state="down")
    file = File(tenant_id=tenant.id, filename="train.jsonl", format="chat", bytes=10_000,
                line_count=100, sha256="0" * 64, storage_key="bench/train.jsonl")
    session.add_all([node, file])
    session.flush()
    start = datetime.now(timezone.utc) - timedelta(days=30)
    task_rows, job_rows, placement_rows, point_rows = [], [], [], []
    curve_ids: list[str] = []
    for i in range(seed.tasks):
        task_id = new_id("task")
        created = start + timedelta(minutes=i)
        lrs = [1e-4 * (k + 1) for k in range(seed.jobs)]
        jobs = [(new_id("job"), k) for k in range(seed.jobs)]
        task_rows.append(dict(
            id=task_id, tenant_id=tenant.id, base_model="tiny-llama", method="sft",
            training_file_id=file.id,
            search_space={"learning_rate": lrs, "lora_rank": [16]},
            settings=TaskSettings(max_seq_len=512, eval=EvalSettings(
                eval_every_steps=seed.val_every)).model_dump(mode="json"),
            priority=0, num_train_samples=100, state="succeeded", best_job_id=jobs[0][0],
            created_at=created, started_at=created + timedelta(seconds=5),
            finished_at=created + timedelta(minutes=30)))
        placement_rows.append(dict(
            id=new_id("pl"), task_id=task_id, node_id=node.id, gpu_indices=[0],
            planned_start=created, planned_end=created + timedelta(minutes=30),
            state="finished", attempt=1, created_at=created, published_at=created,
            claimed_at=created, finished_at=created + timedelta(minutes=30)))
        for job_id, k in jobs:
            job_rows.append(dict(
                id=job_id, task_id=task_id, index=k,
                config={"learning_rate": lrs[k], "lora_rank": 16, "batch_size": 4},
                state="completed" if k < 2 else "exited",
                exit_reason=None if k < 2 else "underperforming", best_val_loss=1.5 + k / 10,
                best_step=seed.steps, last_step=seed.steps, created_at=created))
        if i >= seed.tasks - seed.curve_tasks:  # the newest tasks have curves
            curve_ids.append(task_id)
            for job_id, _ in jobs:
                loss = 3.0
                for step in range(1, seed.steps + 1):
                    loss *= 0.995 + rng.random() * 0.004
                    point_rows.append(dict(task_id=task_id, job_id=job_id, step=step,
                                           split="train", loss=loss))
                    if step % seed.val_every == 0:
                        point_rows.append(dict(task_id=task_id, job_id=job_id, step=step,
                                               split="val", loss=loss * 1.05))
    for model, rows in ((Task, task_rows), (Job, job_rows), (Placement, placement_rows),
                        (MetricPoint, point_rows)):
        for at in range(0, len(rows), 5000):
            session.execute(insert(model), rows[at:at + 5000])
    session.commit()
    session.close()
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE"))  # planner statistics, as autovacuum keeps on a live database
    engine.dispose()
    return key, curve_ids


class Stack:
    """Private PostgreSQL + Redis under a temporary directory, and the API service on top."""

    def __init__(self, root: Path) -> None:
        from service.core.localstack import Postgres, Redis, free_port

        self.root = root
        self.pg = Postgres(root / "postgres", free_port())
        self.redis = Redis(root / "redis", free_port())
        self.port = free_port()
        self.service: subprocess.Popen | None = None

    def up(self) -> str:
        from service.admin import migrate

        self.pg.start()
        self.pg.create_database("loraplex")
        self.redis.start()
        migrate(self.pg.url())
        (self.root / "models.yaml").write_text(MODELS_YAML)
        return self.pg.url()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, workers: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        return env | {"LORAPLEX_DATABASE_URL": self.pg.url(), "LORAPLEX_REDIS_URL": self.redis.url,
                      "LORAPLEX_STORAGE_DIR": str(self.root / "storage"),
                      "LORAPLEX_MODELS_FILE": str(self.root / "models.yaml"),
                      "LORAPLEX_WORKER_TOKEN": "bench-worker-token",
                      "LORAPLEX_API_WORKERS": str(workers)}

    def start_service(self, workers: int, log_level: str) -> None:
        import httpx

        log = open(self.root / f"service-{workers}.log", "ab")
        self.service = subprocess.Popen(
            [sys.executable, "-m", "service.api.serve", "--port", str(self.port),
             "--log-level", log_level], env=self.env(workers), cwd=ROOT, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.service.poll() is None, (self.root / f"service-{workers}.log").read_text()
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("the service did not answer /healthz within 60 s")

    def watch(self) -> dict[str, int]:
        """Root process ids of the API (uvicorn, parent of its workers) and of PostgreSQL."""
        assert self.service is not None
        postmaster = int((self.pg.data_dir / "postmaster.pid").read_text().split()[0])
        return {"server": self.service.pid, "postgres": postmaster}

    def stop_service(self) -> None:
        if self.service is not None and self.service.poll() is None:
            self.service.terminate()
            self.service.wait(timeout=60)
        self.service = None

    def down(self) -> None:
        self.stop_service()
        self.pg.stop()
        self.redis.stop()


def default_workers() -> int:
    from service.api.serve import worker_count

    return worker_count(0)


# ---------------------------------------------------------------- the run


def measure(url: str, key: str, curve_ids: list[str], args: argparse.Namespace,
            watch: dict[str, int] | None = None) -> dict[str, Result]:
    endpoints = {"GET /v1/tasks?limit=20": ["/v1/tasks?limit=20"],
                 "GET /v1/tasks/{id}/metrics": [f"/v1/tasks/{t}/metrics" for t in curve_ids]}
    out = {}
    for name, paths in endpoints.items():
        out[name] = asyncio.run(load(url, key, paths, args.clients, args.duration, args.warmup,
                                     watch))
        r = out[name].row()
        print(f"  {name}: {r['rps']:.0f} req/s p50 {r['p50']:.0f} ms p99 {r['p99']:.0f} ms "
              f"errors {out[name].errors} generator cpu {out[name].generator_cpu:.0%}",
              file=sys.stderr, flush=True)
    return out


def table(rows: list[tuple[str, str, Result]]) -> str:
    lines = ["| API workers | endpoint | req/s | p50 ms | p95 ms | p99 ms | max ms | KiB/resp "
             "| errors | API CPU ms/req | PostgreSQL CPU ms/req | generator CPU (cores) "
             "| other CPU (cores) | machine CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for workers, name, res in rows:
        r = res.row()
        n = max(len(res.latencies), 1)
        lines.append(f"| {workers} | `{name}` | {r['rps']:.0f} | {r['p50']:.1f} | {r['p95']:.1f} "
                     f"| {r['p99']:.1f} | {r['max']:.0f} | {r['kb']:.1f} | {res.errors} "
                     f"| {res.server_cpu_s / n * 1e3:.1f} | {res.postgres_cpu_s / n * 1e3:.1f} "
                     f"| {res.generator_cpu:.2f} | {res.other_cpu:.2f} | {res.machine_cpu:.0%} |")
    return "\n".join(lines)


def _uvicorn_impl() -> str:
    """What uvicorn's "auto" loop and HTTP parser pick here."""
    import importlib.util

    fast = [m for m in ("uvloop", "httptools") if importlib.util.find_spec(m) is not None]
    return " + ".join(fast) if fast else "asyncio + h11"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,default",
                   help="comma-separated worker counts; 'default' is service.api.serve's default")
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per endpoint")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--tasks", type=int, default=2000)
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--curve-tasks", type=int, default=50)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--val-every", type=int, default=20)
    p.add_argument("--log-level", default="info", help="uvicorn's (info: with access log)")
    p.add_argument("--url", help="target a running service instead of starting a stack")
    p.add_argument("--api-key", help="with --url: a tenant's API key")
    p.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = p.parse_args(argv)
    seed = Seed(args.tasks, args.jobs, args.curve_tasks, args.steps, args.val_every)
    load_before = os.getloadavg()[0]  # other work on the machine (it shares the CPUs)
    rows: list[tuple[str, str, Result]] = []
    if args.url:
        import httpx

        data = httpx.get(f"{args.url}/v1/tasks?limit=100", timeout=30,
                         headers={"Authorization": f"Bearer {args.api_key}"}).json()["data"]
        for name, res in measure(args.url, args.api_key, [t["id"] for t in data], args).items():
            rows.append(("as deployed", name, res))
    else:
        root = Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
        os.chmod(root, 0o755)  # the postgres system user must enter it when we run as root
        stack = Stack(root)
        try:
            database_url = stack.up()
            t0 = time.perf_counter()
            key, curve_ids = seed_database(database_url, seed)
            print(f"seeded in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            for spec in args.workers.split(","):
                workers = default_workers() if spec == "default" else int(spec)
                label = f"{workers} (default)" if spec == "default" else str(workers)
                stack.start_service(workers, args.log_level)
                print(f"{label} worker(s):", file=sys.stderr, flush=True)
                try:
                    time.sleep(2)  # every worker up
                    watch = stack.watch()
                    for name, res in measure(stack.url, key, curve_ids, args, watch).items():
                        rows.append((label, name, res))
                finally:
                    stack.stop_service()
        finally:
            stack.down()
            shutil.rmtree(root, ignore_errors=True)
    setup = (f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
             f"Python {platform.python_version()}; {args.clients} closed-loop clients, "
             f"{args.duration:.0f} s measured per endpoint after {args.warmup:.0f} s warm-up; "
             f"data: {seed.tasks} tasks x {seed.jobs} jobs, {seed.curve_tasks} tasks with curves "
             f"of {seed.steps} train + {seed.steps // seed.val_every} val points per job; "
             f"uvicorn --log-level {args.log_level} ({_uvicorn_impl()}); load average "
             f"(1 min) {load_before:.1f} before the runs, {os.getloadavg()[0]:.1f} after")
    text = f"{setup}\n\n{table(rows)}\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
