"""A placement's life on this node (popped -> ready -> running -> exited -> done): claimed,
started on its own runner or a shared executor, watched, stopped when the service or the daemon
says so, its reports forwarded, then forgotten."""

from __future__ import annotations

import logging
import shutil
import signal
import time

import redis

from contract.protocol import PlacementSpec, cancel_key, pause_key
from worker.claims import Claims
from worker.config import DaemonConfig
from worker.forwarder import Forwarder
from worker.local_resume import seed_before_start
from worker.local_state import CLAIMED, LocalPlacement, LocalStatus
from worker.processes import LEASE_NAME, describe, exit_code_of, kill_group, spawn, tail, touch
from worker.registration import Registration
from worker.service_client import ServiceClient
from worker.shared_hosts import SharedHosts

log = logging.getLogger("loraplex.worker.daemon")


class Lifecycle:
    """Moves each placement of the daemon's table along, one step per tick (advance).

    The service stops placements (attempts), never tasks: a heartbeat reply names the ones it no
    longer takes reports from, and a cancel sets cancel_key(placement_id) in Redis; those are
    stopped and end without a word (the service would refuse it). A pause (or preemption),
    named in pause_placement_ids or flagged by pause_key(placement_id), checkpoints and stops,
    and its reports up to "executor stopped" are forwarded as usual."""

    def __init__(self, cfg: DaemonConfig, client: ServiceClient, conn: redis.Redis,
                 registration: Registration, placements: dict[str, LocalPlacement],
                 shared: SharedHosts) -> None:
        self.cfg, self.client, self.conn = cfg, client, conn
        self.registration, self.placements, self.shared = registration, placements, shared
        self.claims = Claims(cfg, client, conn, registration)

    def pop(self) -> None:
        """New placements from the node queue, each claimed at once."""
        for p in self.claims.pop(known=self.placements):
            self.placements[p.placement_id] = p
            self._claim(p)

    def _claim(self, p: LocalPlacement) -> None:
        if not self.claims.claim(p):
            self.forget(p)

    def claimed_ids(self) -> tuple[str, ...]:
        return tuple(p.placement_id for p in self.placements.values()
                     if p.status in CLAIMED)

    def advance(self, p: LocalPlacement, stopping: bool) -> None:
        """Move one placement along: claim, start, watch, kill, forward, forget. stopping: the
        daemon stops (nothing starts; an exit is the daemon's doing)."""
        if p.status == LocalStatus.POPPED:
            self._claim(p)
            return
        if p.status == LocalStatus.READY and not p.cancelled and not stopping:
            self._start_ready(p)
        if p.status == LocalStatus.READY and not p.cancelled and stopping:
            p.close_with_failure(p.task_id or "", "stopped before it started")
        if p.status == LocalStatus.RUNNING:
            touch(p.directory / LEASE_NAME)
            self._watch(p, stopping)
        if p.cancelled:
            if p.status in (LocalStatus.READY, LocalStatus.EXITED):
                self._retire(p)
            return
        if p.forwarder is None and p.task_id is not None:
            p.forwarder = Forwarder(self.client, p.directory, p.task_id, p.placement_id)
        if p.forwarder is not None and self.registration.confirmed.is_set():  # (current?)
            p.forwarder.pump()
            if p.status == LocalStatus.EXITED and p.forwarder.done:
                p.status = LocalStatus.DONE
                p.save()
                self.forget(p, keep_dir=True)
                log.info("placement done node=%s task=%s placement=%s report=%s",
                         self.registration.node_id, p.task_id, p.placement_id,
                         p.forwarder.state.terminal)

    def _start_ready(self, p: LocalPlacement) -> None:
        """Start a claimed placement once its GPUs allow: attached to the live shared executor of
        its model on exactly its GPUs, else in a new one (SharedHosts.colocation_key), else in
        its own runner process."""
        running = [q for q in self.placements.values() if q.status == LocalStatus.RUNNING]
        # An earlier attempt of the same task still stopping here writes the checkpoint this one
        # may resume from: wait for it.
        if any(q.task_id == p.task_id for q in running):
            return
        try:
            spec = PlacementSpec.model_validate_json((p.directory / "spec.json").read_text())
        except (OSError, ValueError):
            p.close_with_failure(p.task_id or "", "placement spec unreadable")
            return
        key = self.shared.colocation_key(spec)
        if key is not None and (h := self.shared.joinable(p, key)) is not None:
            self.shared.attach(h, p)
            return
        gpus = set(p.gpu_indices)
        if any(q.host_id is None and gpus & set(q.gpu_indices) for q in running):
            return
        if key is not None and (h := self.shared.spare_for(p)) is not None:
            self.shared.adopt(h, p, key)
            return
        if not self.shared.make_room(p):
            return
        if key is None:
            self._start(p)
        else:
            self.shared.start(p, key)

    def _start(self, p: LocalPlacement) -> None:
        seed_before_start(p, self.cfg.work_dir / "placements", self.registration.node_id)
        touch(p.directory / LEASE_NAME)
        p.proc = spawn(self.cfg.runner_module, "--placement-dir", p.directory, p.gpu_indices,
                       "executor.log", self.cfg.runner_args, cuda=self.registration.cuda,
                       cache_dir=self.cfg.work_dir / "cache", zygote=self.shared.zygote.current())
        p.pid, p.status = p.proc.pid, LocalStatus.RUNNING
        p.save()
        log.info("executor started node=%s task=%s placement=%s pid=%d gpus=%s",
                 self.registration.node_id, p.task_id, p.placement_id, p.pid,
                 p.gpu_indices or "-")

    def _watch(self, p: LocalPlacement, stopping: bool) -> None:
        if p.host_id is not None and self.shared.never_joined(p):
            return
        code = self._exit_code(p)
        if code is None:
            if p.kill_at is not None and time.monotonic() >= p.kill_at:
                if p.host_id is not None:
                    self.shared.detach_overdue(p)
                    return
                log.warning("executor killed node=%s task=%s placement=%s pid=%s",
                            self.registration.node_id, p.task_id, p.placement_id, p.pid)
                kill_group(p.pid, signal.SIGKILL)
                p.kill_at = None
            return
        terminal = p.spool_has_terminal()
        if not (terminal or p.cancelled or self.registration.confirmed.is_set()):
            return  # a restarted daemon reports a failure only for an attempt still current
        p.status = LocalStatus.EXITED
        p.save()
        log.info("executor exited node=%s task=%s placement=%s code=%s cancelled=%s",
                 self.registration.node_id, p.task_id, p.placement_id, code, p.cancelled)
        if terminal or p.cancelled:
            return
        if stopping:
            p.close_with_failure(p.task_id or "", "node daemon stopped")
        else:
            h = self.shared.hosts.get(p.host_id or "")
            log_tail = tail(h.directory / "host.log" if h else p.directory / "executor.log")
            p.close_with_failure(p.task_id or "",
                                 f"executor exited with {describe(code)}\n{log_tail}")

    def _exit_code(self, p: LocalPlacement) -> int | str | None:
        """None while alive; the exit code for our children; 'lost' for an adopted pid."""
        if p.host_id is not None:
            return self.shared.exit_code(p)
        if p.proc is not None:
            return p.proc.poll()
        return exit_code_of(p.pid, p.directory)

    def _retire(self, p: LocalPlacement) -> None:
        """End a placement the service stopped, without a report (it would be refused) and
        without forwarding the rest of its spool. Its folder stays if its executor ran: a
        later attempt of the task on this node may resume from its checkpoint."""
        ran = p.status != LocalStatus.READY
        p.status = LocalStatus.DONE
        p.save()
        self.forget(p, keep_dir=ran)
        log.info("placement done node=%s task=%s placement=%s report=none (stopped by the "
                 "service)", self.registration.node_id, p.task_id, p.placement_id)

    # -- stops ----------------------------------------------------------------------------
    def apply_stops(self) -> None:
        """Stop exactly the placements the service stopped: named in a heartbeat reply, or
        flagged in Redis (cancel_key(placement_id), set by a cancel). Never by task id: a new
        attempt of the same task on this node runs on."""
        named, pause = self.registration.take_stops()
        # One whose own final report was delivered is named because it ended: let it exit.
        live = [p for p in self.placements.values()
                if not p.cancelled and p.status in CLAIMED
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
                log.warning("redis unavailable node=%s error=%s", self.registration.node_id,
                            exc)
        for p in live:
            if p.placement_id in named:
                log.info("placement stopped by the service node=%s task=%s placement=%s "
                         "status=%s", self.registration.node_id, p.task_id, p.placement_id,
                         p.status)
                self.terminate(p, "stopped by the service", cancelled=True)
            elif p.placement_id in pause:
                self._pause(p)

    def _pause(self, p: LocalPlacement) -> None:
        """Pause or preemption: the executor checkpoints at its step boundary and stops (SIGTERM,
        as when the daemon stops), and everything it reports up to its stop is forwarded: the
        service still takes this attempt's reports and ends it by its stop report."""
        if p.status == LocalStatus.READY:  # never started: nothing to checkpoint
            log.info("placement paused before start node=%s task=%s placement=%s",
                     self.registration.node_id, p.task_id, p.placement_id)
            p.close_with_failure(p.task_id or "", "executor stopped: paused before it started")
        elif p.status == LocalStatus.RUNNING and p.host_id is not None:
            self.shared.detach(p, "paused by the service", self.cfg.pause_grace_s)
        elif p.status == LocalStatus.RUNNING:
            self.terminate(p, "paused by the service", cancelled=False,
                           grace_s=self.cfg.pause_grace_s)

    def terminate(self, p: LocalPlacement, why: str, cancelled: bool,
                  grace_s: float | None = None) -> None:
        """SIGTERM the executor, SIGKILL after grace_s (default cancel_grace_s); a second,
        shorter stop (a cancel during a pause) brings the kill forward. On a shared executor:
        a cancel detaches the placement alone; the daemon's stop stops the executor."""
        if p.host_id is not None and p.status == LocalStatus.RUNNING:
            if cancelled and not p.cancelled:
                # as SIGTERM does to a runner: a checkpoint at its step boundary, which a later
                # attempt of the task on this node may resume from (seed_local_resume)
                p.cancelled = True
                self.shared.detach(p, "stopped by the service", self.cfg.cancel_grace_s
                                   if grace_s is None else grace_s, again=True)
            elif not cancelled:
                h = self.shared.hosts.get(p.host_id)
                if h is not None:
                    self.shared.stop(h, why)
            p.save()
            return
        p.cancelled = p.cancelled or cancelled
        p.save()
        deadline = time.monotonic() + (self.cfg.cancel_grace_s if grace_s is None else grace_s)
        if p.status == LocalStatus.RUNNING and p.kill_at is None:
            log.info("executor terminating node=%s task=%s placement=%s pid=%s why=%s",
                     self.registration.node_id, p.task_id, p.placement_id, p.pid, why)
            kill_group(p.pid, signal.SIGTERM)
            p.kill_at = deadline
        elif p.status == LocalStatus.RUNNING and deadline < p.kill_at:
            p.kill_at = deadline

    # -- the table ------------------------------------------------------------------------
    def recover(self) -> None:
        """Adopt the placements a previous daemon left in the work dir."""
        for directory in sorted((self.cfg.work_dir / "placements").iterdir()):
            p = LocalPlacement.load(directory)
            if p is None or p.status == LocalStatus.DONE:
                continue
            self.placements[p.placement_id] = p
            log.info("placement recovered node=%s task=%s placement=%s status=%s pid=%s",
                     self.registration.node_id, p.task_id, p.placement_id, p.status, p.pid)

    def forget(self, p: LocalPlacement, keep_dir: bool = False) -> None:
        self.placements.pop(p.placement_id, None)
        self.claims.delete_job(p.placement_id)
        if not keep_dir:
            shutil.rmtree(p.directory, ignore_errors=True)
