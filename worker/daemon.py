"""The node daemon: registers this node's GPUs, heartbeats, pulls placements from its RQ queue,
runs their executors and forwards what the executors report.

Co-location: a one-GPU placement runs on a shared executor process (worker.host, folder
work_dir/hosts/<id>) serving its colocation_key on its GPUs: attached to the live one, else a
new one (an idle one of another model on those GPUs is stopped first). Each hosted placement
keeps its own folder, spool, forwarding and fencing; a cancel or pause detaches it alone; a
crash of the shared executor fails every hosted placement retryably (each resumes from its own
checkpoint). The heartbeat reports the shared executors (Heartbeat.executors) so the scheduler
can join a task to a warm one. Adapter-parallel placements (g > 1), LORAPLEX_COLOCATE=0 or a
custom --runner-module run one executor subprocess (worker.runner) per placement.

One main loop with named states (idle, busy, draining, stopping); heartbeats on their own
thread. Everything it needs to resume lives in the work dir, one folder per placement
(spec.json, daemon.json, spool.jsonl, forward.json, data/, resume/, artifacts/, executor/), so a
daemon killed at any line and restarted adopts its still-running executors and finishes
forwarding without loss or duplicates. SIGTERM drains (no new placements, running ones finish), a second
SIGTERM or SIGINT stops (executors get SIGTERM, the tasks are reported retryable); either one
ends a daemon still waiting to register. A daemon that drained or stopped with every report
delivered deregisters, so the service replans without its node at once.

The service stops placements (attempts), never tasks: a heartbeat reply names the placements it
no longer takes reports from (cancelled, superseded, failed or finished there), and a cancel sets
``cancel_key(placement_id)`` in Redis. The daemon stops exactly those, and ends them without a
word (the service would refuse it); a restarted daemon asks the service first, so it never
reports the failure of an attempt the service already gave up. A pause (or preemption) is the
other kind of stop: named in ``pause_placement_ids`` or flagged by ``pause_key(placement_id)``,
the executor gets SIGTERM, checkpoints at its step boundary, and its reports, up to its
"executor stopped", are forwarded as usual (the service takes them). A new attempt of a task
on a node that holds a newer checkpoint of an earlier attempt resumes from it (seed_local_resume).
Run ``python -m worker.daemon --help``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job

from contract.protocol import (
    ExecutorReport,
    Heartbeat,
    NodeDeregister,
    NodeRegister,
    PlacementSpec,
    cancel_key,
    node_queue_name,
    pause_key,
    placement_job_id,
)
from contract.redis_jobs import delete_job
from worker import host as shared
from worker.config import DaemonConfig, parse_args
from worker.forwarder import Forwarder
from worker.local_resume import seed_local_resume
from worker.local_state import LocalHost, LocalPlacement
from worker.processes import LEASE_NAME, alive, describe, kill_group, tail, touch
from worker.service_client import Backoff, ServiceClient, ServiceError
from worker.spool import SPOOL_NAME, TERMINAL_TYPES, SpoolWriter, read_complete_lines

log = logging.getLogger("loraplex.worker.daemon")
REPO_ROOT = Path(__file__).resolve().parents[1]
IDLE, BUSY, DRAINING, STOPPING = "idle", "busy", "draining", "stopping"
# The least time a placement gets to leave a shared executor (a detach waits for the step and
# the evaluation under way) before the executor counts as wedged and is stopped as a whole.
HOSTED_GRACE_S = 60.0


def run_placement(placement_id: str) -> None:
    """The RQ function name the service enqueues (protocol.PLACEMENT_FUNC). The loraplex
    daemon pops these jobs itself; a plain ``rq worker`` on a node queue is a mistake."""
    raise RuntimeError(f"placement {placement_id} must be run by `python -m worker.daemon`, "
                       "not by an rq worker")


def detect_node(cfg: DaemonConfig) -> NodeRegister:
    """This node's GPUs from torch.cuda when present, else cfg.cpu_slots 'cpu' slots."""
    meta: dict = {"python": sys.version.split()[0], "pid": os.getpid()}
    try:
        import torch

        meta["torch"] = torch.__version__
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            props = torch.cuda.get_device_properties(0)
            return NodeRegister(name=cfg.node_name, gpu_type=cfg.gpu_type or props.name,
                                gpu_count=torch.cuda.device_count(),
                                gpu_memory_bytes=int(props.total_memory), meta=meta)
    except ImportError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return NodeRegister(name=cfg.node_name, gpu_type=cfg.gpu_type or "cpu",
                        gpu_count=cfg.cpu_slots, gpu_memory_bytes=int(memory), meta=meta)


class Daemon:
    """One per node. run() blocks until drained or stopped."""

    def __init__(self, cfg: DaemonConfig, client: ServiceClient | None = None,
                 conn: redis.Redis | None = None) -> None:
        self.cfg = cfg
        self.client = client or ServiceClient(cfg.service_url, cfg.worker_token)
        self.conn = conn or redis.Redis.from_url(cfg.redis_url, socket_timeout=5,
                                                 socket_connect_timeout=5)
        self.state = IDLE
        self.node_id: str | None = None
        self.node: NodeRegister | None = None
        self.heartbeat_interval_s = cfg.heartbeat_interval_s or 10.0
        self.placements: dict[str, LocalPlacement] = {}
        self.hosts: dict[str, LocalHost] = {}  # shared executors (co-location)
        self._executors: tuple[ExecutorReport, ...] = ()  # snapshot for the heartbeat thread
        self._lock = threading.Lock()
        self._stop_ids: set[str] = set()  # placements the service named in a heartbeat reply
        self._pause_ids: set[str] = set()  # ... to checkpoint and stop, reporting as usual
        self._confirmed = threading.Event()  # a heartbeat reply since start: what is current
        self._claimed_ids: tuple[str, ...] = ()  # snapshot for the heartbeat thread
        self._reregister = threading.Event()
        self._stop_heartbeat = threading.Event()
        self._drain_requested = False
        self._stop_requested = False
        self._stop_deadline: float | None = None
        (cfg.work_dir / "placements").mkdir(parents=True, exist_ok=True)
        (cfg.work_dir / "hosts").mkdir(parents=True, exist_ok=True)

    # -- lifecycle ------------------------------------------------------------------------
    def run(self) -> int:
        """Register, then loop until drained or stopped. 0: a requested shutdown (also while
        still registering); 1: registration refused for good (bad token, bad request)."""
        self._install_signals()
        try:
            self.register(forever=True)
            if self.node_id is None:
                if self._shutdown_requested:
                    log.info("daemon exited before registering node_name=%s",
                             self.cfg.node_name)
                    return 0
                return 1
            self.recover()
            # Learn which adopted placements are still current before touching any of them.
            self._claimed_ids = self._claimed_snapshot()
            self.heartbeat_once()
            clean = self._loop()
            if clean:
                self.deregister()
        finally:
            self.client.close()
        log.info("daemon exited node=%s", self.node_id)
        return 0

    def _loop(self) -> bool:
        """The main loop with its heartbeat thread; True when it ended cleanly (drained, or
        stopped with every claimed placement reported), False on the stop timeout."""
        beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        beat.start()
        clean, failures = False, 0
        try:
            while True:
                try:
                    self.tick()
                    failures = 0
                except Exception:  # noqa: BLE001 - one bad tick must not end the node's work
                    # Its executors run on; the next tick retries (after a backoff, so a lasting
                    # fault does not spin). Signals still end the loop below.
                    failures += 1
                    log.exception("tick failed node=%s failures=%d", self.node_id, failures)
                    self._sleep(Backoff().delay(min(failures, 6)))
                if self._finished():
                    clean = True
                    break
                if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                    log.warning("stop timeout node=%s placements=%s", self.node_id,
                                ",".join(self.placements))
                    break
                time.sleep(self.cfg.poll_interval_s)
        finally:
            self._stop_heartbeat.set()
            beat.join(timeout=5)
        if beat.is_alive():
            # A heartbeat still in flight could mark the node up again after it left.
            log.warning("heartbeat thread still busy node=%s: not deregistering", self.node_id)
            return False
        return clean

    def deregister(self) -> bool:
        """Tell the service this node leaves now; the placements it had popped but not claimed
        are superseded there, so their folders go too. Best effort: without it the service
        marks the node down after its heartbeat timeout."""
        reason = "stopped" if self.state == STOPPING else "drained"
        try:
            reply = self.client.deregister(self.node_id or "", NodeDeregister(reason=reason))
        except ServiceError as exc:
            log.warning("deregister failed node=%s error=%s", self.node_id, exc)
            return False
        for p in list(self.placements.values()):
            if p.status == "popped":
                self._forget(p)
        log.info("node deregistered node=%s reason=%s superseded=%s", self.node_id, reason,
                 ",".join(reply.superseded_placement_ids) or "-")
        return True

    @property
    def _shutdown_requested(self) -> bool:
        return self._drain_requested or self._stop_requested

    def _sleep(self, seconds: float) -> None:
        """Sleep in short slices so a signal ends the wait (a handler only sets flags)."""
        deadline = time.monotonic() + seconds
        while not self._shutdown_requested:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.1, left))

    def _finished(self) -> bool:
        """Drained: nothing left. Stopped: nothing claimed left (popped-but-unclaimed ones
        stay in the work dir for the next start unless deregistering supersedes them)."""
        if self.state == DRAINING:
            return not self.placements and not self.hosts
        if self.state == STOPPING:
            return all(p.status == "popped" for p in self.placements.values()) and not self.hosts
        return False

    def _install_signals(self) -> None:
        def on_term(signum: int, _frame: object) -> None:
            if self._drain_requested:
                self._stop_requested = True
            self._drain_requested = True

        def on_int(signum: int, _frame: object) -> None:
            self._drain_requested = self._stop_requested = True

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_int)

    def register(self, forever: bool = False) -> None:
        """Register this node. forever: retry (backoff, one try per wait) until the service
        answers or a signal asks for shutdown; else the client's own few retries."""
        self.node = self.node or detect_node(self.cfg)
        attempt = 0
        while True:
            try:
                reply = self.client.register(self.node, attempts=1 if forever else None)
                break
            except ServiceError as exc:
                if not forever or not exc.retryable or self._shutdown_requested:
                    log.error("register failed node_name=%s error=%s", self.cfg.node_name, exc)
                    return
                log.warning("register deferred node_name=%s attempt=%d error=%s",
                            self.cfg.node_name, attempt + 1, exc)
                self._sleep(Backoff().delay(attempt))
                attempt += 1
                if self._shutdown_requested:
                    log.info("register abandoned node_name=%s: shutdown requested",
                             self.cfg.node_name)
                    return
        self.node_id = reply.node_id
        if self.cfg.heartbeat_interval_s is None:
            self.heartbeat_interval_s = reply.heartbeat_interval_s
        log.info("node registered node=%s name=%s gpu_type=%s gpus=%d queue=%s", self.node_id,
                 self.node.name, self.node.gpu_type, self.node.gpu_count, reply.queue)

    def _set_state(self, new: str) -> None:
        if new != self.state:
            log.info("daemon state node=%s from=%s to=%s placements=%s", self.node_id,
                     self.state, new, ",".join(self.placements) or "-")
            self.state = new

    # -- heartbeats (own thread) ----------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        while not self._stop_heartbeat.wait(self.heartbeat_interval_s):
            try:
                self.heartbeat_once()
            except Exception:  # noqa: BLE001 - a dead heartbeat thread would mark the node down
                log.exception("heartbeat error node=%s", self.node_id)

    def heartbeat_once(self) -> None:
        if self._reregister.is_set():
            self.register()
            self._reregister.clear()
        try:
            reply = self.client.heartbeat(self.node_id or "", Heartbeat(
                running_placement_ids=list(self._claimed_ids), executors=list(self._executors)))
        except ServiceError as exc:
            if exc.status == 404:
                self._reregister.set()  # the service forgot this node (fresh database)
            log.warning("heartbeat failed node=%s error=%s", self.node_id, exc)
            return
        if reply.cancelled_placement_ids or reply.pause_placement_ids:
            with self._lock:
                self._stop_ids.update(reply.cancelled_placement_ids)
                self._pause_ids.update(reply.pause_placement_ids)
        self._confirmed.set()

    # -- the main loop --------------------------------------------------------------------
    def tick(self) -> None:
        if self._stop_requested and self.state != STOPPING:
            self._set_state(STOPPING)
            self._stop_deadline = time.monotonic() + self.cfg.stop_timeout_s
            for p in self.placements.values():
                self._terminate(p, "node daemon stopped", cancelled=False)
        elif self._drain_requested and self.state not in (DRAINING, STOPPING):
            self._set_state(DRAINING)
        self._apply_stops()
        for p in list(self.placements.values()):
            self._advance(p)
        self._tend_hosts()
        if self.state not in (DRAINING, STOPPING):
            self._pop_placements()
            self._set_state(BUSY if self.placements else IDLE)
        self._claimed_ids = self._claimed_snapshot()
        self._executors = self._executor_reports()

    def _claimed_snapshot(self) -> tuple[str, ...]:
        return tuple(p.placement_id for p in self.placements.values()
                     if p.status in ("ready", "running", "exited"))

    def _pop_placements(self, max_per_tick: int = 8) -> None:
        queue = Queue(node_queue_name(self.node_id or ""), connection=self.conn)
        for _ in range(max_per_tick):
            try:
                popped = Queue.lpop([queue.key], None, connection=self.conn)
                if popped is None:
                    return
                job_id = popped[1].decode() if isinstance(popped[1], bytes) else popped[1]
                try:
                    job = Job.fetch(job_id, connection=self.conn)
                    placement_id = str(job.args[0])
                except NoSuchJobError:
                    log.warning("queued job vanished node=%s rq_job=%s", self.node_id, job_id)
                    continue
            except redis.RedisError as exc:
                log.warning("redis unavailable node=%s error=%s", self.node_id, exc)
                return
            if placement_id in self.placements:
                continue
            directory = self.cfg.work_dir / "placements" / placement_id
            directory.mkdir(parents=True, exist_ok=True)
            p = LocalPlacement(placement_id=placement_id, directory=directory)
            p.save()
            self.placements[placement_id] = p
            log.info("placement popped node=%s placement=%s", self.node_id, placement_id)
            self._claim(p)

    def _claim(self, p: LocalPlacement) -> None:
        if time.monotonic() < p.next_claim_at:
            return
        try:
            spec = self.client.claim(p.placement_id, self.node_id or "")
        except ServiceError as exc:
            if exc.retryable:
                p.claim_failures += 1
                p.next_claim_at = time.monotonic() + Backoff().delay(p.claim_failures)
                log.warning("claim deferred node=%s placement=%s error=%s", self.node_id,
                            p.placement_id, exc)
                return
            log.warning("claim refused node=%s placement=%s error=%s", self.node_id,
                        p.placement_id, exc)
            self._forget(p)
            return
        (p.directory / "spec.json").write_text(spec.model_dump_json(indent=1))
        try:
            self._fetch_inputs(p, spec)
        except ServiceError as exc:
            if exc.retryable:
                p.claim_failures += 1
                p.next_claim_at = time.monotonic() + Backoff().delay(p.claim_failures)
                return
            self._close_with_failure(p, spec.task_id, f"could not fetch inputs: {exc}")
            return
        p.task_id, p.gpu_indices, p.status = spec.task_id, list(spec.gpu_indices), "ready"
        p.save()
        self._delete_rq_job(p.placement_id)
        log.info("placement claimed node=%s task=%s placement=%s attempt=%d gpus=%s",
                 self.node_id, spec.task_id, spec.placement_id, spec.attempt, spec.gpu_indices)

    def _fetch_inputs(self, p: LocalPlacement, spec: PlacementSpec) -> None:
        """Training/validation files (cached per file id) and the resume checkpoint."""
        cache = self.cfg.work_dir / "files"
        data = p.directory / "data"
        data.mkdir(exist_ok=True)
        for name, file_id, url in (("train.jsonl", spec.training_file_id, spec.training_file_url),
                                   ("validation.jsonl", spec.validation_file_id,
                                    spec.validation_file_url)):
            if file_id is None or url is None:
                continue
            cached = cache / f"{file_id}.jsonl"
            if not cached.exists():
                self.client.download(url, cached)
            shutil.copyfile(cached, data / name)
        if spec.resume_checkpoint_files:
            resume = p.directory / "resume"
            for url in spec.resume_checkpoint_files:
                target = resume / url.rsplit("/", 1)[-1]
                if not target.exists():
                    self.client.download(url, target)

    def _advance(self, p: LocalPlacement) -> None:
        """Move one placement along: claim, start, watch, kill, forward, forget."""
        if p.status == "popped":
            self._claim(p)
            return
        if p.status == "ready" and not p.cancelled and self.state != STOPPING:
            self._start_ready(p)
        if p.status == "ready" and not p.cancelled and self.state == STOPPING:
            self._close_with_failure(p, p.task_id or "", "stopped before it started")
        if p.status == "running":
            touch(p.directory / LEASE_NAME)
            self._watch(p)
        if p.cancelled:
            if p.status in ("ready", "exited"):
                self._retire(p)
            return
        if p.forwarder is None and p.task_id is not None:
            p.forwarder = Forwarder(self.client, p.directory, p.task_id, p.placement_id)
        if p.forwarder is not None and self._confirmed.is_set():  # (after a restart: current?)
            p.forwarder.pump()
            if p.status == "exited" and p.forwarder.done:
                p.status = "done"
                p.save()
                self._forget(p, keep_dir=True)
                log.info("placement done node=%s task=%s placement=%s report=%s", self.node_id,
                         p.task_id, p.placement_id, p.forwarder.state.terminal)

    def _start_ready(self, p: LocalPlacement) -> None:
        """Start a claimed placement once its GPUs allow: attached to the live shared executor of
        its model on exactly its GPUs, else in a new one (co-location: a one-GPU placement of the
        real runner, LORAPLEX_COLOCATE not 0), else in its own runner process. A shared executor
        of another model that hosts nothing is stopped to free the GPUs; one that hosts tasks is
        waited for, never killed."""
        running = [q for q in self.placements.values() if q.status == "running"]
        # An earlier attempt of the same task still stopping here writes the checkpoint this one
        # may resume from: wait for it.
        if any(q.task_id == p.task_id for q in running):
            return
        try:
            spec = PlacementSpec.model_validate_json((p.directory / "spec.json").read_text())
        except (OSError, ValueError):
            self._close_with_failure(p, p.task_id or "", "placement spec unreadable")
            return
        key = self._colocation_key(spec)
        if key is not None:
            for h in self.hosts.values():
                if (h.key == key and h.gpu_indices == list(p.gpu_indices) and not h.closing
                        and h.host_id not in p.refused_by and h.exit_code() is None
                        and h.status().get("state") not in ("stopping", "closed")):
                    self._attach(h, p)
                    return
        gpus = set(p.gpu_indices)
        if any(q.host_id is None and gpus & set(q.gpu_indices) for q in running):
            return
        overlapping = [h for h in self.hosts.values() if gpus & set(h.gpu_indices)]
        for h in overlapping:
            if not self._hosted(h):
                self._stop_host(h, f"GPUs {sorted(gpus)} wanted by placement {p.placement_id}")
        if overlapping:
            return  # wait until they have exited
        if key is None:
            self._start(p)
        else:
            self._start_host(p, key)

    def _colocation_key(self, spec: PlacementSpec) -> str | None:
        """The key of the shared executor this placement may join; None: it runs alone."""
        if not self.cfg.colocate or self.cfg.runner_module != "worker.runner":
            return None
        if len(spec.gpu_indices) > 1:  # adapter parallelism: one task per executor
            return None
        return shared.spec_key(spec)

    def _seed(self, p: LocalPlacement) -> None:
        try:
            spec = PlacementSpec.model_validate_json((p.directory / "spec.json").read_text())
            seeded = seed_local_resume(self.cfg.work_dir / "placements", p.directory, spec)
        except Exception:  # never keep a placement from starting: it resumes as offered
            log.exception("local resume failed node=%s task=%s placement=%s", self.node_id,
                          p.task_id, p.placement_id)
            seeded = None
        if seeded is not None:
            log.info("local resume node=%s task=%s placement=%s from=%s global_step=%d "
                     "offered_global_step=%d", self.node_id, p.task_id, p.placement_id,
                     seeded.directory.name, seeded.global_step, seeded.offered_step)

    def _spawn(self, module: str, flag: str, directory: Path, gpu_indices: list[int],
               log_name: str, extra: Sequence[str] = ()) -> subprocess.Popen:
        """An executor process on these GPUs, leading its own session, logging to directory."""
        env = dict(os.environ)
        gpus = ",".join(str(g) for g in gpu_indices)
        env["CUDA_VISIBLE_DEVICES"] = gpus if self.node and self.node.gpu_type != "cpu" else ""
        env["LORAPLEX_SLOTS"] = gpus
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                          env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", module, flag, str(directory), *extra]
        with open(directory / log_name, "ab") as out:
            return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    cwd=directory)

    def _start(self, p: LocalPlacement) -> None:
        self._seed(p)
        touch(p.directory / LEASE_NAME)
        p.proc = self._spawn(self.cfg.runner_module, "--placement-dir", p.directory,
                             p.gpu_indices, "executor.log", self.cfg.runner_args)
        p.pid, p.status = p.proc.pid, "running"
        p.save()
        log.info("executor started node=%s task=%s placement=%s pid=%d gpus=%s", self.node_id,
                 p.task_id, p.placement_id, p.pid, p.gpu_indices or "-")

    # -- shared executors (co-location) ----------------------------------------------------
    def _start_host(self, p: LocalPlacement, key: str) -> None:
        """A new shared executor whose first task is p (its spec sets the executor's model)."""
        directory = self.cfg.work_dir / "hosts" / f"host-{p.placement_id}"
        shutil.rmtree(directory, ignore_errors=True)  # a previous try of this placement's
        directory.mkdir(parents=True)
        h = LocalHost(host_id=directory.name, directory=directory, key=key,
                      gpu_indices=list(p.gpu_indices))
        h.save()  # before the process: a restarted daemon finds it (its pid in status.json)
        self.hosts[h.host_id] = h
        touch(directory / LEASE_NAME)
        self._attach(h, p)  # the request is there before the process looks for it
        h.proc = self._spawn(self.cfg.host_module, "--host-dir", directory, h.gpu_indices,
                             "host.log")
        h.pid = p.pid = h.proc.pid
        h.save()
        p.save()
        log.info("shared executor started node=%s host=%s pid=%d key=%s gpus=%s first=%s",
                 self.node_id, h.host_id, h.pid, key, h.gpu_indices or "-", p.placement_id)

    def _attach(self, h: LocalHost, p: LocalPlacement) -> None:
        self._seed(p)
        touch(p.directory / LEASE_NAME)
        shared.send(h.directory, {"op": "attach", "placement_id": p.placement_id,
                                  "placement_dir": str(p.directory)})
        # its executor's pid is the shared one (never signalled for this placement alone)
        p.host_id, p.pid, p.status, p.kill_at = h.host_id, h.pid, "running", None
        p.save()
        h.stop_when_idle = False
        log.info("placement attached node=%s task=%s placement=%s host=%s", self.node_id,
                 p.task_id, p.placement_id, h.host_id)

    def _hosted(self, h: LocalHost) -> list[LocalPlacement]:
        return [p for p in self.placements.values()
                if p.host_id == h.host_id and p.status == "running"]

    def _stop_host(self, h: LocalHost, why: str) -> None:
        """SIGTERM: its tasks checkpoint and stop, it takes no new one; SIGKILL after the stop
        timeout (its tasks' own records then fail them retryably)."""
        if h.closing:
            return
        h.closing = True
        h.save()
        h.kill_at = time.monotonic() + self.cfg.stop_timeout_s
        log.info("shared executor stopping node=%s host=%s pid=%s why=%s", self.node_id,
                 h.host_id, h.pid, why)
        kill_group(h.pid, signal.SIGTERM)

    def _tend_hosts(self) -> None:
        """Keep live shared executors' leases fresh, kill one past its stop deadline, stop idle
        ones of a daemon that drains or stops, and forget one that has exited with no placement
        left on it."""
        for h in list(self.hosts.values()):
            if h.exit_code() is None:
                touch(h.directory / LEASE_NAME)
                if (self.state in (DRAINING, STOPPING) or h.stop_when_idle) and not self._hosted(h):
                    self._stop_host(h, "idle after a pause" if h.stop_when_idle
                                    else f"node daemon {self.state}")
                if h.kill_at is not None and time.monotonic() >= h.kill_at:
                    log.warning("shared executor killed node=%s host=%s pid=%s", self.node_id,
                                h.host_id, h.pid)
                    kill_group(h.pid, signal.SIGKILL)
                    h.kill_at = None
            elif not self._hosted(h):
                del self.hosts[h.host_id]
                shutil.rmtree(h.directory, ignore_errors=True)
                log.info("shared executor gone node=%s host=%s", self.node_id, h.host_id)

    def _executor_reports(self) -> tuple[ExecutorReport, ...]:
        """The shared executors another task of the same model may join (Heartbeat.executors)."""
        reports = []
        for h in self.hosts.values():
            status = h.status()
            if (h.closing or status.get("state") in ("stopping", "closed")
                    or h.exit_code() is not None):
                continue
            reports.append(ExecutorReport(
                key=h.key, gpu_indices=h.gpu_indices,
                placement_ids=[p.placement_id for p in self._hosted(h)],
                free_rows=int(status.get("free_rows") or 0),
                total_rows=int(status.get("total_rows") or 0),
                queued_jobs=int(status.get("queued_jobs") or 0)))
        return tuple(reports)

    def _watch(self, p: LocalPlacement) -> None:
        if p.host_id is not None and self._never_joined(p):
            return
        code = self._exit_code(p)
        if code is None:
            if p.kill_at is not None and time.monotonic() >= p.kill_at:
                if p.host_id is not None:
                    self._detach_overdue(p)
                    return
                log.warning("executor killed node=%s task=%s placement=%s pid=%s", self.node_id,
                            p.task_id, p.placement_id, p.pid)
                self._signal(p, signal.SIGKILL)
                p.kill_at = None
            return
        terminal = self._spool_has_terminal(p)
        if not (terminal or p.cancelled or self._confirmed.is_set()):
            return  # a restarted daemon reports a failure only for an attempt still current
        p.status = "exited"
        p.save()
        log.info("executor exited node=%s task=%s placement=%s code=%s cancelled=%s",
                 self.node_id, p.task_id, p.placement_id, code, p.cancelled)
        if terminal or p.cancelled:
            return
        if self.state == STOPPING:
            self._close_with_failure(p, p.task_id or "", "node daemon stopped")
        else:
            h = self.hosts.get(p.host_id or "")
            log_tail = tail(h.directory / "host.log" if h else p.directory / "executor.log")
            self._close_with_failure(p, p.task_id or "",
                                     f"executor exited with {describe(code)}\n{log_tail}")

    def _never_joined(self, p: LocalPlacement) -> bool:
        """A placement sent to a shared executor that refused it (closing, or it cannot share)
        or exited before taking it: back to ready, so the next tick places it again."""
        h = self.hosts.get(p.host_id or "")
        gone = h is None or h.exit_code() is not None  # before reading: its last status then
        status = h.status() if h is not None else {}
        refused = (status.get("refused") or {}).get(p.placement_id)
        if refused is None and not (gone and p.placement_id not in status.get("accepted", [])):
            return False
        log.info("placement not taken node=%s task=%s placement=%s host=%s why=%s",
                 self.node_id, p.task_id, p.placement_id, p.host_id,
                 refused or "the shared executor exited first")
        if refused is not None and p.host_id is not None:
            p.refused_by.add(p.host_id)
        p.host_id, p.status, p.kill_at = None, "ready", None
        p.save()
        return True

    def _detach_overdue(self, p: LocalPlacement) -> None:
        """A hosted placement that did not leave its shared executor within the grace: the
        executor is wedged (no step boundary came), so it is stopped as a whole, as a runner
        would be killed; every task on it stops (or fails) retryably and resumes from its own
        checkpoint."""
        p.kill_at = None
        h = self.hosts.get(p.host_id or "")
        log.warning("placement overdue node=%s task=%s placement=%s host=%s", self.node_id,
                    p.task_id, p.placement_id, p.host_id)
        if h is not None:
            self._stop_host(h, f"placement {p.placement_id} did not leave it within the grace")

    def _exit_code(self, p: LocalPlacement) -> int | str | None:
        """None while alive; the exit code for our children; 'lost' for an adopted pid. A
        placement on a shared executor: 0 once it has left it, else the executor's."""
        if p.host_id is not None:
            h = self.hosts.get(p.host_id)
            code = h.exit_code() if h is not None else "lost"
            ended = (h.status().get("ended") or {}) if h is not None else {}
            return 0 if p.placement_id in ended else code
        if p.proc is not None:
            return p.proc.poll()
        if p.pid is not None and alive(p.pid, p.directory):
            return None
        return "lost"

    def _spool_has_terminal(self, p: LocalPlacement) -> bool:
        start = p.forwarder.state.offset if p.forwarder else 0
        if p.forwarder is not None and p.forwarder.done:
            return True
        for _, _, text in read_complete_lines(p.directory / "spool.jsonl", start, 1 << 30):
            if any(f'"type":"{t}"' in text for t in TERMINAL_TYPES):
                return True
        return False

    def _close_with_failure(self, p: LocalPlacement, task_id: str, error: str) -> None:
        """End a placement (still current) whose executor left no final word: the daemon
        writes it to the spool itself, so delivery goes through the same durable, resumable
        path."""
        writer = SpoolWriter(p.directory / SPOOL_NAME)
        try:
            writer.event("executor_failed", error[:10_000], level="error")
            writer.failed(error, retryable=True)
        finally:
            writer.close()
        p.task_id = p.task_id or task_id
        p.status = "exited"
        p.save()

    def _retire(self, p: LocalPlacement) -> None:
        """End a placement the service stopped, without a report (it would be refused) and
        without forwarding the rest of its spool. Its folder stays if its executor ran: a
        later attempt of the task on this node may resume from its checkpoint."""
        ran = p.status != "ready"
        p.status = "done"
        p.save()
        self._forget(p, keep_dir=ran)
        log.info("placement done node=%s task=%s placement=%s report=none (stopped by the "
                 "service)", self.node_id, p.task_id, p.placement_id)

    # -- stops by the service -------------------------------------------------------------
    def _apply_stops(self) -> None:
        """Stop exactly the placements the service stopped: named in a heartbeat reply, or
        flagged in Redis (cancel_key(placement_id), set by a cancel). Never by task id: a new
        attempt of the same task on this node runs on."""
        with self._lock:
            named, self._stop_ids = self._stop_ids, set()
            pause, self._pause_ids = self._pause_ids, set()
        # One whose own final report was delivered is named because it ended: let it exit.
        live = [p for p in self.placements.values()
                if not p.cancelled and p.status in ("ready", "running", "exited")
                and not (p.forwarder is not None and p.forwarder.done)]
        if live:
            try:
                flags = self.conn.mget([cancel_key(p.placement_id) for p in live]
                                       + [pause_key(p.placement_id) for p in live])
                named |= {p.placement_id for p, f in zip(live, flags[:len(live)], strict=True)
                          if f}
                pause |= {p.placement_id for p, f in zip(live, flags[len(live):], strict=True)
                          if f}
            except redis.RedisError as exc:
                log.warning("redis unavailable node=%s error=%s", self.node_id, exc)
        for p in live:
            if p.placement_id in named:
                log.info("placement stopped by the service node=%s task=%s placement=%s "
                         "status=%s", self.node_id, p.task_id, p.placement_id, p.status)
                self._terminate(p, "stopped by the service", cancelled=True)
            elif p.placement_id in pause:
                self._pause(p)

    def _pause(self, p: LocalPlacement) -> None:
        """Pause or preemption: the executor checkpoints at its step boundary and stops (SIGTERM,
        as when the daemon stops), and everything it reports up to its stop is forwarded: the
        service still takes this attempt's reports and ends it by its stop report."""
        if p.status == "ready":  # never started: nothing to checkpoint
            log.info("placement paused before start node=%s task=%s placement=%s",
                     self.node_id, p.task_id, p.placement_id)
            self._close_with_failure(p, p.task_id or "", "executor stopped: paused before it "
                                     "started")
        elif p.status == "running" and p.host_id is not None:
            self._detach(p, "paused by the service", self.cfg.pause_grace_s)
        elif p.status == "running":
            self._terminate(p, "paused by the service", cancelled=False,
                            grace_s=self.cfg.pause_grace_s)

    def _terminate(self, p: LocalPlacement, why: str, cancelled: bool,
                   grace_s: float | None = None) -> None:
        """SIGTERM the executor, SIGKILL after grace_s (default cancel_grace_s); a second,
        shorter stop (a cancel during a pause) brings the kill forward. On a shared executor:
        a cancel detaches the placement alone; the daemon's stop stops the executor."""
        if p.host_id is not None and p.status == "running":
            if cancelled and not p.cancelled:
                # as SIGTERM does to a runner: a checkpoint at its step boundary, which a later
                # attempt of the task on this node may resume from (seed_local_resume)
                p.cancelled = True
                self._detach(p, "stopped by the service", self.cfg.cancel_grace_s
                             if grace_s is None else grace_s, again=True)
            elif not cancelled:
                h = self.hosts.get(p.host_id)
                if h is not None:
                    self._stop_host(h, why)
            p.save()
            return
        p.cancelled = p.cancelled or cancelled
        p.save()
        deadline = time.monotonic() + (self.cfg.cancel_grace_s if grace_s is None else grace_s)
        if p.status == "running" and p.kill_at is None:
            log.info("executor terminating node=%s task=%s placement=%s pid=%s why=%s",
                     self.node_id, p.task_id, p.placement_id, p.pid, why)
            self._signal(p, signal.SIGTERM)
            p.kill_at = deadline
        elif p.status == "running" and deadline < p.kill_at:
            p.kill_at = deadline

    def _detach(self, p: LocalPlacement, why: str, grace_s: float, again: bool = False) -> None:
        """Ask p's shared executor to take p alone off at its next step boundary, with a
        checkpoint (the others train on). Past the grace (at least HOSTED_GRACE_S: the step and
        evaluation under way end first), _detach_overdue. Sent once (again: a stop after a
        pause)."""
        h = self.hosts.get(p.host_id or "")
        deadline = time.monotonic() + max(grace_s, HOSTED_GRACE_S)
        if h is not None and why.startswith("paused"):
            h.stop_when_idle = True
        if p.kill_at is None or again:
            if h is not None:
                shared.send(h.directory, {"op": "detach", "placement_id": p.placement_id,
                                          "outcome": "paused", "reason": why})
            log.info("placement detaching node=%s task=%s placement=%s host=%s why=%s",
                     self.node_id, p.task_id, p.placement_id, p.host_id, why)
        if p.kill_at is None or deadline < p.kill_at:
            p.kill_at = deadline

    def _signal(self, p: LocalPlacement, sig: signal.Signals) -> None:
        kill_group(p.pid, sig)

    # -- restart --------------------------------------------------------------------------
    def recover(self) -> None:
        """Adopt the placements and shared executors a previous daemon left in the work dir."""
        for directory in sorted((self.cfg.work_dir / "hosts").iterdir()):
            h = LocalHost.load(directory)
            if h is None:  # it died while being started: its placements go back to ready
                shutil.rmtree(directory, ignore_errors=True)
                continue
            if h.closing:  # it was asked to stop: it gets the stop timeout again
                h.kill_at = time.monotonic() + self.cfg.stop_timeout_s
            self.hosts[h.host_id] = h
            log.info("shared executor recovered node=%s host=%s pid=%s key=%s", self.node_id,
                     h.host_id, h.pid, h.key)
        for directory in sorted((self.cfg.work_dir / "placements").iterdir()):
            p = LocalPlacement.load(directory)
            if p is None or p.status == "done":
                continue
            self.placements[p.placement_id] = p
            log.info("placement recovered node=%s task=%s placement=%s status=%s pid=%s",
                     self.node_id, p.task_id, p.placement_id, p.status, p.pid)

    def _forget(self, p: LocalPlacement, keep_dir: bool = False) -> None:
        self.placements.pop(p.placement_id, None)
        self._delete_rq_job(p.placement_id)
        if not keep_dir:
            shutil.rmtree(p.directory, ignore_errors=True)

    def _delete_rq_job(self, placement_id: str) -> None:
        try:
            delete_job(self.conn, placement_job_id(placement_id), remove_from_queue=False)
        except redis.RedisError:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    return Daemon(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
