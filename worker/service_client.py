"""How reports reach the service: the internal-API HTTP client (retried with backoff) and the
spool, a JSON-lines file an executor appends to and the daemon forwards from (resumable).

Spool records, one JSON object per line, in the order the executor produced them:
  {"type": "event", "event": EventIn fields (no client_key: the forwarder sets one)}
  {"type": "metric", "point": MetricPointIn fields}
  {"type": "job_state", "job_id": ..., "update": JobStateUpdate fields but placement_id}
  {"type": "artifact", "dir": "<dir under the placement dir>", "meta": ArtifactMeta fields but
   placement_id}
  {"type": "throughput", "report": ThroughputReport fields but placement_id (the forwarder's)}
  {"type": "finished", "best_job_id": ..., "summary": {...}}   (TaskFinished)
  {"type": "failed", "error": "...", "retryable": true}         (TaskFailed)
Every report names the forwarder's placement (= attempt): the service stores only the current
attempt's reports and refuses the others with a 409, which the forwarder drops.
Only complete lines count, so a writer killed mid-line loses at most that line. The forwarder
keeps its byte offset in a state file next to the spool, written after each delivery; a
restart resends at most the last batch, and every report is idempotent on the service side
(events carry client_key "<placement>:<offset>", metrics dedupe on (job, step, split), artifacts
on their key, job states and task ends accept repeats, a throughput report replaces the profile
it measured with the same numbers).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from contract.protocol import (
    ArtifactMeta,
    ClaimRequest,
    EventBatch,
    EventIn,
    Heartbeat,
    HeartbeatResponse,
    JobStateUpdate,
    MetricBatch,
    MetricPointIn,
    NodeDeregister,
    NodeDeregistered,
    NodeRegister,
    NodeRegistered,
    PlacementSpec,
    TaskFailed,
    TaskFinished,
    ThroughputReport,
)

log = logging.getLogger("loraplex.worker.client")
_Report = TypeVar("_Report", JobStateUpdate, ArtifactMeta)

SPOOL_NAME = "spool.jsonl"
INIT_ADAPTER_ARCHIVE = "init_adapter.archive"
FORWARD_STATE_NAME = "forward.json"
TERMINAL_TYPES = ("finished", "failed")


class ServiceError(Exception):
    """A call the service answered with an error. retryable: worth trying again later."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None,
                 retryable: bool = True) -> None:
        super().__init__(message)
        self.status, self.code, self.retryable = status, code, retryable


@dataclass
class Backoff:
    """Exponential backoff with full jitter: delay(n) in [0, min(cap, base * factor**n)]."""

    base_s: float = 0.5
    factor: float = 2.0
    cap_s: float = 30.0
    jitter: bool = True

    def delay(self, attempt: int) -> float:
        top = min(self.cap_s, self.base_s * self.factor ** max(0, attempt))
        return random.uniform(top / 2, top) if self.jitter else top


def _retryable_status(status: int) -> bool:
    return status >= 500 or status in (408, 425, 429)


class ServiceClient:
    """The daemon's calls to /internal/v1 (worker token). Each call retries transport errors and
    5xx/429 up to ``attempts`` times with backoff; other 4xx raise ServiceError(retryable=False)."""

    def __init__(self, base_url: str, token: str, *, timeout_s: float = 30.0,
                 attempts: int = 5, backoff: Backoff | None = None,
                 transport: httpx.BaseTransport | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {token}"},
                                 transport=transport)
        self.attempts, self.backoff, self.sleep = attempts, backoff or Backoff(), sleep

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, *, body: Any = None, attempts: int | None = None,
                **kwargs: Any) -> httpx.Response:
        """Send with retries. body is JSON-encoded here (NaN allowed: losses can be NaN)."""
        if body is not None:
            kwargs["content"] = json.dumps(body).encode()
            kwargs.setdefault("headers", {})["Content-Type"] = "application/json"
        tries = attempts or self.attempts
        last: ServiceError | None = None
        for attempt in range(tries):
            if attempt:
                self.sleep(self.backoff.delay(attempt - 1))
            for part in kwargs.get("files") or ():
                part[1][1].seek(0)  # rewind multipart streams consumed by a failed try
            try:
                response = self.http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                last = ServiceError(f"{method} {path}: {type(exc).__name__}: {exc}")
                log.warning("service unreachable method=%s path=%s attempt=%d error=%s",
                            method, path, attempt + 1, exc)
                continue
            if response.status_code < 400:
                return response
            code, message = _error_of(response)
            last = ServiceError(f"{method} {path}: {response.status_code} {code}: {message}",
                                response.status_code, code,
                                _retryable_status(response.status_code))
            if not last.retryable:
                raise last
            log.warning("service error method=%s path=%s status=%d attempt=%d", method, path,
                        response.status_code, attempt + 1)
        assert last is not None
        raise last

    # -- nodes and placements -------------------------------------------------------------
    def register(self, msg: NodeRegister, attempts: int | None = None) -> NodeRegistered:
        r = self.request("POST", "/internal/v1/nodes", body=msg.model_dump(mode="json"),
                         attempts=attempts)
        return NodeRegistered.model_validate(r.json())

    def deregister(self, node_id: str, msg: NodeDeregister, attempts: int = 3
                   ) -> NodeDeregistered:
        r = self.request("POST", f"/internal/v1/nodes/{node_id}/deregister",
                         body=msg.model_dump(mode="json"), attempts=attempts)
        return NodeDeregistered.model_validate(r.json())

    def heartbeat(self, node_id: str, msg: Heartbeat, attempts: int = 1) -> HeartbeatResponse:
        r = self.request("POST", f"/internal/v1/nodes/{node_id}/heartbeat",
                         body=msg.model_dump(mode="json"), attempts=attempts)
        return HeartbeatResponse.model_validate(r.json())

    def claim(self, placement_id: str, node_id: str) -> PlacementSpec:
        r = self.request("POST", f"/internal/v1/placements/{placement_id}/claim",
                         body=ClaimRequest(node_id=node_id).model_dump())
        return PlacementSpec.model_validate(r.json())

    def download(self, url: str, dest: Path) -> Path:
        """GET a file URL of the spec into dest (atomically: tmp file, then rename)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        for attempt in range(self.attempts):
            if attempt:
                self.sleep(self.backoff.delay(attempt - 1))
            try:
                with self.http.stream("GET", url) as r:
                    if r.status_code >= 400:
                        r.read()
                        code, message = _error_of(r)
                        err = ServiceError(f"GET {url}: {r.status_code} {code}: {message}",
                                           r.status_code, code, _retryable_status(r.status_code))
                        if not err.retryable:
                            raise err
                        continue
                    with open(tmp, "wb") as out:
                        for block in r.iter_bytes(1 << 20):
                            out.write(block)
                os.replace(tmp, dest)
                return dest
            except httpx.TransportError as exc:
                log.warning("download failed url=%s attempt=%d error=%s", url, attempt + 1, exc)
        raise ServiceError(f"GET {url}: gave up after {self.attempts} attempts")

    def fetch_init_adapter(self, spec: PlacementSpec, data: Path, cache: Path) -> Path | None:
        """The placement's starting adapter archive (PlacementSpec.init_adapter_url), cached per
        file id like the training files, copied to data/INIT_ADAPTER_ARCHIVE (the runner unpacks
        it: worker.runner.init_adapter_dir); None when the task starts from fresh adapters."""
        if spec.init_adapter_file_id is None or spec.init_adapter_url is None:
            return None
        cached = cache / f"{spec.init_adapter_file_id}.adapter"
        if not cached.exists():
            self.download(spec.init_adapter_url, cached)
        target = data / INIT_ADAPTER_ARCHIVE
        shutil.copyfile(cached, target)
        return target

    # -- reports --------------------------------------------------------------------------
    def post_events(self, task_id: str, placement_id: str, events: list[EventIn]) -> int:
        msg = EventBatch(placement_id=placement_id, events=events)
        r = self.request("POST", f"/internal/v1/tasks/{task_id}/events",
                         body=msg.model_dump(mode="json", exclude_none=True), attempts=1)
        return int(r.json()["stored"])

    def post_metrics(self, task_id: str, placement_id: str, points: list[MetricPointIn]) -> int:
        msg = MetricBatch(placement_id=placement_id, points=points)
        r = self.request("POST", f"/internal/v1/tasks/{task_id}/metrics",
                         body=msg.model_dump(mode="json"), attempts=1)
        return int(r.json()["stored"])

    def job_state(self, job_id: str, update: JobStateUpdate) -> dict:
        """update.placement_id names the attempt that reports."""
        r = self.request("POST", f"/internal/v1/jobs/{job_id}/state",
                         body=update.model_dump(mode="json", exclude_none=True), attempts=1)
        return r.json()

    def upload_artifact(self, task_id: str, meta: ArtifactMeta, directory: Path) -> dict:
        # Dot files are a writer's temporaries (atomic rename pattern), never artifact files.
        paths = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
        handles = [open(p, "rb") for p in paths]
        try:
            files = [("files", (p.name, h, "application/octet-stream"))
                     for p, h in zip(paths, handles, strict=True)]
            r = self.request("POST", f"/internal/v1/tasks/{task_id}/artifacts",
                             data={"meta": meta.model_dump_json(exclude_none=True)},
                             files=files, attempts=1)
        finally:
            for h in handles:
                h.close()
        return r.json()

    def throughput(self, task_id: str, msg: ThroughputReport) -> dict:
        return self.request("POST", f"/internal/v1/tasks/{task_id}/throughput",
                            body=msg.model_dump(mode="json", exclude_none=True),
                            attempts=1).json()

    def task_finished(self, task_id: str, msg: TaskFinished) -> dict:
        return self.request("POST", f"/internal/v1/tasks/{task_id}/finished",
                            body=msg.model_dump(mode="json"), attempts=1).json()

    def task_failed(self, task_id: str, msg: TaskFailed) -> dict:
        return self.request("POST", f"/internal/v1/tasks/{task_id}/failed",
                            body=msg.model_dump(mode="json"), attempts=1).json()


def _error_of(response: httpx.Response) -> tuple[str, str]:
    try:
        err = response.json().get("error") or {}
        return str(err.get("code", "")), str(err.get("message", response.text[:500]))
    except (ValueError, AttributeError):
        return "", response.text[:500]


# -- the spool ------------------------------------------------------------------------------
class SpoolWriter:
    """Executor side: append one record per line and flush+fsync, so a record the executor
    wrote survives the executor's death (the daemon forwards it later)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "ab")
        if self._fh.tell() > 0 and not _ends_with_newline(path):
            self._fh.write(b"\n")  # a torn line of a killed writer: close it, it is skipped

    def write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":"), default=str)
        self._fh.write(line.encode() + b"\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def event(self, type_: str, message: str = "", job_id: str | None = None,
              level: str = "info", data: dict | None = None) -> None:
        self.write({"type": "event", "event": {"type": type_, "message": message,
                                               "job_id": job_id, "level": level, "data": data}})

    def metric(self, job_id: str, step: int, split: str, loss: float,
               data: dict | None = None, usage: tuple[int, float] | None = None) -> None:
        """usage: a train point's (tokens, GPU-seconds); its fields are left out without it."""
        point = {"job_id": job_id, "step": step, "split": split, "loss": loss, "data": data}
        if usage is not None:
            point["tokens"], point["gpu_seconds"] = usage
        self.write({"type": "metric", "point": point})

    def job_state(self, job_id: str, **update: Any) -> None:
        self.write({"type": "job_state", "job_id": job_id, "update": update})

    def artifact(self, directory: str, **meta: Any) -> None:
        self.write({"type": "artifact", "dir": directory, "meta": meta})

    def throughput(self, *, gpus: int, seq_len: int, batch_sizes: Sequence[int],
                   tokens_per_s: float, samples_per_s: float | None = None,
                   memory_k0: float | None = None, memory_k1: float | None = None) -> None:
        """What the executor measured on its GPUs since its last report (ThroughputReport fields
        but placement_id). Numbers are made plain ints/floats here: the executor may hand over
        numpy or torch scalars, which JSON would otherwise turn into strings."""
        def number(x: float | None) -> float | None:
            return None if x is None else float(x)

        self.write({"type": "throughput", "report": {
            "gpus": int(gpus), "seq_len": int(seq_len),
            "batch_sizes": [int(b) for b in batch_sizes], "tokens_per_s": float(tokens_per_s),
            "samples_per_s": number(samples_per_s), "memory_k0": number(memory_k0),
            "memory_k1": number(memory_k1)}})

    def finished(self, best_job_id: str | None = None, summary: dict | None = None) -> None:
        self.write({"type": "finished", "best_job_id": best_job_id, "summary": summary})

    def failed(self, error: str, retryable: bool = True, detail: str | None = None) -> None:
        """`error` is shown to the tenant (short, no paths); `detail` only to operators."""
        self.write({"type": "failed", "error": error[:10_000], "retryable": retryable,
                    "detail": detail[-20_000:] if detail else None})

    def close(self) -> None:
        self._fh.close()


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def read_complete_lines(path: Path, offset: int, max_lines: int = 1000
                        ) -> list[tuple[int, int, str]]:
    """(start offset, end offset, text) of complete lines from offset on."""
    if not path.exists():
        return []
    out: list[tuple[int, int, str]] = []
    with open(path, "rb") as fh:
        fh.seek(offset)
        pos = offset
        while len(out) < max_lines:
            line = fh.readline()
            if not line.endswith(b"\n"):
                break
            out.append((pos, pos + len(line), line.decode("utf-8", "replace").strip()))
            pos += len(line)
    return out


@dataclass
class ForwardState:
    offset: int = 0
    terminal: str | None = None  # "finished" / "failed" once that report is delivered
    dropped: int = 0

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
        self.state = ForwardState.load(self.state_path)

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
            elif record is None or kind not in ("job_state", "artifact", "throughput",
                                                *TERMINAL_TYPES):
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
            self._tolerate(lambda: self.client.upload_artifact(self.task_id, meta, directory),
                           "artifact")
        elif kind == "throughput":
            self._throughput(record)
        elif kind == "finished":
            msg = TaskFinished(placement_id=self.placement_id,
                               best_job_id=record.get("best_job_id"),
                               summary=record.get("summary"))
            self._tolerate(lambda: self.client.task_finished(self.task_id, msg), "finished")
            self.state.terminal = "finished"
        else:
            msg2 = TaskFailed(placement_id=self.placement_id, error=record.get("error") or "?",
                              retryable=bool(record.get("retryable", True)),
                              detail=record.get("detail"))
            self._tolerate(lambda: self.client.task_failed(self.task_id, msg2), "failed")
            self.state.terminal = "failed"

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

    def _throughput(self, record: dict) -> None:
        # A measurement only tunes the scheduler's estimates: one the contract refuses (a NaN
        # rate, a missing field) is dropped here, never allowed to stall the reports behind it.
        try:
            msg = ThroughputReport(placement_id=self.placement_id, **record["report"])
        except (ValueError, TypeError, KeyError) as exc:
            self.state.dropped += 1
            log.warning("throughput record dropped task=%s placement=%s error=%s", self.task_id,
                        self.placement_id, str(exc).splitlines()[0] if str(exc) else exc)
            return
        self._tolerate(lambda: self.client.throughput(self.task_id, msg), "throughput")

    def _tolerate(self, call: Callable[[], object], what: str) -> None:
        """Run a report; a permanent refusal (task cancelled, stale placement) is logged and
        skipped, since retrying it can never succeed; retryable errors propagate."""
        try:
            call()
        except ServiceError as exc:
            if exc.retryable:
                raise
            self.state.dropped += 1
            log.warning("report refused task=%s placement=%s what=%s status=%s code=%s",
                        self.task_id, self.placement_id, what, exc.status, exc.code)

    def _advance(self, offset: int) -> None:
        self.state.offset = offset
        self.state.save(self.state_path)


def _parse(text: str) -> dict | None:
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None

