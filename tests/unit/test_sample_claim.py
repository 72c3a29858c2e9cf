"""Unit: the daemon's sample-request part survives a claim answer it does not understand (a
service of another version, a proxy's error page): it logs, leases nothing, keeps the node's
placements going and asks again at its next poll."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from worker.config import DaemonConfig
from worker.registration import Registration, detect_node
from worker.sample_requests import SampleRequests
from worker.service_client import Backoff, ServiceClient
from worker.shared_hosts import SharedHosts


def _part(tmp_path: Path, answer: httpx.Response) -> tuple[SampleRequests, list[str]]:
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return answer

    cfg = DaemonConfig(service_url="http://svc", worker_token="t", redis_url="",
                       node_name="n1", work_dir=tmp_path, sample_poll_s=0)
    client = ServiceClient("http://svc", "t", transport=httpx.MockTransport(handler),
                           backoff=Backoff(base_s=0.01, jitter=False), sleep=lambda s: None)
    registration = Registration(cfg, client)
    registration.node_id, registration.node = "node_1", detect_node(cfg)
    return SampleRequests(cfg, client, registration, {}, SharedHosts(cfg, registration, {})), asked


@pytest.mark.parametrize("answer", [
    httpx.Response(200, json={"stored": 1}),             # another endpoint's shape
    httpx.Response(200, text="<html>gateway</html>"),    # not JSON at all
    httpx.Response(200, json=[1, 2, 3]),
], ids=["wrong-shape", "not-json", "a-list"])
def test_a_claim_answer_not_understood_leases_nothing_and_asks_again(
        tmp_path: Path, answer: httpx.Response, caplog: pytest.LogCaptureFixture) -> None:
    part, asked = _part(tmp_path, answer)
    part.tend(accepting=True)
    assert asked == ["/internal/v1/sample_requests/claim"] and not part.busy
    assert "not understood" in caplog.text and "Traceback" not in caplog.text
    assert not (tmp_path / "samples").exists() or not any((tmp_path / "samples").iterdir())
    part.tend(accepting=True)  # the next poll asks again
    assert len(asked) == 2 and not part.busy


def test_no_work_waiting_is_a_204(tmp_path: Path) -> None:
    part, asked = _part(tmp_path, httpx.Response(204))
    part.tend(accepting=True)
    assert asked == ["/internal/v1/sample_requests/claim"] and not part.busy
