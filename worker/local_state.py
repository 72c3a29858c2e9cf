"""What the daemon keeps in its work dir of each placement (placements/<id>/daemon.json) and each
shared executor (hosts/<id>/daemon.json), so a daemon killed at any line and restarted adopts
its still-running executors."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from contract.states import StrEnum
from worker import host as shared
from worker.forwarder import Forwarder
from worker.processes import ForkedProcess, exit_code_of
from worker.spool import SPOOL_NAME, TERMINAL_TYPES, SpoolWriter, read_complete_lines


class LocalStatus(StrEnum):
    """Where the daemon is with a placement: popped -> ready -> running -> exited -> done (a
    shared executor that would not take it puts it back to ready; one never started is done)."""

    POPPED = "popped"  # taken off the node queue, not claimed from the service yet
    READY = "ready"  # claimed: its spec and inputs are here
    RUNNING = "running"  # its executor (its own process, or a shared one) runs it
    EXITED = "exited"  # its executor left; its spool is still being forwarded
    DONE = "done"  # every report delivered: its folder goes


CLAIMED = (LocalStatus.READY, LocalStatus.RUNNING, LocalStatus.EXITED)  # the service gave it us


@dataclass
class LocalPlacement:
    """What the daemon knows of one placement; persisted as daemon.json in its folder."""

    placement_id: str
    directory: Path
    status: str = LocalStatus.POPPED
    task_id: str | None = None
    gpu_indices: list[int] = field(default_factory=list)
    pid: int | None = None
    host_id: str | None = None  # the shared executor it is attached to (None: its own process)
    # The service stopped this attempt (cancelled, superseded, failed or finished there): it
    # takes no more reports from it, so the daemon stops it and ends it without a word.
    cancelled: bool = False
    proc: subprocess.Popen | ForkedProcess | None = field(default=None, repr=False)
    forwarder: Forwarder | None = field(default=None, repr=False)
    kill_at: float | None = None
    next_claim_at: float = 0.0
    claim_failures: int = 0
    refused_by: set[str] = field(default_factory=set)  # shared executors that would not take it

    def save(self) -> None:
        data = {k: getattr(self, k) for k in ("placement_id", "status", "task_id",
                                              "gpu_indices", "pid", "host_id", "cancelled")}
        tmp = self.directory / "daemon.json.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.directory / "daemon.json")

    @classmethod
    def load(cls, directory: Path) -> LocalPlacement | None:
        data = _read_json(directory / "daemon.json")
        return None if data is None else cls(directory=directory, **data)

    def spool_has_terminal(self) -> bool:
        """Whether its executor's final word (finished, failed) is in its spool."""
        start = self.forwarder.state.offset if self.forwarder else 0
        if self.forwarder is not None and self.forwarder.done:
            return True
        for _, _, text in read_complete_lines(self.directory / SPOOL_NAME, start, 1 << 30):
            if any(f'"type":"{t}"' in text for t in TERMINAL_TYPES):
                return True
        return False

    def close_with_failure(self, task_id: str, error: str) -> None:
        """End a placement (still current) whose executor left no final word: the daemon
        writes it to the spool itself, so delivery goes through the same durable, resumable
        path."""
        writer = SpoolWriter(self.directory / SPOOL_NAME)
        try:
            writer.event("executor_failed", error[:10_000], level="error")
            writer.failed(error, retryable=True)
        finally:
            writer.close()
        self.task_id = self.task_id or task_id
        self.status = LocalStatus.EXITED
        self.save()


@dataclass
class LocalHost:
    """A shared executor process (worker.host) on this node: one colocation_key on one GPU set;
    persisted as daemon.json in its folder (work_dir/hosts/<host_id>)."""

    host_id: str
    directory: Path
    key: str
    gpu_indices: list[int]
    pid: int | None = None
    closing: bool = False  # asked to stop (SIGTERM): it takes no more placements
    proc: subprocess.Popen | ForkedProcess | None = field(default=None, repr=False)
    kill_at: float | None = None
    # a pause or preemption gives the GPUs back: once nothing is left on it, it does not linger
    stop_when_idle: bool = False

    def save(self) -> None:
        shared.write_json(self.directory / "daemon.json", {
            k: getattr(self, k) for k in ("host_id", "key", "gpu_indices", "pid", "closing")})

    @classmethod
    def load(cls, directory: Path) -> LocalHost | None:
        data = _read_json(directory / "daemon.json")
        if data is None:
            return None
        host = cls(directory=directory, **data)
        if host.pid is None:  # the daemon stopped before it noted the pid; the host notes its own
            host.pid = shared.read_status(directory).get("pid")
        return host

    def status(self) -> dict:
        return shared.read_status(self.directory)

    def exit_code(self) -> int | str | None:
        """None while alive; its exit code (our child); 'lost' for an adopted pid that is gone."""
        if self.proc is not None:
            return self.proc.poll()
        return exit_code_of(self.pid, self.directory)



def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None

