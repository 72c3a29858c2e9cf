"""Unit: the spool -> service forwarding of the daemon against a fake HTTP transport: order,
batching, offset persistence across restarts, idempotency keys, retry with backoff."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from worker.forwarder import Forwarder
from worker.service_client import Backoff, ServiceClient, ServiceError
from worker.spool import SpoolWriter, read_complete_lines


class FakeService:
    """Records every request; `fail` maps a path suffix to a list of statuses to answer first."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, object]] = []
        self.fail: dict[str, list[int]] = {}
        self.event_keys: set[str] = set()

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        for suffix, statuses in self.fail.items():
            if path.endswith(suffix) and statuses:
                status = statuses.pop(0)
                return httpx.Response(status, json={"error": {"code": f"e{status}",
                                                              "message": "injected"}})
        if "multipart" in request.headers.get("content-type", ""):
            body: object = request.content.count(b'filename="')
        else:
            body = json.loads(request.content) if request.content else None
        self.calls.append((request.method, path, body))
        if path.endswith("/events"):
            keys = [e["client_key"] for e in body["events"]]  # type: ignore[index]
            new = [k for k in keys if k not in self.event_keys]
            self.event_keys.update(keys)
            return httpx.Response(200, json={"stored": len(new)})
        if path.endswith("/metrics"):
            return httpx.Response(200, json={"stored": len(body["points"])})  # type: ignore[index]
        if path.endswith("/artifacts"):
            return httpx.Response(201, json={"artifact_id": "art_1", "kind": "adapter",
                                             "key": "k", "files": []})
        return httpx.Response(200, json={"ok": True})

    def paths(self) -> list[str]:
        return [p.rsplit("/", 1)[-1] for _, p, _ in self.calls]


def make_client(fake: FakeService, sleeps: list[float] | None = None) -> ServiceClient:
    return ServiceClient("http://svc", "tok", transport=httpx.MockTransport(fake.handler),
                         attempts=3, backoff=Backoff(base_s=0.1, jitter=False),
                         sleep=(sleeps.append if sleeps is not None else lambda s: None))


def write_run(spool: SpoolWriter, adapter_dir: Path) -> None:
    spool.event("log", "started")
    for step in (1, 2, 3):
        spool.metric("job_a", step, "train", 2.0 - 0.1 * step)
    spool.job_state("job_a", state="running")
    spool.metric("job_a", 3, "val", float("nan"))
    adapter_dir.mkdir(parents=True)
    (adapter_dir / "adapter_config.json").write_text("{}")
    (adapter_dir / "adapter_model.safetensors").write_bytes(b"x")
    spool.artifact("artifacts/a", kind="adapter", job_id="job_a")
    spool.job_state("job_a", state="completed", best_val_loss=1.5, best_step=3)
    spool.finished(best_job_id="job_a")


def test_forwarder_delivers_in_order_with_batches(tmp_path: Path) -> None:
    fake = FakeService()
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    write_run(spool, tmp_path / "artifacts" / "a")
    fwd = Forwarder(make_client(fake), tmp_path, "task_1", "plc_1")
    fwd.pump()
    assert fake.paths() == ["events", "metrics", "state", "metrics", "artifacts", "state",
                            "finished"]
    first_metrics = fake.calls[1][2]
    assert [p["step"] for p in first_metrics["points"]] == [1, 2, 3]  # type: ignore[index]
    nan_point = fake.calls[3][2]["points"][0]  # type: ignore[index]
    assert nan_point["loss"] != nan_point["loss"]  # NaN survived the JSON trip
    assert fake.calls[4][2] == 2  # two files in the multipart upload
    assert fake.calls[6][2] == {"placement_id": "plc_1", "best_job_id": "job_a"}  # no nulls
    assert fwd.done and fwd.state.terminal == "finished"
    assert fwd.state.offset == (tmp_path / "spool.jsonl").stat().st_size
    assert fwd.pump() == 0 and len(fake.calls) == 7


def test_restart_resumes_without_loss_or_duplicates(tmp_path: Path) -> None:
    fake = FakeService()
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    spool.event("log", "one")
    spool.metric("job_a", 1, "train", 1.0)
    spool.job_state("job_a", state="running")
    Forwarder(make_client(fake), tmp_path, "task_1", "plc_1").pump()
    assert fake.paths() == ["events", "metrics", "state"]
    spool.metric("job_a", 2, "train", 0.9)
    spool.finished()
    # A new daemon process: a fresh Forwarder reads the saved offset.
    again = Forwarder(make_client(fake), tmp_path, "task_1", "plc_1")
    assert again.state.offset > 0
    again.pump()
    assert fake.paths() == ["events", "metrics", "state", "metrics", "finished"]


def test_crash_between_send_and_save_resends_with_same_keys(tmp_path: Path) -> None:
    fake = FakeService()
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    spool.event("log", "a")
    spool.event("log", "b")
    fwd = Forwarder(make_client(fake), tmp_path, "task_1", "plc_1")
    fwd.pump()
    (tmp_path / "forward.json").unlink()  # the offset write was lost
    Forwarder(make_client(fake), tmp_path, "task_1", "plc_1").pump()
    first, second = fake.calls[0][2], fake.calls[1][2]
    keys = [e["client_key"] for e in first["events"]]  # type: ignore[index]
    assert keys == [e["client_key"] for e in second["events"]]  # type: ignore[index]
    assert len(set(keys)) == 2 and all(k.startswith("plc_1:") for k in keys)
    assert len(fake.event_keys) == 2  # the service stored each event once


def test_transient_errors_defer_with_backoff_then_deliver(tmp_path: Path) -> None:
    fake = FakeService()
    fake.fail["/metrics"] = [503, 503]
    now = [0.0]
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    spool.metric("job_a", 1, "train", 1.0)
    spool.finished()
    fwd = Forwarder(make_client(fake), tmp_path, "task_1", "plc_1",
                    backoff=Backoff(base_s=1.0, jitter=False), clock=lambda: now[0])
    assert fwd.pump() == 0 and fwd.failures == 1 and fwd.next_try_at == 1.0
    assert fwd.pump() == 0 and fwd.failures == 1  # too early: no request at all
    now[0] = 1.0
    assert fwd.pump() == 0 and fwd.failures == 2 and fwd.next_try_at == 3.0
    now[0] = 3.0
    assert fwd.pump() == 2 and fwd.done
    assert fake.paths() == ["metrics", "finished"]


def test_permanent_refusal_is_skipped_not_retried(tmp_path: Path) -> None:
    fake = FakeService()
    fake.fail["/state"] = [409]
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    spool.job_state("job_a", state="running")
    spool.event("log", "after")
    fwd = Forwarder(make_client(fake), tmp_path, "task_1", "plc_1")
    fwd.pump()
    assert fake.paths() == ["events"] and fwd.state.dropped == 1 and fwd.failures == 0


def test_torn_line_waits_until_complete(tmp_path: Path) -> None:
    path = tmp_path / "spool.jsonl"
    spool = SpoolWriter(path)
    spool.event("log", "whole")
    with open(path, "ab") as fh:
        fh.write(b'{"type":"event","event":{"type":"log","mess')
    lines = read_complete_lines(path, 0)
    assert len(lines) == 1 and lines[0][1] < path.stat().st_size
    # A writer opened after a crash closes the torn line; the next record is whole.
    SpoolWriter(path).event("log", "next")
    records = [json.loads(t) if t.endswith("}") and '"next"' in t else None
               for _, _, t in read_complete_lines(path, 0)]
    assert records[-1] is not None and records[-1]["event"]["message"] == "next"
    fake = FakeService()
    fwd = Forwarder(make_client(fake), tmp_path, "task_1", "plc_1")
    fwd.pump()
    sent = [e["message"] for e in fake.calls[0][2]["events"]]  # type: ignore[index]
    assert sent == ["whole", "next"] and fwd.state.dropped == 1


def test_client_retries_5xx_with_growing_backoff_and_not_4xx() -> None:
    fake = FakeService()
    sleeps: list[float] = []
    fake.fail["/heartbeat"] = [500, 502]
    client = make_client(fake, sleeps)
    r = client.request("POST", "/internal/v1/nodes/n1/heartbeat", body={})
    assert r.status_code == 200 and sleeps == [0.1, 0.2]
    fake.fail["/claim"] = [404]
    with pytest.raises(ServiceError) as err:
        client.request("POST", "/internal/v1/placements/p/claim", body={})
    assert err.value.status == 404 and not err.value.retryable and sleeps == [0.1, 0.2]
    fake.fail["/x"] = [503, 503, 503]
    with pytest.raises(ServiceError) as err:
        client.request("GET", "/x")
    assert err.value.retryable and err.value.status == 503


def test_transport_errors_are_retried() -> None:
    tries = []

    def handler(request: httpx.Request) -> httpx.Response:
        tries.append(1)
        if len(tries) < 3:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"stored": 0})

    client = ServiceClient("http://svc", "t", transport=httpx.MockTransport(handler),
                           attempts=3, sleep=lambda s: None)
    assert client.request("GET", "/a").json() == {"stored": 0} and len(tries) == 3


def test_backoff_is_bounded() -> None:
    b = Backoff(base_s=0.5, factor=2, cap_s=4)
    for n in range(20):
        assert 0 < b.delay(n) <= 4
    assert Backoff(base_s=0.5, cap_s=4, jitter=False).delay(10) == 4


def _multipart_meta(request: httpx.Request) -> dict:
    """The ArtifactMeta JSON of a multipart upload (its ``meta`` form field)."""
    boundary = request.headers["content-type"].split("boundary=")[1].encode()
    for part in request.content.split(b"--" + boundary):
        head, _, body = part.partition(b"\r\n\r\n")
        if b'name="meta"' in head:
            return json.loads(body.rstrip(b"\r\n"))
    raise AssertionError("no meta field")


def test_every_report_names_the_forwarders_placement(tmp_path: Path) -> None:
    """The service fences every report on its placement (= attempt): the forwarder puts its own
    into each one, whatever a spool record says, so an old attempt's spool cannot pass as new."""
    bodies: dict[str, dict] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        kind = request.url.path.rsplit("/", 1)[-1]
        if "multipart" in request.headers.get("content-type", ""):
            bodies[kind] = _multipart_meta(request)
            return httpx.Response(201, json={"artifact_id": "art_1", "kind": "adapter",
                                             "key": "k", "files": []})
        bodies[kind] = json.loads(request.content)
        return httpx.Response(200, json={"stored": 1})

    client = ServiceClient("http://svc", "tok", transport=httpx.MockTransport(handler),
                           attempts=1, sleep=lambda s: None)
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    spool.event("log", "started")
    spool.metric("job_a", 1, "train", 2.0)
    spool.job_state("job_a", state="running", placement_id="plc_old")
    (tmp_path / "artifacts" / "a").mkdir(parents=True)
    (tmp_path / "artifacts" / "a" / "adapter_model.safetensors").write_bytes(b"x")
    spool.artifact("artifacts/a", kind="adapter", job_id="job_a", placement_id="plc_old")
    spool.throughput(gpus=1, seq_len=128, batch_sizes=[2], tokens_per_s=10.0)
    spool.failed("boom", retryable=True)
    fwd = Forwarder(client, tmp_path, "task_1", "plc_2")
    assert fwd.pump() == 6 and fwd.state.dropped == 0
    assert sorted(bodies) == ["artifacts", "events", "failed", "metrics", "state",
                              "throughput"]
    assert {kind: body["placement_id"] for kind, body in bodies.items()} == \
        dict.fromkeys(bodies, "plc_2")
    # ... and the same for the other end of a run
    spool2 = SpoolWriter(tmp_path / "b" / "spool.jsonl")
    spool2.finished(best_job_id="job_a")
    Forwarder(client, tmp_path / "b", "task_1", "plc_2").pump()
    assert bodies["finished"]["placement_id"] == "plc_2"


def test_a_record_the_contract_refuses_is_dropped(tmp_path: Path) -> None:
    fake = FakeService()
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    spool.job_state("job_a", state="sleeping")
    spool.artifact("artifacts/a", kind="tarball")
    spool.write({"type": "job_state", "update": {"state": "running"}})  # no job_id
    spool.job_state("job_a", state="running")
    fwd = Forwarder(make_client(fake), tmp_path, "task_1", "plc_1")
    assert fwd.pump() == 4
    assert fake.paths() == ["state"] and fwd.state.dropped == 3
    assert fake.calls[0][2] == {"placement_id": "plc_1", "state": "running"}
