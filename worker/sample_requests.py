"""Samples on demand, the daemon's part (issue 44): while the node has room, claim a sample request
from the service (POST /internal/v1/sample_requests/claim, under a lease), fetch its adapters into
work_dir/samples/<id>, and answer it on an idle shared executor of its base model (worker.host's
"sample" request) or, without one, in a fresh `python -m worker.sampler` process on a free slot.
The lease is renewed while it runs; the outcome is reported once; a process that died, or a
daemon that stops, gives the request back retryably (the service queues it again)."""

from __future__ import annotations

import logging
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen

from contract.sample_requests import (
    SampleAck,
    SampleClaim,
    SampleFailure,
    SampleLease,
    SampleResult,
    SampleWork,
)
from worker import host as shared
from worker.config import DaemonConfig
from worker.host import HostState
from worker.local_state import LocalHost, LocalPlacement, LocalStatus
from worker.processes import ForkedProcess, kill_group, spawn
from worker.registration import Registration
from worker.sampler import ADAPTERS_NAME, WORK_NAME, read_result
from worker.service_client import ServiceClient, ServiceError
from worker.shared_hosts import SPARE_KEY, SharedHosts

log = logging.getLogger("loraplex.worker.samples")


@dataclass
class SampleRun:
    work: SampleWork
    directory: Path
    slot: list[int]
    host: LocalHost | None = None  # the shared executor answering it, else proc
    proc: Popen | ForkedProcess | None = None
    renew_at: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.monotonic)


class SampleRequests:
    """At most one sample request at a time on this node (it is seconds of work)."""

    def __init__(self, cfg: DaemonConfig, client: ServiceClient, registration: Registration,
                 placements: dict[str, LocalPlacement], hosts: SharedHosts) -> None:
        self.cfg, self.client, self.registration = cfg, client, registration
        self.placements, self.shared = placements, hosts
        self.run: SampleRun | None = None
        self.next_poll = 0.0
        self.root = cfg.work_dir / "samples"

    @property
    def busy(self) -> bool:
        return self.run is not None

    @property
    def slot(self) -> list[int]:
        """The slot a sampler process of this node holds now (none on a shared executor)."""
        run = self.run
        return list(run.slot) if run is not None and run.host is None else []

    def recover(self) -> None:
        """A previous daemon's requests are not resumed: their leases end and the service queues
        them again."""
        shutil.rmtree(self.root, ignore_errors=True)

    def tend(self, accepting: bool) -> None:
        if self.run is not None:
            self._watch(self.run)
        elif accepting and time.monotonic() >= self.next_poll:
            self.next_poll = time.monotonic() + self.cfg.sample_poll_s
            self._claim()

    def stop(self, why: str) -> None:
        """The daemon stops: the request under way goes back to the service, retryably."""
        if self.run is not None:
            self._give_back(self.run, f"the node stopped ({why})")

    # -- where it may run ---------------------------------------------------------------------
    def _idle_hosts(self) -> list[LocalHost]:
        return [h for h in self.shared.hosts.values()
                if not h.closing and h.exit_code() is None and not self.shared.hosted(h)
                and h.status().get("state") == HostState.SERVING]

    def _free_slot(self) -> list[int] | None:
        """A slot (GPU, or a CPU node's slot) no placement and no shared executor holds."""
        node = self.registration.node
        taken = self.shared.placement_gpus()
        # a spare holds no model: a sampler process may share its GPU
        taken |= {g for h in self.shared.hosts.values() if h.key != SPARE_KEY for g in h.gpu_indices}
        if any(p.status == LocalStatus.POPPED for p in self.placements.values()):
            return None  # a placement whose slots are not known yet: it goes first
        free = [g for g in range(node.gpu_count if node is not None else 0) if g not in taken]
        return free[:1] or None

    # -- a request's life ---------------------------------------------------------------------
    def _claim(self) -> None:
        idle, slot = self._idle_hosts(), self._free_slot()
        if not idle and slot is None:
            return
        warm = sorted({h.key.split("|", 1)[0] for h in idle})
        try:
            r = self.client.request("POST", "/internal/v1/sample_requests/claim", attempts=1,
                                    body=SampleClaim(node_id=self.registration.node_id or "",
                                                     warm_models=warm).model_dump(mode="json"))
        except ServiceError as exc:
            log.warning("sample claim failed node=%s error=%s", self.registration.node_id, exc)
            return
        if r.status_code == 204:
            return
        try:
            work = SampleWork.model_validate(r.json())
        except ValueError as exc:  # pydantic's ValidationError and JSON's errors are ValueErrors
            # a service of another version, or a proxy's page: the daemon keeps its placements
            # going and asks again at the next poll (nothing was leased to it that it knows of)
            log.warning("sample claim answer not understood node=%s status=%d error=%s",
                        self.registration.node_id, r.status_code, type(exc).__name__)
            return
        directory = self.root / work.request_id
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        (directory / WORK_NAME).write_text(work.model_dump_json())
        host = next((h for h in idle if h.key.split("|", 1)[0] == work.base_model), None)
        run = SampleRun(work, directory, slot or [], host=host)
        self.run = run
        log.info("sample request claimed node=%s request=%s task=%s attempt=%d on=%s",
                 self.registration.node_id, work.request_id, work.task_id, work.attempt,
                 host.host_id if host else f"slot {slot}")
        try:
            for a in work.adapters:
                for url in a.files:
                    self.client.download(url, directory / ADAPTERS_NAME / a.job_id / url.rsplit("/", 1)[-1])
        except ServiceError as exc:
            self._give_back(run, f"could not fetch the adapters ({exc.status or 'unreachable'})")
            return
        if host is None and slot is None:
            self._give_back(run, "no room on the node")
        elif host is not None:
            shared.send(host.directory, {"op": "sample", "dir": str(directory)})
        else:
            run.proc = spawn(self.cfg.sampler_module, "--dir", directory, run.slot, "sampler.log",
                             cuda=self.registration.cuda, cache_dir=self.cfg.work_dir / "cache",
                             zygote=self.shared.zygote.current())

    def _watch(self, run: SampleRun) -> None:
        result = read_result(run.directory)
        if result is not None:
            if result.get("refused"):  # the shared executor took a task meanwhile
                self._give_back(run, str(result["refused"]))
            elif "samples" in result:
                self._report(run, "result", SampleResult(lease_token=run.work.lease_token,
                                                         samples=result["samples"]))
            else:
                self._report(run, "failed", SampleFailure(lease_token=run.work.lease_token,
                                                          error=str(result.get("error") or "failed")))
            return
        gone = (run.proc.poll() is not None) if run.proc is not None else (
            run.host is None or run.host.exit_code() is not None)
        if gone and read_result(run.directory) is None:
            self._give_back(run, "the sampling process exited before it answered")
            return
        if time.monotonic() - run.started > self.cfg.sample_timeout_s:
            self._give_back(run, f"the sampling took over {self.cfg.sample_timeout_s:.0f} s")
            return
        if time.monotonic() >= run.renew_at:
            run.renew_at = time.monotonic() + run.work.lease_s / 3
            ack = self._post(run, "lease", SampleLease(lease_token=run.work.lease_token))
            if ack is not None and not ack.mine:  # the service gave it to another claim
                log.info("sample request no longer ours request=%s", run.work.request_id)
                self._end(run)

    def _give_back(self, run: SampleRun, why: str) -> None:
        self._report(run, "failed", SampleFailure(lease_token=run.work.lease_token, error=why,
                                                  retryable=True))

    def _report(self, run: SampleRun, outcome: str, msg: SampleResult | SampleFailure) -> None:
        ack = self._post(run, outcome, msg)
        if ack is not None:
            log.info("sample request reported request=%s outcome=%s state=%s mine=%s",
                     run.work.request_id, outcome, ack.state, ack.mine)
        # unreachable service: the lease ends and the request is queued again
        self._end(run)

    def _post(self, run: SampleRun, what: str, msg: object) -> SampleAck | None:
        try:
            r = self.client.request("POST", f"/internal/v1/sample_requests/{run.work.request_id}/{what}",
                                    body=msg.model_dump(mode="json"))  # type: ignore[attr-defined]
            return SampleAck.model_validate(r.json())
        except ServiceError as exc:
            log.warning("sample report failed request=%s what=%s error=%s", run.work.request_id,
                        what, exc)
            return None

    def _end(self, run: SampleRun) -> None:
        if run.proc is not None and run.proc.poll() is None:
            kill_group(run.proc.pid, signal.SIGKILL)
            run.proc.wait(timeout=10)
        shutil.rmtree(run.directory, ignore_errors=True)
        self.run = None
