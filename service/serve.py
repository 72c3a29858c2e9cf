"""``python -m service.serve``: the API under uvicorn with several worker processes, as deployed.
The count is LORAPLEX_API_WORKERS, or 2 per CPU core this process may use (at most 8); one of
the workers wins the leader election and runs the background loops (service.background)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

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
    """The configured count, else 2 per available core (rounded up), between 1 and 8."""
    if configured > 0:
        return configured
    return max(1, min(MAX_DEFAULT_WORKERS, math.ceil(2 * available_cpus())))


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from service.config import get_settings

    parser = argparse.ArgumentParser(prog="python -m service.serve", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=0,
                        help="worker processes (default: LORAPLEX_API_WORKERS, else 2 per core)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--proxy-headers", action="store_true",
                        help="trust X-Forwarded-* from --forwarded-allow-ips")
    parser.add_argument("--forwarded-allow-ips", default=None)
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
