"""Unit: how the daemon ends. SIGTERM/SIGINT end a daemon still retrying registration; a drained
or stopped daemon deregisters its node after its last heartbeat (service and Redis mocked)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from worker.config import DaemonConfig
from worker.daemon import Daemon
from worker.local_state import LocalPlacement
from worker.service_client import Backoff, ServiceClient


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeService:
    """The internal API as a MockTransport: records calls; answers chosen per route."""

    def __init__(self, register_status: int = 200, deregister_status: int = 200,
                 claim_status: int = 503) -> None:
        self.calls: list[tuple[float, str, dict]] = []
        self.register_status = register_status
        self.deregister_status = deregister_status
        self.claim_status = claim_status
        self.on_heartbeat: Callable[[], None] | None = None

    def paths(self) -> list[str]:
        return [path for _, path, _ in self.calls]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        self.calls.append((time.monotonic(), path, body))
        if path == "/internal/v1/nodes":
            if self.register_status != 200:
                return httpx.Response(self.register_status, json={"error": {
                    "code": "x", "message": "not now"}})
            return httpx.Response(200, json={"node_id": "node_1", "queue": "q",
                                             "heartbeat_interval_s": 0.05})
        if path.endswith("/heartbeat"):
            if self.on_heartbeat is not None:
                self.on_heartbeat()
            return httpx.Response(200, json={"node_id": "node_1", "state": "up"})
        if path.endswith("/deregister"):
            if self.deregister_status != 200:
                return httpx.Response(self.deregister_status, json={"error": {
                    "code": "x", "message": "down"}})
            return httpx.Response(200, json={"node_id": "node_1", "state": "down",
                                             "superseded_placement_ids": ["pl_popped"]})
        if path.endswith("/claim"):
            return httpx.Response(self.claim_status, json={"error": {"code": "x",
                                                                     "message": "busy"}})
        return httpx.Response(404, json={"error": {"code": "not_found", "message": path}})


class DownRedis:
    """A Redis that is down: every command fails at once (the daemon tolerates that)."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        def fail(*args: object, **kwargs: object) -> None:
            raise redis.ConnectionError(f"redis down ({name})")
        return fail


@pytest.fixture(autouse=True)
def restore_signals() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def make_daemon(tmp_path: Path, service: FakeService) -> Daemon:
    cfg = DaemonConfig(service_url="http://svc", worker_token="t",
                       redis_url=f"redis://127.0.0.1:{closed_port()}/0", node_name="n1",
                       work_dir=tmp_path, cpu_slots=1, poll_interval_s=0.02,
                       heartbeat_interval_s=0.05)
    client = ServiceClient("http://svc", "t", transport=httpx.MockTransport(service),
                           backoff=Backoff(base_s=0.01, jitter=False), sleep=lambda s: None)
    return Daemon(cfg, client=client, conn=DownRedis())  # type: ignore[arg-type]


def signal_later(sig: signal.Signals, when: Callable[[], bool], timeout: float = 10
                 ) -> list[float]:
    """Send sig to this process once when() holds (from a helper thread); the returned list
    gets the time it was sent."""
    sent: list[float] = []

    def run() -> None:
        deadline = time.monotonic() + timeout
        while not when() and time.monotonic() < deadline:
            time.sleep(0.01)
        sent.append(time.monotonic())
        os.kill(os.getpid(), sig)
    threading.Thread(target=run, daemon=True).start()
    return sent


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_registration_retries(tmp_path: Path, sig: signal.Signals) -> None:
    service = FakeService(register_status=503)
    daemon = make_daemon(tmp_path, service)
    sent = signal_later(sig, lambda: service.paths().count("/internal/v1/nodes") >= 2)
    assert daemon.run() == 0
    # The backoff wait is cut short: after the 2nd try the daemon waits 0.5-1 s, then 1-2 s.
    assert time.monotonic() - sent[0] < 0.4
    assert daemon.node_id is None
    assert set(service.paths()) == {"/internal/v1/nodes"}  # no heartbeat, no deregister


def test_refused_registration_exits_1(tmp_path: Path) -> None:
    service = FakeService(register_status=401)
    assert make_daemon(tmp_path, service).run() == 1
    assert service.paths() == ["/internal/v1/nodes"]  # a 4xx is not retried


def test_drained_daemon_deregisters_after_its_last_heartbeat(tmp_path: Path) -> None:
    service = FakeService()
    daemon = make_daemon(tmp_path, service)
    signal_later(signal.SIGTERM, lambda: service.paths().count(
        "/internal/v1/nodes/node_1/heartbeat") >= 2)
    assert daemon.run() == 0
    paths = service.paths()
    assert paths[0] == "/internal/v1/nodes" and paths[-1] == "/internal/v1/nodes/node_1/deregister"
    assert paths.count("/internal/v1/nodes/node_1/deregister") == 1
    assert service.calls[-1][2] == {"reason": "drained"}
    time.sleep(0.2)  # the heartbeat thread is gone: nothing more arrives
    assert service.paths() == paths


def test_stopped_daemon_deregisters_and_drops_unclaimed_placements(tmp_path: Path) -> None:
    popped = tmp_path / "placements" / "pl_popped"
    popped.mkdir(parents=True)
    LocalPlacement(placement_id="pl_popped", directory=popped).save()  # claim never answered
    service = FakeService(claim_status=503)
    daemon = make_daemon(tmp_path, service)
    signal_later(signal.SIGINT, lambda: any(p.endswith("/claim") for p in service.paths()))
    assert daemon.run() == 0
    assert service.paths()[-1].endswith("/deregister")
    assert service.calls[-1][2] == {"reason": "stopped"}
    assert not popped.exists()  # the service superseded it: nothing to resume next start


def test_failed_deregister_keeps_unclaimed_placements(tmp_path: Path) -> None:
    popped = tmp_path / "placements" / "pl_popped"
    popped.mkdir(parents=True)
    LocalPlacement(placement_id="pl_popped", directory=popped).save()
    service = FakeService(claim_status=503, deregister_status=503)
    daemon = make_daemon(tmp_path, service)
    signal_later(signal.SIGINT, lambda: any(p.endswith("/claim") for p in service.paths()))
    assert daemon.run() == 0
    assert service.paths().count("/internal/v1/nodes/node_1/deregister") == 3  # retried
    assert (popped / "daemon.json").exists()  # still published for this node: kept


def test_a_failing_tick_or_heartbeat_does_not_end_the_daemon(tmp_path: Path) -> None:
    """An unexpected error in one tick (a bug, a full disk) or in one heartbeat is logged and
    retried: the loop and the heartbeat thread go on, and a later SIGTERM still drains cleanly."""
    service = FakeService()
    daemon = make_daemon(tmp_path, service)
    ticks: list[float] = []
    real_tick, real_heartbeat = daemon.tick, daemon.client.heartbeat

    def flaky_tick() -> None:
        ticks.append(time.monotonic())
        if len(ticks) <= 2:
            raise RuntimeError("disk full")
        real_tick()

    beats: list[int] = []

    def flaky_heartbeat(*args: object, **kwargs: object):  # noqa: ANN202
        beats.append(1)
        if len(beats) == 2:  # the heartbeat thread's first one (the 1st is run() itself)
            raise RuntimeError("encoder bug")
        return real_heartbeat(*args, **kwargs)

    daemon.tick = flaky_tick  # type: ignore[method-assign]
    daemon.client.heartbeat = flaky_heartbeat  # type: ignore[method-assign]
    signal_later(signal.SIGTERM, lambda: len(ticks) >= 4 and len(beats) >= 4)
    assert daemon.run() == 0
    assert len(ticks) >= 4 and len(beats) >= 4  # both went on past their failures
    assert ticks[2] - ticks[1] >= 0.5  # the retry after a failure waits (backoff), not spins
    assert service.paths()[-1] == "/internal/v1/nodes/node_1/deregister"
    assert service.calls[-1][2] == {"reason": "drained"}
