"""The daemon's settings (DaemonConfig) and the command line that fills them, flags over
LORAPLEX_* environment variables."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class DaemonConfig:
    service_url: str
    worker_token: str
    redis_url: str
    node_name: str
    work_dir: Path
    cpu_slots: int = 1
    gpu_type: str | None = None  # override the detected type (e.g. a name the operator uses)
    poll_interval_s: float = 0.5
    cancel_grace_s: float = 10.0
    # A paused executor is writing the checkpoint the resume starts from: give it time.
    pause_grace_s: float = 300.0
    stop_timeout_s: float = 30.0
    heartbeat_interval_s: float | None = None  # default: what the service asks for
    runner_module: str = "worker.runner"
    runner_args: list[str] = field(default_factory=list)
    # co-location: a one-GPU placement joins a shared executor (worker.host) of its model on its
    # GPUs. Only with the real runner: another runner module replaces the whole executor side.
    colocate: bool = True
    host_module: str = "worker.host"
    # a spare shared executor on each free GPU, warmed up ahead of any placement (worker.host
    # --spare): a task that comes to a cold GPU pays its model's load, not a process's start.
    # "auto": on a GPU node (with co-location and the real runner), off on a CPU node
    spare_hosts: str = os.environ.get("LORAPLEX_SPARE_HOSTS", "auto")
    # samples on demand (worker.sample_requests): how often an idle node asks for one, the module
    # that answers one in a fresh process, and how long one may take before it is given back
    sample_poll_s: float = float(os.environ.get("LORAPLEX_SAMPLE_POLL_S", "2"))
    sampler_module: str = "worker.sampler"
    sample_timeout_s: float = 600.0
    # the node's zygote (worker.zygote): executor processes forked with their imports done.
    # "auto": on a GPU node; "on"; "off" (every process a new interpreter)
    zygote: str = os.environ.get("LORAPLEX_ZYGOTE", "auto")



def parse_args(argv: Sequence[str] | None = None) -> DaemonConfig:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m worker.daemon", description=(
        "loraplex node daemon: runs the placements the scheduler gives this node."))
    ap.add_argument("--service-url", default=env("LORAPLEX_SERVICE_URL", "http://127.0.0.1:8000"),
                    help="Base URL of the service (env LORAPLEX_SERVICE_URL).")
    ap.add_argument("--worker-token", default=env("LORAPLEX_WORKER_TOKEN", "dev-worker-token"),
                    help="Bearer token of /internal/v1 (env LORAPLEX_WORKER_TOKEN).")
    ap.add_argument("--redis-url", default=env("LORAPLEX_REDIS_URL", "redis://127.0.0.1:6379/0"),
                    help="Redis holding the placement queues (env LORAPLEX_REDIS_URL).")
    ap.add_argument("--node-name", default=env("LORAPLEX_NODE_NAME", socket.gethostname()),
                    help="Stable name of this node (env LORAPLEX_NODE_NAME; default hostname).")
    ap.add_argument("--work-dir", type=Path,
                    default=Path(env("LORAPLEX_WORK_DIR", "var/worker")),
                    help="Where placements keep their files (env LORAPLEX_WORK_DIR).")
    ap.add_argument("--cpu-slots", type=int, default=int(env("LORAPLEX_CPU_SLOTS", "1")),
                    help="Executor slots to offer when the node has no CUDA GPU.")
    ap.add_argument("--gpu-type", default=env("LORAPLEX_GPU_TYPE"),
                    help="Override the detected GPU type name.")
    ap.add_argument("--cancel-grace-s", type=float, default=10.0,
                    help="Seconds between SIGTERM and SIGKILL of a cancelled executor.")
    ap.add_argument("--pause-grace-s", type=float, default=300.0,
                    help="Seconds a paused (or preempted) executor gets to checkpoint and "
                         "exit before SIGKILL.")
    ap.add_argument("--poll-interval-s", type=float, default=0.5)
    ap.add_argument("--heartbeat-interval-s", type=float, default=None,
                    help="Default: the interval the service asks for at registration.")
    ap.add_argument("--runner-module", default="worker.runner",
                    help="Module run as `python -m MODULE --placement-dir DIR` per placement.")
    ap.add_argument("--runner-arg", action="append", default=[], dest="runner_args",
                    help="Extra argument for the runner (repeatable).")
    ap.add_argument("--colocate", action=argparse.BooleanOptionalAction,
                    default=env("LORAPLEX_COLOCATE", "1") != "0",
                    help="Run one-GPU placements of one model on one shared executor per GPU "
                         "set (env LORAPLEX_COLOCATE=0 turns it off; only with worker.runner).")
    ap.add_argument("--host-module", default="worker.host",
                    help="Module run as `python -m MODULE --host-dir DIR` per shared executor.")
    ap.add_argument("--spare-hosts", choices=("auto", "on", "off"),
                    default=env("LORAPLEX_SPARE_HOSTS", "auto"),
                    help="Keep a warmed-up shared executor on each free GPU for the next task "
                         "(env LORAPLEX_SPARE_HOSTS; auto: on a GPU node, off on a CPU node).")
    ap.add_argument("--zygote", choices=("auto", "on", "off"), default=env("LORAPLEX_ZYGOTE", "auto"),
                    help="Fork executor processes from a process that has done their imports "
                         "(worker.zygote; env LORAPLEX_ZYGOTE; auto: on a GPU node).")
    ap.add_argument("--log-level", default=env("LORAPLEX_LOG_LEVEL", "INFO"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return DaemonConfig(service_url=args.service_url, worker_token=args.worker_token,
                        redis_url=args.redis_url, node_name=args.node_name,
                        work_dir=args.work_dir.resolve(), cpu_slots=args.cpu_slots,
                        gpu_type=args.gpu_type, poll_interval_s=args.poll_interval_s,
                        cancel_grace_s=args.cancel_grace_s, pause_grace_s=args.pause_grace_s,
                        heartbeat_interval_s=args.heartbeat_interval_s,
                        runner_module=args.runner_module, runner_args=list(args.runner_args),
                        colocate=args.colocate, host_module=args.host_module,
                        spare_hosts=args.spare_hosts, zygote=args.zygote)

