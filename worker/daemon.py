"""The node daemon: one main loop with named states (idle, busy, draining, stopping) that runs the
placements the scheduler gives this node. Its parts: registration (heartbeats), shutdown
(signals), placements (+ claims, shared_hosts, local_resume), forwarder, sample_requests. Run
``python -m worker.daemon --help``."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence

import redis

from contract.background import BackgroundWorker
from worker.config import DaemonConfig, parse_args
from worker.local_state import LocalPlacement, LocalStatus
from worker.placements import Lifecycle
from worker.processes import NodeZygote
from worker.registration import Registration
from worker.sample_requests import SampleRequests
from worker.service_client import Backoff, ServiceClient
from worker.shared_hosts import SharedHosts
from worker.shutdown import Shutdown

log = logging.getLogger("loraplex.worker.daemon")
IDLE, BUSY, DRAINING, STOPPING = "idle", "busy", "draining", "stopping"


def run_placement(placement_id: str) -> None:
    """The RQ function name the service enqueues (protocol.PLACEMENT_FUNC). The loraplex
    daemon pops these jobs itself; a plain ``rq worker`` on a node queue is a mistake."""
    raise RuntimeError(f"placement {placement_id} must be run by `python -m worker.daemon`, "
                       "not by an rq worker")


class Daemon:
    """One per node. run() blocks until drained or stopped. Everything it needs to resume lives
    in the work dir (worker.local_state), so a daemon killed at any line and restarted adopts
    its still-running executors and finishes forwarding without loss or duplicates; a restarted
    daemon asks the service first, so it never reports the failure of an attempt the service
    already gave up."""

    def __init__(self, cfg: DaemonConfig, client: ServiceClient | None = None,
                 conn: redis.Redis | None = None) -> None:
        self.cfg = cfg
        self.client = client or ServiceClient(cfg.service_url, cfg.worker_token)
        self.conn = conn or redis.Redis.from_url(cfg.redis_url, socket_timeout=5,
                                                 socket_connect_timeout=5)
        self.state = IDLE
        self.shutdown = Shutdown()
        self.registration = Registration(cfg, self.client)
        self.placements: dict[str, LocalPlacement] = {}  # the node's table; its parts share it
        self.zygote = NodeZygote(cfg.zygote, cfg.work_dir)
        self.shared = SharedHosts(cfg, self.registration, self.placements, self.zygote)
        self.lifecycle = Lifecycle(cfg, self.client, self.conn, self.registration,
                                   self.placements, self.shared)
        self.sampling = SampleRequests(cfg, self.client, self.registration, self.placements,
                                       self.shared)
        self._stop_deadline: float | None = None
        (cfg.work_dir / "placements").mkdir(parents=True, exist_ok=True)
        (cfg.work_dir / "hosts").mkdir(parents=True, exist_ok=True)

    @property
    def node_id(self) -> str | None:
        return self.registration.node_id

    def run(self) -> int:
        """Register, then loop until drained or stopped. 0: a requested shutdown (also while
        still registering); 1: registration refused for good (bad token, bad request)."""
        self.shutdown.install()
        try:
            self.registration.register(self.shutdown)
            if self.node_id is None:
                if self.shutdown.requested:
                    log.info("daemon exited before registering node_name=%s",
                             self.cfg.node_name)
                    return 0
                return 1
            self.recover()
            # Learn which adopted placements are still current before touching any of them.
            self.registration.claimed_ids = self.lifecycle.claimed_ids()
            self.registration.heartbeat_once()
            clean = self._loop()
            if clean:
                self.deregister()
        finally:
            self.zygote.close()
            self.client.close()
        log.info("daemon exited node=%s", self.node_id)
        return 0

    def _loop(self) -> bool:
        """The main loop with its heartbeat thread; True when it ended cleanly (drained, or
        stopped with every claimed placement reported), False on the stop timeout."""
        beat = BackgroundWorker("heartbeat", self.registration.heartbeat_once, logger=log,
                                every_s=self.registration.interval_s, wait_first=True).start()
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
                    self.shutdown.sleep(Backoff().delay(min(failures, 6)))
                if self._finished():
                    clean = True
                    break
                if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                    log.warning("stop timeout node=%s placements=%s", self.node_id,
                                ",".join(self.placements))
                    break
                time.sleep(self.cfg.poll_interval_s)
        finally:
            beat.stop(timeout=5)
        if beat.alive:
            # A heartbeat still in flight could mark the node up again after it left.
            log.warning("heartbeat thread still busy node=%s: not deregistering", self.node_id)
            return False
        return clean

    def tick(self) -> None:
        if self.shutdown.stop and self.state != STOPPING:
            self._set_state(STOPPING)
            self._stop_deadline = time.monotonic() + self.cfg.stop_timeout_s
            for p in self.placements.values():
                self.lifecycle.terminate(p, "node daemon stopped", cancelled=False)
            self.sampling.stop("node daemon stopped")
        elif self.shutdown.drain and self.state not in (DRAINING, STOPPING):
            self._set_state(DRAINING)
        self.lifecycle.apply_stops()
        for p in list(self.placements.values()):
            self.lifecycle.advance(p, stopping=self.state == STOPPING)
        self.shared.tend(self.state if self.state in (DRAINING, STOPPING) else None)
        self.sampling.tend(accepting=self.state not in (DRAINING, STOPPING))
        if self.state not in (DRAINING, STOPPING):
            self.zygote.tend(self.registration.cuda)
            self.lifecycle.pop()
            self._set_state(BUSY if self.placements else IDLE)
            self.shared.keep_spares(also=self.sampling.slot)
        self.registration.claimed_ids = self.lifecycle.claimed_ids()
        self.registration.executors = self.shared.reports()

    def _set_state(self, new: str) -> None:
        if new != self.state:
            log.info("daemon state node=%s from=%s to=%s placements=%s", self.node_id,
                     self.state, new, ",".join(self.placements) or "-")
            self.state = new

    def _finished(self) -> bool:
        """Drained: nothing left. Stopped: nothing claimed left (popped-but-unclaimed ones
        stay in the work dir for the next start unless deregistering supersedes them)."""
        if self.state == DRAINING:
            return not self.placements and not self.shared.hosts and not self.sampling.busy
        if self.state == STOPPING:
            return (all(p.status == LocalStatus.POPPED for p in self.placements.values())
                    and not self.shared.hosts)
        return False

    def recover(self) -> None:
        """Adopt the shared executors and placements a previous daemon left in the work dir."""
        self.shared.recover()
        self.lifecycle.recover()
        self.sampling.recover()

    def deregister(self) -> bool:
        """Tell the service this node leaves now (it drained or stopped with every report
        delivered), so it replans without the node at once; the placements it had popped but
        not claimed are superseded there, so their folders go too. Best effort: without it the
        service marks the node down after its heartbeat timeout."""
        reason = "stopped" if self.state == STOPPING else "drained"
        reply = self.registration.deregister(reason)
        if reply is None:
            return False
        for p in list(self.placements.values()):
            if p.status == LocalStatus.POPPED:
                self.lifecycle.forget(p)
        log.info("node deregistered node=%s reason=%s superseded=%s", self.node_id, reason,
                 ",".join(reply.superseded_placement_ids) or "-")
        return True


def main(argv: Sequence[str] | None = None) -> int:
    return Daemon(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
