"""``python -m service.serve``: the API under uvicorn with several worker processes, as deployed.
The count is LORAPLEX_API_WORKERS, or one per CPU this process may use (at least 2, at most 8):
the routes are sync and each process overlaps their database waits on its threadpool, so more
processes than cores only add contention (bench/results/api_load_cpu.md). One of the workers wins
the leader election and runs the background loops (service.background)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

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


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from service.config import get_settings

    parser = argparse.ArgumentParser(prog="python -m service.serve", description=__doc__)
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
    print(f"loraplex-serve: {workers} API worker process(es) on {args.host}:{args.port}",
          flush=True)
    uvicorn.run("service.app:app", host=args.host, port=args.port, workers=workers,
                log_level=args.log_level, proxy_headers=args.proxy_headers,
                forwarded_allow_ips=args.forwarded_allow_ips)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
