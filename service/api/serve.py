"""``python -m service.api.serve``: the API under uvicorn with several worker processes, as deployed.
The count is LORAPLEX_API_WORKERS, or one per CPU this process may use (at least 2, at most 8):
each process overlaps its requests' database waits (the most-read routes on its event loop,
service.api.read_path; the others on its threadpool), so more processes than cores only add
contention (bench/results/api_load_cpu.md). One of the workers wins the leader election and
runs the background loops (service.api.background). uvicorn uses uvloop and httptools (installed
with the service) by itself."""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

MIN_DEFAULT_WORKERS = 2  # a second process serves while one restarts, and stands by to lead
MAX_DEFAULT_WORKERS = 8


def available_cpus() -> float:
    """CPUs this process may use: its affinity mask, lowered by a cgroup v2 CPU quota (a
    container's limit)."""
    cpus = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return cpus


def worker_count(configured: int = 0) -> int:
    """The configured count, else one per available CPU (rounded up), between 2 and 8."""
    if configured > 0:
        return configured
    return max(MIN_DEFAULT_WORKERS, min(MAX_DEFAULT_WORKERS, math.ceil(available_cpus())))


STARTUP_FAILURE = 3  # uvicorn's exit code for a worker that never served: do not restart it


def _worker(host: str, port: int, options: dict[str, Any]) -> None:
    """One API process on its own SO_REUSEPORT socket (the kernel spreads new connections
    evenly over the sockets of one port)."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        print(f"loraplex-serve: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        sys.exit(STARTUP_FAILURE)
    server = uvicorn.Server(uvicorn.Config(loaded_app(), host=host, port=port, **options))
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(STARTUP_FAILURE)


def loaded_app() -> Any:
    """The app, built, with everything allocated so far frozen out of the garbage collector:
    a process that has imported the service holds ~170,000 objects, which each full collection
    walked (~175 ms on this machine, every request of the process waiting behind it); they
    live as long as the process, so the collector need not look at them again."""
    from service.api.app import app

    gc.collect()
    gc.freeze()
    return app


def supervise(workers: int, host: str, port: int, options: dict[str, Any]) -> int:
    """Run ``workers`` API processes, each listening on its own socket, and restart one that
    dies. (uvicorn --workers shares one socket: with keep-alive clients the first process to
    wake accepts a whole burst of connections and keeps them; measured 44 of 50 connections on
    one of two processes.) SIGTERM/SIGINT stop them all gracefully."""
    ctx = multiprocessing.get_context("spawn")
    stop = threading.Event()

    def start() -> multiprocessing.process.BaseProcess:
        proc = ctx.Process(target=_worker, args=(host, port, options), name="loraplex-api")
        proc.start()
        return proc

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    procs = [start() for _ in range(workers)]
    code = 0
    while not stop.wait(0.5):
        for i, proc in enumerate(procs):
            if proc.is_alive():
                continue
            if proc.exitcode == STARTUP_FAILURE:
                print(f"loraplex-serve: worker {proc.pid} failed to start; stopping",
                      file=sys.stderr, flush=True)
                stop.set()
                code = 1
                break
            print(f"loraplex-serve: worker {proc.pid} died (exit {proc.exitcode}); restarting",
                  file=sys.stderr, flush=True)
            procs[i] = start()
    for proc in procs:  # a terminal's Ctrl+C reached them too: let them end on their own
        proc.join(timeout=1)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()  # SIGTERM: uvicorn drains and runs the lifespan's shutdown
    for proc in procs:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return code


def main(argv: list[str] | None = None) -> int:
    from service.core.config import get_settings

    parser = argparse.ArgumentParser(prog="python -m service.api.serve", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=0,
                        help="worker processes (default: LORAPLEX_API_WORKERS, else 1 per CPU)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--proxy-headers", action=argparse.BooleanOptionalAction, default=True,
                        help="trust X-Forwarded-* from --forwarded-allow-ips (as uvicorn does)")
    parser.add_argument("--forwarded-allow-ips", default=None,
                        help="default: $FORWARDED_ALLOW_IPS, else 127.0.0.1 (uvicorn's)")
    args = parser.parse_args(argv)
    workers = worker_count(args.workers or get_settings().api_workers)
    options = {"log_level": args.log_level, "proxy_headers": args.proxy_headers,
               "forwarded_allow_ips": args.forwarded_allow_ips}
    print(f"loraplex-serve: {workers} API worker process(es) on {args.host}:{args.port}",
          flush=True)
    if workers > 1 and hasattr(socket, "SO_REUSEPORT") and sys.platform.startswith("linux"):
        return supervise(workers, args.host, args.port, options)
    import uvicorn

    if workers == 1:
        uvicorn.run(loaded_app(), host=args.host, port=args.port, **options)
    else:  # no SO_REUSEPORT: uvicorn's workers on one shared socket
        uvicorn.run("service.api.app:app", host=args.host, port=args.port, workers=workers, **options)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
