"""Co-location: one-GPU placements of one model share an executor process (worker.host, folder
work_dir/hosts/<id>) serving their colocation_key on their GPUs. SharedHosts starts, attaches
to, detaches from, tends and reports those processes."""

from __future__ import annotations

import logging
import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from contract.protocol import ExecutorReport, PlacementSpec
from contract.states import TaskOutcome
from worker import host as shared
from worker.config import DaemonConfig
from worker.host import HostState
from worker.local_resume import seed_before_start
from worker.local_state import LocalHost, LocalPlacement, LocalStatus
from worker.processes import LEASE_NAME, NodeZygote, kill_group, spawn, touch
from worker.registration import Registration

log = logging.getLogger("loraplex.worker.daemon")
# a spare's key until the daemon gives it its first task (worker.host --spare)
SPARE_KEY = ""
# The least time a placement gets to leave a shared executor (a detach waits for the step and
# the evaluation under way) before the executor counts as wedged and is stopped as a whole.
HOSTED_GRACE_S = 60.0


class SharedHosts:
    """The shared executors of this node. A one-GPU placement attaches to the live one of its
    model on its GPUs, else a new one is started (an idle one of another model on those GPUs is
    stopped first; one that hosts tasks is waited for, never killed). Each hosted placement keeps
    its own folder, spool, forwarding and fencing; a cancel or pause detaches it alone; a crash
    of the shared executor fails every hosted placement retryably (each resumes from its own
    checkpoint). The heartbeat reports them (Heartbeat.executors) so the scheduler can join a
    task to a warm one."""

    def __init__(self, cfg: DaemonConfig, registration: Registration,
                 placements: dict[str, LocalPlacement], zygote: NodeZygote | None = None) -> None:
        self.cfg, self.registration, self.placements = cfg, registration, placements
        # the node's executor processes are forked there once it is ready (worker.zygote)
        self.zygote = zygote or NodeZygote("off", cfg.work_dir)
        self.hosts: dict[str, LocalHost] = {}
        # spares that died unasked in a row, and when the next may start (a broken environment
        # does not start one every tick)
        self.spare_failures, self.spare_after = 0, 0.0

    def colocation_key(self, spec: PlacementSpec) -> str | None:
        """The key of the shared executor this placement may join; None: it runs alone
        (adapter parallelism, co-location off, or a runner module other than worker.runner)."""
        if not self.colocation_enabled():
            return None
        if len(spec.gpu_indices) > 1:  # adapter parallelism: one task per executor
            return None
        return shared.spec_key(spec)

    def joinable(self, p: LocalPlacement, key: str) -> LocalHost | None:
        """The live shared executor of key on exactly p's GPUs that p may attach to."""
        for h in self.hosts.values():
            if (h.key == key and h.gpu_indices == list(p.gpu_indices) and not h.closing
                    and h.host_id not in p.refused_by and h.exit_code() is None
                    and h.status().get("state") not in (HostState.STOPPING, HostState.CLOSED)):
                return h
        return None

    # -- spares: warmed-up executors on free GPUs, for the next task whatever its model ------
    def spares_on(self) -> bool:
        mode = self.cfg.spare_hosts
        return (mode == "on" or (mode == "auto" and self.registration.cuda)) and \
            self.colocation_enabled()

    def colocation_enabled(self) -> bool:
        return self.cfg.colocate and self.cfg.runner_module == "worker.runner"

    def spare_for(self, p: LocalPlacement) -> LocalHost | None:
        """A live spare on exactly p's GPUs (warmed up or still warming: its first request
        waits in its inbox)."""
        for h in self.hosts.values():
            if (h.key == SPARE_KEY and h.gpu_indices == list(p.gpu_indices) and not h.closing
                    and h.exit_code() is None):
                return h
        return None

    def adopt(self, h: LocalHost, p: LocalPlacement, key: str) -> None:
        """The spare h takes p as its first task: it serves p's model from now on."""
        h.key, self.spare_failures = key, 0
        h.save()  # before the request: a restarted daemon sees a host of this model
        self.attach(h, p)
        log.info("spare executor adopted node=%s host=%s pid=%s key=%s placement=%s",
                 self.registration.node_id, h.host_id, h.pid, key, p.placement_id)

    def keep_spares(self, also: Sequence[int] = ()) -> None:
        """A spare on each of the node's GPUs that no placement, no shared executor and none of
        `also` (a sampler process's slot) holds."""
        node = self.registration.node
        if node is None or not self.spares_on() or time.monotonic() < self.spare_after:
            return
        held = self.placement_gpus() | set(also) | {g for h in self.hosts.values() for g in h.gpu_indices}
        for g in range(node.gpu_count):
            if g not in held:
                h = self._new_host(self.cfg.work_dir / "hosts" / f"spare-{time.time_ns()}", SPARE_KEY, [g])
                self._spawn(h, ["--spare"])
                log.info("spare executor started node=%s host=%s pid=%d gpus=%s",
                         self.registration.node_id, h.host_id, h.pid, h.gpu_indices)

    def placement_gpus(self) -> set[int]:
        """The GPUs (a CPU node's slots) this node's placements hold, the ones not done."""
        return {g for p in self.placements.values() if p.status != LocalStatus.DONE for g in p.gpu_indices}

    def make_room(self, p: LocalPlacement) -> bool:
        """Whether no shared executor holds p's GPUs; the idle ones that do are stopped."""
        gpus = set(p.gpu_indices)
        overlapping = [h for h in self.hosts.values() if gpus & set(h.gpu_indices)]
        for h in overlapping:
            if not self.hosted(h):
                self.stop(h, f"GPUs {sorted(gpus)} wanted by placement {p.placement_id}")
        return not overlapping  # else wait until they have exited

    def start(self, p: LocalPlacement, key: str) -> None:
        """A new shared executor whose first task is p (its spec sets the executor's model)."""
        directory = self.cfg.work_dir / "hosts" / f"host-{p.placement_id}"
        shutil.rmtree(directory, ignore_errors=True)  # a previous try of this placement's
        h = self._new_host(directory, key, list(p.gpu_indices))
        self.attach(h, p)  # the request is there before the process looks for it
        p.pid = self._spawn(h).pid
        p.save()
        log.info("shared executor started node=%s host=%s pid=%d key=%s gpus=%s first=%s",
                 self.registration.node_id, h.host_id, h.pid, key, h.gpu_indices or "-",
                 p.placement_id)

    def _new_host(self, directory: Path, key: str, gpus: list[int]) -> LocalHost:
        """A shared executor's folder, record and lease, before its process: a restarted daemon
        finds it (its pid then in status.json)."""
        directory.mkdir(parents=True)
        h = LocalHost(host_id=directory.name, directory=directory, key=key, gpu_indices=gpus)
        h.save()
        self.hosts[h.host_id] = h
        touch(directory / LEASE_NAME)
        return h

    def _spawn(self, h: LocalHost, extra: Sequence[str] = ()) -> LocalHost:
        h.proc = spawn(self.cfg.host_module, "--host-dir", h.directory, h.gpu_indices, "host.log", extra,
                       cuda=self.registration.cuda, cache_dir=self.cfg.work_dir / "cache",
                       zygote=self.zygote.current())
        h.pid = h.proc.pid
        h.save()
        return h

    def attach(self, h: LocalHost, p: LocalPlacement) -> None:
        seed_before_start(p, self.cfg.work_dir / "placements", self.registration.node_id)
        touch(p.directory / LEASE_NAME)
        shared.send(h.directory, {"op": "attach", "placement_id": p.placement_id,
                                  "placement_dir": str(p.directory)})
        # its executor's pid is the shared one (never signalled for this placement alone)
        p.host_id, p.pid, p.status, p.kill_at = h.host_id, h.pid, LocalStatus.RUNNING, None
        p.save()
        h.stop_when_idle = False
        log.info("placement attached node=%s task=%s placement=%s host=%s",
                 self.registration.node_id, p.task_id, p.placement_id, h.host_id)

    def hosted(self, h: LocalHost) -> list[LocalPlacement]:
        return [p for p in self.placements.values()
                if p.host_id == h.host_id and p.status == LocalStatus.RUNNING]

    def stop(self, h: LocalHost, why: str) -> None:
        """SIGTERM: its tasks checkpoint and stop, it takes no new one; SIGKILL after the stop
        timeout (its tasks' own records then fail them retryably)."""
        if h.closing:
            return
        h.closing = True
        h.save()
        h.kill_at = time.monotonic() + self.cfg.stop_timeout_s
        log.info("shared executor stopping node=%s host=%s pid=%s why=%s",
                 self.registration.node_id, h.host_id, h.pid, why)
        kill_group(h.pid, signal.SIGTERM)

    def tend(self, winding_down: str | None) -> None:
        """Keep live shared executors' leases fresh, kill one past its stop deadline, stop idle
        ones (after a pause, or of a daemon winding_down: "draining" or "stopping"), and forget
        one that has exited with no placement left on it."""
        for h in list(self.hosts.values()):
            if h.exit_code() is None:
                touch(h.directory / LEASE_NAME)
                if (winding_down or h.stop_when_idle) and not self.hosted(h):
                    self.stop(h, "idle after a pause" if h.stop_when_idle
                              else f"node daemon {winding_down}")
                if h.kill_at is not None and time.monotonic() >= h.kill_at:
                    log.warning("shared executor killed node=%s host=%s pid=%s",
                                self.registration.node_id, h.host_id, h.pid)
                    kill_group(h.pid, signal.SIGKILL)
                    h.kill_at = None
            elif not self.hosted(h):
                if h.key == SPARE_KEY and not h.closing:  # it died before any task came
                    self.spare_failures += 1
                    self.spare_after = time.monotonic() + min(600.0, 5.0 * 2 ** self.spare_failures)
                    log.warning("spare executor died node=%s host=%s code=%s failures=%d",
                                self.registration.node_id, h.host_id, h.exit_code(),
                                self.spare_failures)
                del self.hosts[h.host_id]
                shutil.rmtree(h.directory, ignore_errors=True)
                log.info("shared executor gone node=%s host=%s", self.registration.node_id,
                         h.host_id)

    def reports(self) -> tuple[ExecutorReport, ...]:
        """The shared executors another task of the same model may join (Heartbeat.executors)."""
        reports = []
        for h in self.hosts.values():
            status = h.status()
            if (h.closing or status.get("state") in (HostState.STOPPING, HostState.CLOSED)
                    or h.exit_code() is not None or h.key == SPARE_KEY):
                continue  # a spare serves no model yet: the scheduler joins nothing to it
            reports.append(ExecutorReport(
                key=h.key, gpu_indices=h.gpu_indices,
                placement_ids=[p.placement_id for p in self.hosted(h)],
                free_rows=int(status.get("free_rows") or 0),
                total_rows=int(status.get("total_rows") or 0),
                queued_jobs=int(status.get("queued_jobs") or 0)))
        return tuple(reports)

    # -- one hosted placement ----------------------------------------------------------------
    def exit_code(self, p: LocalPlacement) -> int | str | None:
        """0 once p has left its shared executor, else the executor's (None while alive)."""
        h = self.hosts.get(p.host_id or "")
        code = h.exit_code() if h is not None else "lost"
        ended = (h.status().get("ended") or {}) if h is not None else {}
        return 0 if p.placement_id in ended else code

    def never_joined(self, p: LocalPlacement) -> bool:
        """A placement sent to a shared executor that refused it (closing, or it cannot share)
        or exited before taking it: back to ready, so the next tick places it again."""
        h = self.hosts.get(p.host_id or "")
        gone = h is None or h.exit_code() is not None  # before reading: its last status then
        status = h.status() if h is not None else {}
        refused = (status.get("refused") or {}).get(p.placement_id)
        if refused is None and not (gone and p.placement_id not in status.get("accepted", [])):
            return False
        log.info("placement not taken node=%s task=%s placement=%s host=%s why=%s",
                 self.registration.node_id, p.task_id, p.placement_id, p.host_id,
                 refused or "the shared executor exited first")
        if refused is not None and p.host_id is not None:
            p.refused_by.add(p.host_id)
        p.host_id, p.status, p.kill_at = None, LocalStatus.READY, None
        p.save()
        return True

    def detach(self, p: LocalPlacement, why: str, grace_s: float, again: bool = False) -> None:
        """Ask p's shared executor to take p alone off at its next step boundary, with a
        checkpoint (the others train on). Past the grace (at least HOSTED_GRACE_S: the step and
        evaluation under way end first), detach_overdue. Sent once (again: a stop after a
        pause)."""
        h = self.hosts.get(p.host_id or "")
        deadline = time.monotonic() + max(grace_s, HOSTED_GRACE_S)
        if h is not None and why.startswith("paused"):
            h.stop_when_idle = True
        if p.kill_at is None or again:
            if h is not None:
                shared.send(h.directory, {"op": "detach", "placement_id": p.placement_id,
                                          "outcome": TaskOutcome.PAUSED, "reason": why})
            log.info("placement detaching node=%s task=%s placement=%s host=%s why=%s",
                     self.registration.node_id, p.task_id, p.placement_id, p.host_id, why)
        if p.kill_at is None or deadline < p.kill_at:
            p.kill_at = deadline

    def detach_overdue(self, p: LocalPlacement) -> None:
        """A hosted placement that did not leave its shared executor within the grace: the
        executor is wedged (no step boundary came), so it is stopped as a whole, as a runner
        would be killed; every task on it stops (or fails) retryably and resumes from its own
        checkpoint."""
        p.kill_at = None
        h = self.hosts.get(p.host_id or "")
        log.warning("placement overdue node=%s task=%s placement=%s host=%s",
                    self.registration.node_id, p.task_id, p.placement_id, p.host_id)
        if h is not None:
            self.stop(h, f"placement {p.placement_id} did not leave it within the grace")

    def recover(self) -> None:
        """Adopt the shared executors a previous daemon left in the work dir."""
        for directory in sorted((self.cfg.work_dir / "hosts").iterdir()):
            h = LocalHost.load(directory)
            if h is None:  # it died while being started: its placements go back to ready
                shutil.rmtree(directory, ignore_errors=True)
                continue
            if h.closing:  # it was asked to stop: it gets the stop timeout again
                h.kill_at = time.monotonic() + self.cfg.stop_timeout_s
            self.hosts[h.host_id] = h
            log.info("shared executor recovered node=%s host=%s pid=%s key=%s",
                     self.registration.node_id, h.host_id, h.pid, h.key)
