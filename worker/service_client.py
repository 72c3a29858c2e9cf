"""The daemon's client of the service's internal API (/internal/v1, worker token): each call
retried with backoff; a ServiceError says whether trying again can help."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from contract.base import Message
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
    Report,
)

log = logging.getLogger("loraplex.worker.client")


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

    def fetch_init_adapter(self, spec: PlacementSpec, target: Path, cache: Path) -> Path | None:
        """The placement's starting adapter archive (PlacementSpec.init_adapter_url), cached per
        file id like the training files, copied to target (the runner unpacks it:
        worker.runner.init_adapter_dir); None when the task starts from fresh adapters."""
        if spec.init_adapter_file_id is None or spec.init_adapter_url is None:
            return None
        cached = cache / f"{spec.init_adapter_file_id}.adapter"
        if not cached.exists():
            self.download(spec.init_adapter_url, cached)
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

    def upload_artifact(self, task_id: str, meta: ArtifactMeta, directory: Path,
                        skip: frozenset[str] = frozenset()) -> dict:
        """POST the folder's files but those in skip (a checkpoint's carried ones)."""
        # Dot files are a writer's temporaries (atomic rename pattern), never artifact files.
        paths = sorted(p for p in directory.iterdir()
                       if p.is_file() and not p.name.startswith(".") and p.name not in skip)
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

    def report(self, report: Report, task_id: str, msg: Message) -> dict:
        """POST a one-message report (contract.protocol.REPORTS) to its route."""
        return self.request("POST", "/internal/v1" + report.path.format(task_id=task_id),
                            body=msg.model_dump(mode="json", exclude_none=True),
                            attempts=1).json()  # the forwarder retries, with backoff


def _error_of(response: httpx.Response) -> tuple[str, str]:
    try:
        err = response.json().get("error") or {}
        return str(err.get("code", "")), str(err.get("message", response.text[:500]))
    except (ValueError, AttributeError):
        return "", response.text[:500]

