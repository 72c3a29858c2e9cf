"""Integration: webhooks end to end against a real HTTP receiver (tests/helpers/webhook_receiver):
endpoints and their secret (shown once, encrypted at rest), task and job events driven through
the worker API and delivered signed (the standardwebhooks verifier accepts them), a receiver that
is down or failing gets every event once it is back, redelivery keeps the webhook-id, a delivery
is given up after webhook_give_up_s, and bad input is a 4xx naming the field that changes
nothing. The restart case (an API process killed mid-delivery) is tests/e2e/test_webhooks_restart.py."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import func, select
from standardwebhooks.webhooks import Webhook

from service.core.config import Settings
from service.core.localstack import free_port
from service.dev.webhook_receiver import make_server
from service.models import WebhookEndpoint, WebhookEvent
from tests.helpers.webhook_receiver import Receiver, wait_for
from tests.integration.factories import safetensors_bytes

cryptography = pytest.importorskip("cryptography.fernet")

ADAPTER_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 16,
                  "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": "tiny-llama"}
ALL_TASK_TYPES = ["task.running", "task.succeeded", "task.cancelled", "task.failed",
                  "fine_tuning.job.succeeded", "fine_tuning.job.cancelled",
                  "fine_tuning.job.failed", "job.completed", "job.exited"]


@pytest.fixture
def settings(settings: Settings) -> Settings:
    # The receiver is on 127.0.0.1; short timeouts and backoff keep retries within seconds.
    return settings.model_copy(update={
        "webhook_allow_private": True, "webhook_timeout_s": 1.0, "webhook_poll_s": 0.1,
        "webhook_backoff_s": [0.2, 0.4, 0.8], "webhook_give_up_s": 3600.0,
        "webhook_secret_key": cryptography.Fernet.generate_key().decode()})


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.release()
    r.stop()


def create(client, tenant, url: str, types: list[str] | None = None, **extra) -> dict:  # noqa: ANN001
    r = client.post("/v1/webhooks", headers=tenant.headers,
                    json={"url": url, "event_types": types or ALL_TASK_TYPES, **extra})
    assert r.status_code == 201, r.text
    return r.json()


def verify(secret: str, received) -> dict:  # noqa: ANN001
    """The body, once the Standard Webhooks reference verifier accepted the signature."""
    return Webhook(secret).verify(received.body, received.headers)


def start_task(client, factory, tenant, jobs: int = 1) -> tuple[str, str, list[str]]:  # noqa: ANN001
    """A task claimed by a worker: (task id, placement id, its job ids)."""
    task = factory.task(tenant, search_space={"learning_rate": [1e-4, 3e-4][:jobs],
                                              "lora_rank": [4]})
    node = factory.node()
    pid = factory.placement(task["id"], node)
    r = client.post(f"/internal/v1/placements/{pid}/claim", headers=factory.worker,
                    json={"node_id": node})
    assert r.status_code == 200, r.text
    return task["id"], pid, [j["job_id"] for j in r.json()["jobs"]]


def job_state(client, factory, job: str, pid: str, state: str, **extra) -> None:  # noqa: ANN001
    r = client.post(f"/internal/v1/jobs/{job}/state", headers=factory.worker,
                    json={"placement_id": pid, "state": state, **extra})
    assert r.status_code == 200, r.text


def succeed_task(client, factory, tenant) -> tuple[str, list[str]]:  # noqa: ANN001
    """A task that runs two jobs (one completes with an adapter, one exits early) and succeeds."""
    tid, pid, (j0, j1) = start_task(client, factory, tenant, jobs=2)
    for job in (j0, j1):
        job_state(client, factory, job, pid, "running")
    job_state(client, factory, j1, pid, "exited", exit_reason="diverging", last_step=3)
    job_state(client, factory, j0, pid, "completed", best_val_loss=1.5, best_step=3)
    cfg = json.dumps(ADAPTER_CONFIG).encode()
    r = client.post(
        f"/internal/v1/tasks/{tid}/artifacts", headers=factory.worker,
        data={"meta": json.dumps({"kind": "adapter", "job_id": j0, "placement_id": pid})},
        files=[("files", ("adapter_config.json", io.BytesIO(cfg), "application/json")),
               ("files", ("adapter_model.safetensors", io.BytesIO(safetensors_bytes()),
                          "application/octet-stream"))])
    assert r.status_code == 201, r.text
    r = client.post(f"/internal/v1/tasks/{tid}/finished", headers=factory.worker,
                    json={"placement_id": pid})
    assert r.status_code == 200 and r.json()["state"] == "succeeded", r.text
    return tid, [j0, j1]


def cancel_task(client, factory, tenant) -> str:  # noqa: ANN001
    tid = factory.task(tenant, search_space={"learning_rate": [1e-4], "lora_rank": [4]})["id"]
    assert client.post(f"/v1/tasks/{tid}/cancel", headers=tenant.headers).status_code == 200
    return tid


def deliveries(client, tenant, endpoint_id: str, **params) -> list[dict]:  # noqa: ANN001
    r = client.get(f"/v1/webhooks/{endpoint_id}/deliveries", headers=tenant.headers,
                   params={"limit": 100, **params})
    assert r.status_code == 200, r.text
    return r.json()["data"]


def test_endpoint_lifecycle_and_the_secret_shown_once(client, factory, session,  # noqa: ANN001
                                                      receiver) -> None:
    t = factory.tenant()
    made = create(client, t, receiver.url, ["task.succeeded", "task.succeeded", "job.exited"],
                  description="ci hook")
    secret = made["secret"]
    assert secret.startswith("whsec_") and made["event_types"] == ["task.succeeded", "job.exited"]
    assert made["enabled"] is True and made["description"] == "ci hook"
    got = client.get(f"/v1/webhooks/{made['id']}", headers=t.headers).json()
    listed = client.get("/v1/webhooks", headers=t.headers).json()
    assert "secret" not in got and secret not in json.dumps(listed)
    assert [w["id"] for w in listed["data"]] == [made["id"]]
    stored = session.scalar(select(WebhookEndpoint.secret).where(WebhookEndpoint.id == made["id"]))
    assert stored.startswith("fernet:") and secret.removeprefix("whsec_") not in stored

    # Disabled: nothing is enqueued for it; enabled again: the next event is.
    r = client.patch(f"/v1/webhooks/{made['id']}", headers=t.headers, json={"enabled": False})
    assert r.status_code == 200 and r.json()["enabled"] is False
    assert client.post(f"/v1/webhooks/{made['id']}/test", headers=t.headers).status_code == 409
    r = client.patch(f"/v1/webhooks/{made['id']}", headers=t.headers,
                     json={"enabled": True, "event_types": ["task.cancelled"],
                           "description": None})
    assert r.json()["event_types"] == ["task.cancelled"] and r.json()["description"] is None
    test = client.post(f"/v1/webhooks/{made['id']}/test", headers=t.headers)
    assert test.status_code == 202 and test.json()["event_type"] == "webhook.test"
    [ping] = wait_for(lambda: receiver.of_type("webhook.test"), 10, "the test event")
    assert verify(secret, ping)["data"]["id"] == made["id"]

    r = client.delete(f"/v1/webhooks/{made['id']}", headers=t.headers)
    assert r.status_code == 200 and r.json() == {"id": made["id"], "object": "webhook_endpoint",
                                                 "deleted": True}
    assert client.get(f"/v1/webhooks/{made['id']}", headers=t.headers).status_code == 404
    assert client.get("/v1/webhooks", headers=t.headers).json()["data"] == []
    cancel_task(client, factory, t)
    assert session.scalar(select(func.count()).select_from(WebhookEvent).where(
        WebhookEvent.type == "task.cancelled")) == 0


def test_the_tours_receiver_gets_the_test_event_verified(client, factory) -> None:  # noqa: ANN001
    """The README's tour (issue 43): register an endpoint on a loopback port, start
    `python -m service.dev.webhook_receiver --secret <its secret>` there, send a test event: the
    receiver verifies the signature and prints it."""
    t = factory.tenant()
    port = free_port()
    made = create(client, t, f"http://127.0.0.1:{port}/hook", ["task.succeeded"])
    out = io.StringIO()
    server = make_server("127.0.0.1", port, made["secret"], out)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert client.post(f"/v1/webhooks/{made['id']}/test", headers=t.headers).status_code == 202
        line = wait_for(lambda: out.getvalue(), 10, "the receiver's line")
    finally:
        server.shutdown()
        server.server_close()
    assert line.startswith("verified evt_") and f'webhook.test {{"id": "{made["id"]}"' in line


def test_task_and_job_events_are_delivered_signed(client, factory, receiver) -> None:  # noqa: ANN001
    t, other = factory.tenant(), factory.tenant()
    hook = create(client, t, receiver.url)
    other_receiver = Receiver()
    try:
        create(client, other, other_receiver.url)
        tid, (j0, j1) = succeed_task(client, factory, t)
        cancelled = cancel_task(client, factory, t)
        want = {("task.running", tid), ("job.exited", j1), ("job.completed", j0),
                ("task.succeeded", tid), ("fine_tuning.job.succeeded", tid),
                ("task.cancelled", cancelled), ("fine_tuning.job.cancelled", cancelled)}
        wait_for(lambda: len(receiver.received) >= len(want), 15, "every event")
        bodies = [verify(hook["secret"], r) for r in receiver.received]
        assert {(b["type"], b["data"]["id"]) for b in bodies} == want
        assert len(receiver.ids()) == len(set(receiver.ids())) == len(want)
        for r, body in zip(receiver.received, bodies, strict=True):
            assert r.headers["webhook-id"] == body["id"] and body["id"].startswith("evt_")
            assert body["object"] == "event" and isinstance(body["created_at"], int)
        by_type = {b["type"]: b for b in bodies}
        # OpenAI's shape: data is just the fine-tuning job's id (= the task id).
        assert by_type["fine_tuning.job.succeeded"]["data"] == {"id": tid}
        assert by_type["task.succeeded"]["data"]["best_job_id"] == j0
        assert by_type["job.exited"]["data"]["exit_reason"] == "diverging"
        assert by_type["job.exited"]["data"]["task_id"] == tid
        # The official OpenAI SDK's webhook helper accepts OpenAI's events as its own.
        openai = pytest.importorskip("openai")
        sdk = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")
        for r in receiver.of_type("fine_tuning.job.succeeded"):
            event = sdk.webhooks.unwrap(r.body, r.headers, secret=hook["secret"])
            assert type(event).__name__ == "FineTuningJobSucceededWebhookEvent"
            assert event.data.id == tid and event.id == r.id
        [r] = receiver.of_type("fine_tuning.job.cancelled")
        assert sdk.webhooks.unwrap(r.body, r.headers, secret=hook["secret"]).data.id == cancelled
        with pytest.raises(Exception, match="signature"):  # a wrong secret does not verify
            verify("whsec_" + "A" * 43 + "=", receiver.received[0])

        log = deliveries(client, t, hook["id"])
        assert len(log) == len(want) and {d["state"] for d in log} == {"delivered"}
        assert all(d["attempts"] == 1 and d["last_status_code"] == 200 and d["delivered_at"]
                   for d in log)
        one = client.get(f"/v1/webhooks/{hook['id']}/deliveries/{log[0]['id']}",
                         headers=t.headers).json()
        assert one["payload"]["id"] == one["event_id"] and len(one["attempt_log"]) == 1
        assert one["attempt_log"][0]["status_code"] == 200

        # Redelivery on request: the same webhook-id and body again.
        first = log[-1]
        r = client.post(f"/v1/webhooks/{hook['id']}/deliveries/{first['id']}/redeliver",
                        headers=t.headers)
        assert r.status_code == 202 and r.json()["state"] == "pending"
        wait_for(lambda: len(receiver.received) == len(want) + 1, 10, "the redelivery")
        again = receiver.received[-1]
        assert again.id == first["event_id"]
        assert verify(hook["secret"], again) == next(
            b for b in bodies if b["id"] == first["event_id"])
        wait_for(lambda: deliveries(client, t, hook["id"])[-1]["attempts"] == 2, 10,
                 "the redelivery's record")
        # The other tenant's endpoint heard none of it.
        assert other_receiver.received == []
    finally:
        other_receiver.stop()


def test_paused_and_failed_tasks_are_announced(client, factory, receiver) -> None:  # noqa: ANN001
    t = factory.tenant()
    hook = create(client, t, receiver.url, ["task.paused", "task.failed", "fine_tuning.job.failed",
                                            "job.failed"])
    paused = factory.task(t, search_space={"learning_rate": [1e-4], "lora_rank": [4]})["id"]
    r = client.post(f"/v1/tasks/{paused}/pause", headers=t.headers)
    assert r.status_code == 200 and r.json()["state"] == "paused", r.text
    tid, pid, (job,) = start_task(client, factory, t)
    job_state(client, factory, job, pid, "running")
    job_state(client, factory, job, pid, "failed", error="CUDA out of memory")
    r = client.post(f"/internal/v1/tasks/{tid}/failed", headers=factory.worker,
                    json={"placement_id": pid, "error": "executor crashed", "retryable": False})
    assert r.status_code == 200 and r.json()["state"] == "failed", r.text
    wait_for(lambda: len(receiver.received) == 4, 15, "four events")
    got = {(b["type"], b["data"]["id"]): b for b in
           (verify(hook["secret"], r) for r in receiver.received)}
    assert set(got) == {("task.paused", paused), ("job.failed", job), ("task.failed", tid),
                        ("fine_tuning.job.failed", tid)}
    assert got[("task.failed", tid)]["data"]["message"] == "executor crashed"
    assert got[("task.paused", paused)]["data"]["state"] == "paused"


def test_a_receiver_down_or_failing_gets_every_event_once_back(client, factory, receiver  # noqa: ANN001
                                                               ) -> None:
    t = factory.tenant()
    hook = create(client, t, receiver.url, ["task.cancelled", "fine_tuning.job.cancelled"])
    receiver.stop()  # down: connections refused
    tasks = [cancel_task(client, factory, t) for _ in range(3)]
    wait_for(lambda: all(d["attempts"] >= 3 for d in deliveries(client, t, hook["id"])), 20,
             "retries while the receiver is down")
    log = deliveries(client, t, hook["id"])
    assert len(log) == 6 and {d["state"] for d in log} == {"pending"}
    assert all(d["last_status_code"] is None and "Connect" in d["last_error"] for d in log)
    assert all(d["next_attempt_at"] is not None for d in log)
    receiver.status = 500  # back, but failing
    receiver.start()
    wait_for(lambda: len(set(receiver.ids())) == 6, 20, "attempts answered 500")
    wait_for(lambda: all(d["last_status_code"] == 500 for d in deliveries(client, t, hook["id"])),
             10, "the 500s recorded")
    receiver.status = 200
    wait_for(lambda: {d["state"] for d in deliveries(client, t, hook["id"])} == {"delivered"},
             30, "every delivery to succeed")
    bodies = [verify(hook["secret"], r) for r in receiver.received]
    assert {b["data"]["id"] for b in bodies} == set(tasks)
    assert len(set(receiver.ids())) == 6  # retries reuse their event's webhook-id
    one = deliveries(client, t, hook["id"])[0]
    detail = client.get(f"/v1/webhooks/{hook['id']}/deliveries/{one['id']}",
                        headers=t.headers).json()
    codes = [a["status_code"] for a in detail["attempt_log"]]
    assert codes[0] is None and codes[-1] == 200 and 500 in codes
    assert len(codes) == detail["attempts"]


def test_a_delivery_is_given_up_after_the_give_up_time(app, client, factory, receiver  # noqa: ANN001
                                                       ) -> None:
    app.state.settings.webhook_give_up_s = 1.0
    t = factory.tenant()
    hook = create(client, t, receiver.url, ["task.cancelled"])
    receiver.stop()
    cancel_task(client, factory, t)
    [d] = wait_for(lambda: [d for d in deliveries(client, t, hook["id"])
                            if d["state"] == "failed"], 15, "the delivery given up")
    assert d["attempts"] >= 2 and d["next_attempt_at"] is None
    assert deliveries(client, t, hook["id"], state="pending") == []
    # Redelivery on request brings it back once the receiver is.
    receiver.start()
    app.state.settings.webhook_give_up_s = 3600.0
    r = client.post(f"/v1/webhooks/{hook['id']}/deliveries/{d['id']}/redeliver",
                    headers=t.headers)
    assert r.status_code == 202
    wait_for(lambda: deliveries(client, t, hook["id"], state="delivered"), 10, "the redelivery")
    assert receiver.ids() == [d["event_id"]]


def _state(client, tenant) -> list[dict]:  # noqa: ANN001
    return client.get("/v1/webhooks", headers=tenant.headers).json()["data"]


@pytest.mark.parametrize(("body", "param"), [
    ({"event_types": ["task.succeeded"]}, "url"),
    ({"url": "ftp://example.com/hook", "event_types": ["task.succeeded"]}, "url"),
    ({"url": "not a url", "event_types": ["task.succeeded"]}, "url"),
    ({"url": "http://user:pw@example.com/", "event_types": ["task.succeeded"]}, "url"),
    ({"url": "http://no-such-host.invalid/", "event_types": ["task.succeeded"]}, "url"),
    ({"url": "http://x.example/" + "a" * 2048, "event_types": ["task.succeeded"]}, "url"),
    ({"url": "http://example.com/\u0000", "event_types": ["task.succeeded"]}, "url"),
    ({"url": "http://[zz]/", "event_types": ["task.succeeded"]}, "url"),
    ({"url": "RECEIVER", "event_types": ["task.succeeded"], "description": "a\u0000"},
     "description"),
    ({"url": "RECEIVER", "event_types": []}, "event_types"),
    ({"url": "RECEIVER", "event_types": ["task.exploded"]}, "event_types"),
    ({"url": "RECEIVER", "event_types": "task.succeeded"}, "event_types"),
    ({"url": "RECEIVER"}, "event_types"),
    ({"url": "RECEIVER", "event_types": ["task.succeeded"], "description": "x" * 501},
     "description"),
    ({"url": "RECEIVER", "event_types": ["task.succeeded"], "secret": "mine"}, "secret"),
])
def test_bad_create_names_the_field_and_changes_nothing(client, factory, receiver, body,  # noqa: ANN001
                                                        param) -> None:
    t = factory.tenant()
    create(client, t, receiver.url)
    before = _state(client, t)
    if body.get("url") == "RECEIVER":
        body = {**body, "url": receiver.url}
    r = client.post("/v1/webhooks", headers=t.headers, json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert _state(client, t) == before


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/", "http://localhost/", "http://[::1]/",
                                 "http://10.1.2.3/", "http://169.254.169.254/latest/",
                                 "http://192.168.0.1/", "https://0.0.0.0/",
                                 "http://[::ffff:127.0.0.1]/", "http://224.0.0.1/"])
def test_private_addresses_are_refused_unless_allowed(app, client, factory, url: str  # noqa: ANN001
                                                      ) -> None:
    app.state.settings.webhook_allow_private = False
    t = factory.tenant()
    r = client.post("/v1/webhooks", headers=t.headers,
                    json={"url": url, "event_types": ["task.succeeded"]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "url", r.text
    assert r.json()["error"]["code"] == "invalid_url"
    assert _state(client, t) == []


def test_bad_updates_and_other_tenants_ids(app, client, factory, receiver) -> None:  # noqa: ANN001
    t, other = factory.tenant(), factory.tenant()
    hook = create(client, t, receiver.url, ["task.cancelled"])
    cancel_task(client, factory, t)
    [d] = wait_for(lambda: deliveries(client, t, hook["id"], state="delivered"), 10, "delivery")
    before = _state(client, t)
    base = f"/v1/webhooks/{hook['id']}"
    for body, param in [({"url": None}, "url"), ({"enabled": None}, "enabled"),
                        ({"event_types": ["nope"]}, "event_types"),
                        ({"event_types": []}, "event_types"), ({"url": "gopher://x/"}, "url"),
                        ({"colour": "red"}, "colour"), ({"enabled": "maybe"}, "enabled")]:
        r = client.patch(base, headers=t.headers, json=body)
        assert r.status_code == 422 and r.json()["error"]["param"] == param, (body, r.text)
    app.state.settings.webhook_allow_private = False
    r = client.patch(base, headers=t.headers, json={"url": "http://127.0.0.1:1/"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "url"
    app.state.settings.webhook_allow_private = True
    for params, param in [({"state": "lost"}, "state"), ({"limit": 0}, "limit"),
                          ({"after": "whdl_nope"}, "after")]:
        r = client.get(f"{base}/deliveries", headers=t.headers, params=params)
        assert r.status_code == 422 and r.json()["error"]["param"] == param, r.text
    # Another tenant's endpoint or delivery is a 404, whatever the route.
    for method, path in [("get", base), ("patch", base), ("delete", base),
                         ("get", f"{base}/deliveries"), ("get", f"{base}/deliveries/{d['id']}"),
                         ("post", f"{base}/deliveries/{d['id']}/redeliver"),
                         ("post", f"{base}/test")]:
        kwargs = {"json": {"enabled": False}} if method == "patch" else {}
        r = getattr(client, method)(path, headers=other.headers, **kwargs)
        assert r.status_code == 404 and r.json()["error"]["param"] == "webhook_id", (path, r.text)
    r = client.post(f"{base}/deliveries/whdl_unknown/redeliver", headers=t.headers)
    assert r.status_code == 404 and r.json()["error"]["param"] == "delivery_id"
    assert _state(client, t) == before
    assert deliveries(client, t, hook["id"]) == [d]
    assert receiver.ids() == [d["event_id"]]


def test_endpoints_per_tenant_are_capped(client, factory, receiver) -> None:  # noqa: ANN001
    from service.webhooks.endpoints import MAX_ENDPOINTS

    t = factory.tenant()
    for _ in range(MAX_ENDPOINTS):
        create(client, t, receiver.url, ["task.failed"])
    r = client.post("/v1/webhooks", headers=t.headers,
                    json={"url": receiver.url, "event_types": ["task.failed"]})
    assert r.status_code == 409 and r.json()["error"]["code"] == "too_many_webhooks"
    page = client.get("/v1/webhooks", headers=t.headers, params={"limit": 15}).json()
    assert len(page["data"]) == 15 and page["has_more"]
    rest = client.get("/v1/webhooks", headers=t.headers,
                      params={"limit": 15, "after": page["last_id"]}).json()
    assert len(rest["data"]) == MAX_ENDPOINTS - 15 and not rest["has_more"]


def test_a_tasks_samples_are_announced_signed(client, factory, session, receiver) -> None:  # noqa: ANN001
    """task.samples (issue 44): delivered, signed, once the executor's samples are stored."""
    from tests.integration.test_throughput_profiles import claimed

    t = factory.tenant()
    made = create(client, t, receiver.url, ["task.samples"])
    node = factory.node("gpu-s", gpus=1)
    task = factory.task(t)["id"]
    pid = claimed(client, factory, task, node)
    rows = [{"prompt": "Hi", "job_id": None, "completion": "hello", "tokens": 1}]
    for _ in range(2):  # a retried report announces nothing twice
        r = client.post(f"/internal/v1/tasks/{task}/samples", headers=factory.worker,
                        json={"placement_id": pid, "samples": rows})
        assert r.status_code == 200, r.text
    [got] = wait_for(lambda: receiver.of_type("task.samples"), 10, "the samples event")
    body = verify(made["secret"], got)
    assert body["data"]["id"] == task and body["data"]["prompts"] == 1 and body["data"]["file_id"]
    assert session.scalar(select(func.count()).select_from(WebhookEvent).where(
        WebhookEvent.type == "task.samples")) == 1
