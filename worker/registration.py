"""This node at the service: registration (retried until answered), heartbeats on their own
thread, deregistration, and what the heartbeat replies say (the placements to stop or pause)."""

from __future__ import annotations

import logging
import os
import sys
import threading

from contract.protocol import (
    ExecutorReport,
    Heartbeat,
    NodeDeregister,
    NodeDeregistered,
    NodeRegister,
)
from worker.config import DaemonConfig
from worker.service_client import Backoff, ServiceClient, ServiceError
from worker.shutdown import Shutdown

log = logging.getLogger("loraplex.worker.daemon")


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


class Registration:
    """The node's id at the service and the heartbeat's traffic both ways: the main loop writes
    the snapshots the heartbeat thread sends (claimed_ids, executors); the heartbeat thread
    collects the placements the service stopped or paused, which the loop takes (take_stops)."""

    def __init__(self, cfg: DaemonConfig, client: ServiceClient) -> None:
        self.cfg, self.client = cfg, client
        self.node: NodeRegister | None = None
        self.node_id: str | None = None
        self.interval_s = cfg.heartbeat_interval_s or 10.0
        self.claimed_ids: tuple[str, ...] = ()  # snapshot for the heartbeat thread
        self.executors: tuple[ExecutorReport, ...] = ()  # snapshot for the heartbeat thread
        self.confirmed = threading.Event()  # a heartbeat reply since start: what is current
        self.stop_ids: set[str] = set()  # placements the service named in a heartbeat reply
        self.pause_ids: set[str] = set()  # ... to checkpoint and stop, reporting as usual
        self._lock = threading.Lock()
        self._reregister = threading.Event()

    @property
    def cuda(self) -> bool:
        """Whether this node offers CUDA GPUs (not 'cpu' slots) to its executors."""
        return self.node is not None and self.node.gpu_type != "cpu"

    def register(self, shutdown: Shutdown | None = None) -> None:
        """Register this node. With shutdown: retry (backoff, one try per wait) until the service
        answers or a signal asks for shutdown; without: the client's own few retries."""
        self.node = self.node or detect_node(self.cfg)
        attempt = 0
        while True:
            try:
                reply = self.client.register(self.node,
                                             attempts=1 if shutdown is not None else None)
                break
            except ServiceError as exc:
                if shutdown is None or not exc.retryable or shutdown.requested:
                    log.error("register failed node_name=%s error=%s", self.cfg.node_name, exc)
                    return
                log.warning("register deferred node_name=%s attempt=%d error=%s",
                            self.cfg.node_name, attempt + 1, exc)
                shutdown.sleep(Backoff().delay(attempt))
                attempt += 1
                if shutdown.requested:
                    log.info("register abandoned node_name=%s: shutdown requested",
                             self.cfg.node_name)
                    return
        self.node_id = reply.node_id
        if self.cfg.heartbeat_interval_s is None:
            self.interval_s = reply.heartbeat_interval_s
        log.info("node registered node=%s name=%s gpu_type=%s gpus=%d queue=%s", self.node_id,
                 self.node.name, self.node.gpu_type, self.node.gpu_count, reply.queue)

    def deregister(self, reason: str) -> NodeDeregistered | None:
        """Tell the service this node leaves now; None when that failed."""
        try:
            return self.client.deregister(self.node_id or "", NodeDeregister(reason=reason))
        except ServiceError as exc:
            log.warning("deregister failed node=%s error=%s", self.node_id, exc)
            return None

    # -- heartbeats (own thread) ----------------------------------------------------------
    def heartbeat_once(self) -> None:
        if self._reregister.is_set():
            self.register()
            self._reregister.clear()
        try:
            reply = self.client.heartbeat(self.node_id or "", Heartbeat(
                running_placement_ids=list(self.claimed_ids), executors=list(self.executors)))
        except ServiceError as exc:
            if exc.status == 404:
                self._reregister.set()  # the service forgot this node (fresh database)
            log.warning("heartbeat failed node=%s error=%s", self.node_id, exc)
            return
        if reply.cancelled_placement_ids or reply.pause_placement_ids:
            with self._lock:
                self.stop_ids.update(reply.cancelled_placement_ids)
                self.pause_ids.update(reply.pause_placement_ids)
        self.confirmed.set()

    def take_stops(self) -> tuple[set[str], set[str]]:
        """The placements named since the last call: (to stop, to pause)."""
        with self._lock:
            named, self.stop_ids = self.stop_ids, set()
            pause, self.pause_ids = self.pause_ids, set()
        return named, pause
