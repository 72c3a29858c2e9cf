"""End to end: webhooks on the product path. The real service (uvicorn subprocess) and a real daemon
(the executor played by tests/e2e/fake_runner.py) run a task POSTed to the API; a real HTTP
receiver gets its events, signed so that the standardwebhooks verifier accepts them. Then the API
process is killed (SIGKILL) while its deliveries are in flight and started again: nothing is lost,
and the events sent twice carry the same webhook-id and body."""

from __future__ import annotations

import io
import json
import signal
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from tests.e2e.conftest import Stack, wait_for
from tests.helpers.webhook_receiver import Receiver

RUNNER = ("--runner-module", "tests.e2e.fake_runner")
LINES = [{"messages": [{"role": "user", "content": f"q{i}"},
                       {"role": "assistant", "content": f"a{i}"}]} for i in range(20)]
TYPES = ["task.running", "task.succeeded", "task.cancelled", "job.completed", "job.exited",
         "fine_tuning.job.succeeded", "fine_tuning.job.cancelled"]
TIMEOUT_S = 3  # an attempt's HTTP timeout; a killed process's claims end 2 * 3 + 5 s later


@pytest.fixture(autouse=True)
def webhook_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read by the stack's environment (tests/e2e/conftest.stack_env): the receiver is local.
    monkeypatch.setenv("LORAPLEX_WEBHOOK_ALLOW_PRIVATE", "true")
    monkeypatch.setenv("LORAPLEX_WEBHOOK_POLL_S", "0.2")
    monkeypatch.setenv("LORAPLEX_WEBHOOK_TIMEOUT_S", str(TIMEOUT_S))
    monkeypatch.setenv("LORAPLEX_WEBHOOK_BACKOFF_S", "[0.5, 1, 2]")
    monkeypatch.setenv("LORAPLEX_WEBHOOK_SECRET_KEY",
                       "nBGuSudQW8NlW4qdYeYWrHkuzE5PMRsxQTD-DNgRc6U=")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.release()
    r.stop()


def create_task(http: httpx.Client) -> str:
    body = "".join(json.dumps(r) + "\n" for r in LINES).encode()
    f = http.post("/v1/files", files={"file": ("train.jsonl", io.BytesIO(body))})
    assert f.status_code in (200, 201), f.text  # 200: the tenant's file of the same bytes
    t = http.post("/v1/tasks", json={"base_model": "tiny", "training_file": f.json()["id"],
                                     "search_space": {"learning_rate": [1e-4, 2e-4],
                                                      "lora_rank": [4]},
                                     "max_seq_len": 64})
    assert t.status_code == 201, t.text
    return t.json()["id"]


def test_task_events_reach_the_receiver_signed_and_survive_an_api_kill(
        stack: Stack, receiver: Receiver) -> None:
    with stack.http() as http:
        r = http.post("/v1/webhooks", json={"url": receiver.url, "event_types": TYPES})
        assert r.status_code == 201, r.text
        hook = r.json()
        verifier = Webhook(hook["secret"])

        # A task the daemon runs to the end: its events arrive signed.
        stack.daemon("cpu-node", *RUNNER)
        task = create_task(http)
        stack.place(task, "cpu-node")
        wait_for(lambda: http.get(f"/v1/tasks/{task}").json()["state"] == "succeeded", 60,
                 "the task to succeed")
        jobs = http.get(f"/v1/tasks/{task}/jobs").json()["data"]
        assert {j["state"] for j in jobs} <= {"completed", "exited"}
        want = {("task.running", task), ("task.succeeded", task),
                ("fine_tuning.job.succeeded", task)} | {(f"job.{j['state']}", j["id"])
                                                        for j in jobs}
        wait_for(lambda: len(receiver.received) >= len(want), 30, "the task's events")
        bodies = [verifier.verify(r.body, r.headers) for r in receiver.received]
        assert {(b["type"], b["data"]["id"]) for b in bodies} == want, bodies

        # The API dies while its attempts wait on the receiver: they were never recorded.
        receiver.hold()
        seen = len(receiver.received)
        cancelled = create_task(http)
        assert http.post(f"/v1/tasks/{cancelled}/cancel").status_code == 200
        wait_for(lambda: len(receiver.received) == seen + 2, 10, "the cancel's two events")
        assert stack.service is not None
        stack.service.send_signal(signal.SIGKILL)
        stack.service.wait(10)
        in_flight = stack.sql("SELECT state, attempts FROM webhook_deliveries d JOIN "
                              "webhook_events e ON e.id = d.event_id WHERE e.type LIKE "
                              "'%cancelled'")
        assert sorted(in_flight) == [("pending", 0), ("pending", 0)]
        receiver.release()
        stack.start_service()

        def log() -> list[dict]:
            return http.get(f"/v1/webhooks/{hook['id']}/deliveries",
                            params={"limit": 100}).json()["data"]

        wait_for(lambda: {d["state"] for d in log()} == {"delivered"}, 2 * TIMEOUT_S + 20,
                 "the restarted API to deliver what was in flight")
        counts = Counter(receiver.ids())
        stored = {e for (e,) in stack.sql("SELECT id FROM webhook_events")}
        assert set(counts) == stored, "every event reached the receiver"
        twice = {i for i, n in counts.items() if n == 2}
        assert len(twice) == 2 and all(n in (1, 2) for n in counts.values())
        for event_id in twice:
            first, second = [r for r in receiver.received if r.id == event_id]
            assert first.body == second.body
            assert verifier.verify(second.body, second.headers)["data"]["id"] == cancelled
        assert stack.sql("SELECT count(*) FROM webhook_deliveries WHERE state <> 'delivered'") \
            == [(0,)]
