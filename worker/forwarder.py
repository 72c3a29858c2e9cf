"""The daemon's side of a spool: ships one placement's records to the service, in order and
resumably (its offset in forward.json; a restart resends at most the last batch, and every
report is idempotent at the service: events by client_key "<placement>:<offset>", metrics by
(job, step, split), artifacts by key; job states, task ends, throughput accept repeats).
Reports name the forwarder's placement (= attempt): the service refuses another attempt's with
a 409, which the forwarder drops."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from contract.protocol import (
    CARRY_UNAVAILABLE,
    REPORTS,
    ArtifactMeta,
    EventIn,
    JobStateUpdate,
    MetricPointIn,
    PlacementSpec,
    Report,
)
from worker.checkpoint_links import STATE_NAME
from worker.service_client import Backoff, ServiceClient, ServiceError
from worker.spool import SPOOL_NAME, TERMINAL_TYPES, read_complete_lines

log = logging.getLogger("loraplex.worker.client")
_Report = TypeVar("_Report")

FORWARD_STATE_NAME = "forward.json"


@dataclass
class ForwardState:
    offset: int = 0
    terminal: str | None = None  # "finished" / "failed" once that report is delivered
    dropped: int = 0
    # the last checkpoint the service stored for this placement (or the one it resumed from):
    # {"artifact_id", "files": [names], "dir"}; the next one carries the files of the same name
    checkpoint: dict | None = None

    @classmethod
    def load(cls, path: Path) -> ForwardState:
        try:
            return cls(**json.loads(path.read_text()))
        except (FileNotFoundError, ValueError, TypeError):
            return cls()

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.__dict__))
        os.replace(tmp, path)


@dataclass
class Forwarder:
    """Daemon side: ships new spool records of one placement, in order, batching consecutive
    events and metric points. pump() never blocks on a sick service: on a retryable error it
    schedules the next try with backoff and returns."""

    client: ServiceClient
    directory: Path
    task_id: str
    placement_id: str
    batch_lines: int = 500
    backoff: Backoff = field(default_factory=Backoff)
    clock: Callable[[], float] = time.monotonic
    state: ForwardState = field(init=False)
    failures: int = field(default=0, init=False)
    next_try_at: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        fresh = not self.state_path.exists()
        self.state = ForwardState.load(self.state_path)
        if fresh:  # the checkpoint this placement resumes from is the first one to carry from
            self.state.checkpoint = _resumed_from(self.directory)

    @property
    def spool_path(self) -> Path:
        return self.directory / SPOOL_NAME

    @property
    def state_path(self) -> Path:
        return self.directory / FORWARD_STATE_NAME

    @property
    def done(self) -> bool:
        return self.state.terminal is not None

    def pending(self) -> bool:
        """Whether complete, unforwarded lines wait in the spool."""
        return bool(read_complete_lines(self.spool_path, self.state.offset, 1))

    def pump(self) -> int:
        """Forward what is in the spool now; returns how many records were delivered."""
        if self.done or self.clock() < self.next_try_at:
            return 0
        delivered = 0
        while not self.done:
            lines = read_complete_lines(self.spool_path, self.state.offset, self.batch_lines)
            if not lines:
                break
            try:
                delivered += self._deliver(lines)
            except ServiceError as exc:
                self.failures += 1
                self.next_try_at = self.clock() + self.backoff.delay(self.failures - 1)
                log.warning("forward deferred task=%s placement=%s failures=%d error=%s",
                            self.task_id, self.placement_id, self.failures, exc)
                break
            self.failures = 0
        return delivered

    def _deliver(self, lines: list[tuple[int, int, str]]) -> int:
        """Deliver a run of records: a batch of leading events/metrics, or one other record."""
        events: list[EventIn] = []
        points: list[MetricPointIn] = []
        end = self.state.offset
        for start, stop, text in lines:
            record = _parse(text)
            kind = record.get("type") if record else None
            if kind == "event":
                events.append(EventIn.model_validate(
                    record["event"] | {"client_key": f"{self.placement_id}:{start}"}))
            elif kind == "metric":
                points.append(MetricPointIn.model_validate(record["point"]))
            elif record is None or kind not in ("job_state", "artifact", *REPORTS):
                log.warning("spool record skipped task=%s placement=%s offset=%d",
                            self.task_id, self.placement_id, start)
                self.state.dropped += 1
            elif events or points:
                break  # flush the batch before a record that depends on order
            else:
                self._one(record)
                self._advance(stop)
                return 1
            end = stop
        if events:
            self._tolerate(lambda: self.client.post_events(self.task_id, self.placement_id,
                                                           events), "events")
        if points:
            self._tolerate(lambda: self.client.post_metrics(self.task_id, self.placement_id,
                                                            points), "metrics")
        self._advance(end)
        return len(events) + len(points)

    def _one(self, record: dict) -> None:
        kind = record["type"]
        if kind == "job_state":
            update = self._message(JobStateUpdate, record.get("update"), kind)
            job_id = record.get("job_id")
            if update is not None and isinstance(job_id, str):
                self._tolerate(lambda: self.client.job_state(job_id, update), "job_state")
            elif update is not None:
                self.state.dropped += 1
        elif kind == "artifact":
            meta = self._message(ArtifactMeta, record.get("meta"), kind)
            if meta is None:
                return
            directory = self.directory / record["dir"]
            if not directory.is_dir():
                log.error("artifact dir missing task=%s placement=%s dir=%s", self.task_id,
                          self.placement_id, directory)
                self.state.dropped += 1
                return
            if meta.kind == "checkpoint":
                self._tolerate(lambda: self._checkpoint(meta, record["dir"]), "artifact")
            else:
                self._tolerate(lambda: self.client.upload_artifact(self.task_id, meta, directory),
                               "artifact")
        else:
            self._report(REPORTS[kind], record)

    def _checkpoint(self, meta: ArtifactMeta, rel: str) -> None:
        """Upload a checkpoint, sending only what the service does not hold: its job files
        named as in the last checkpoint stored are carried (a job file's name is its content:
        written once, never changed); state.pt always goes. A carry the service cannot honour
        (that checkpoint gone) is answered by uploading every file. Then the folder of the one
        stored before goes (its links would keep superseded job files on disk); this one stays
        for a retry on this node (worker.local_resume)."""
        directory = self.directory / rel
        last = self.state.checkpoint or {}
        names = {p.name for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")}
        # state.pt: the one file of a checkpoint that changes under its name, never carried
        carry = sorted(names & set(last.get("files", [])) - {STATE_NAME})
        out = None
        if carry:
            try:
                out = self.client.upload_artifact(
                    self.task_id, meta.model_copy(update={"carry_from": last["artifact_id"],
                                                          "carried": carry}),
                    directory, skip=frozenset(carry))
            except ServiceError as exc:
                if exc.code != CARRY_UNAVAILABLE:
                    raise
                log.warning("carry refused task=%s placement=%s from=%s: uploading every file",
                            self.task_id, self.placement_id, last["artifact_id"])
        if out is None:
            out = self.client.upload_artifact(self.task_id, meta, directory)
        if not isinstance(out, dict) or not isinstance(out.get("artifact_id"), str):
            self.state.checkpoint = None  # an answer without its listing: nothing to carry from
            return
        self.state.checkpoint = {"artifact_id": out["artifact_id"], "dir": rel,
                                 "files": [f["name"] for f in out.get("files", [])]}
        if last.get("dir") not in (None, rel):
            shutil.rmtree(self.directory / last["dir"], ignore_errors=True)

    def _message(self, shape: type[_Report], fields: object, kind: str) -> _Report | None:
        """The report of a spool record, in this forwarder's placement (the attempt the service
        fences on, whatever the record says); a record the contract refuses is dropped."""
        try:
            return shape.model_validate(dict(fields or {}) | {"placement_id": self.placement_id})
        except (ValueError, TypeError) as exc:
            self.state.dropped += 1
            log.warning("%s record dropped task=%s placement=%s error=%s", kind, self.task_id,
                        self.placement_id, str(exc).splitlines()[0] if str(exc) else exc)
            return None

    def _report(self, report: Report, record: dict) -> None:
        """A one-message report (contract.protocol.REPORTS): its fields are the record's
        "report" (or, in a record written before that key, the record itself). A record the
        contract refuses is dropped, never allowed to stall the reports behind it; a task's end
        is this forwarder's last report either way."""
        fields = record.get("report")
        if not isinstance(fields, dict):
            fields = {k: v for k, v in record.items() if k != "type"}
        msg = self._message(report.message, fields, report.kind)
        if msg is not None:
            self._tolerate(lambda: self.client.report(report, self.task_id, msg), report.kind)
        if report.kind in TERMINAL_TYPES:
            self.state.terminal = report.kind

    def _tolerate(self, call: Callable[[], object], what: str) -> None:
        """Run a report; a permanent refusal (task cancelled, stale placement) is logged and
        skipped, since retrying it can never succeed; retryable errors propagate."""
        try:
            call()
        except ServiceError as exc:
            if exc.retryable:
                raise
            self.state.dropped += 1
            log.warning("report refused task=%s placement=%s what=%s status=%s code=%s message=%s",
                        self.task_id, self.placement_id, what, exc.status, exc.code, str(exc)[:300])

    def _advance(self, offset: int) -> None:
        self.state.offset = offset
        self.state.save(self.state_path)


def _resumed_from(directory: Path) -> dict | None:
    """The checkpoint artifact the placement's spec resumes from, as ForwardState keeps it."""
    try:
        spec = PlacementSpec.model_validate_json((directory / "spec.json").read_text())
    except (OSError, ValueError):
        return None
    if spec.resume_checkpoint_artifact_id is None:
        return None
    return {"artifact_id": spec.resume_checkpoint_artifact_id,
            "files": [url.rsplit("/", 1)[-1] for url in spec.resume_checkpoint_files]}


def _parse(text: str) -> dict | None:
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None

