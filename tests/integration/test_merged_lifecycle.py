"""Integration: the lifecycle of a merged model under failures, without torch. A claim holds a
lease; a merge whose process died (lease ended) is claimed again and the stale claim can no
longer record anything; after merge_max_attempts interruptions it fails; asking again queues it
anew; a base model whose weights are missing fails with a message naming no server path."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest
from sqlalchemy import update

from service.merged import lifecycle
from service.merged.runner import Merger
from service.models import MergedModel, utcnow
from tests.integration.factories import safetensors_bytes


@pytest.fixture
def settings(settings):  # noqa: ANN001, ANN201 - no merger thread: the test drives it
    settings.merge_poll_s = 0
    return settings


def _succeeded_task(client, factory, tenant) -> tuple[str, str]:  # noqa: ANN001
    task = factory.task(tenant, search_space={"learning_rate": [1e-4], "lora_rank": [4]})
    tid, w = task["id"], factory.worker
    node = factory.node("n-lifecycle")
    pid = factory.placement(tid, node)
    assert client.post(f"/internal/v1/placements/{pid}/claim", headers=w,
                       json={"node_id": node}).status_code == 200
    job = client.get(f"/v1/tasks/{tid}/jobs", headers=tenant.headers).json()["data"][0]["id"]
    for body in ({"state": "running"}, {"state": "completed", "best_val_loss": 1.0}):
        assert client.post(f"/internal/v1/jobs/{job}/state", headers=w,
                           json={"placement_id": pid} | body).status_code == 200
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    r = client.post(
        f"/internal/v1/tasks/{tid}/artifacts", headers=w,
        data={"meta": json.dumps({"kind": "adapter", "job_id": job, "placement_id": pid})},
        files=[("files", ("adapter_config.json", io.BytesIO(json.dumps(cfg).encode()), "x/y")),
               ("files", ("adapter_model.safetensors", io.BytesIO(safetensors_bytes()), "x/y"))])
    assert r.status_code == 201, r.text
    assert client.post(f"/internal/v1/tasks/{tid}/finished", headers=w,
                       json={"placement_id": pid}).json()["state"] == "succeeded"
    return tid, job


def _expire(session, merged_id: str) -> None:  # noqa: ANN001
    session.execute(update(MergedModel).where(MergedModel.id == merged_id).values(
        lease_until=utcnow() - timedelta(seconds=1)))
    session.commit()


def test_leases_attempts_and_a_clear_failure(client, factory, session, settings, app):  # noqa: ANN001
    t = factory.tenant()
    tid, job = _succeeded_task(client, factory, t)
    url = f"/v1/tasks/{tid}/merged"
    r = client.post(url, headers=t.headers)
    assert r.status_code == 202 and r.json()["state"] == "queued"
    mid = r.json()["id"]

    first = lifecycle.claim_next(session, settings)
    assert first is not None and first.merged_id == mid and first.job_id == job
    assert client.get(url, headers=t.headers).json()["state"] == "running"
    assert lifecycle.claim_next(session, settings) is None  # its lease holds
    assert lifecycle.renew(session, first, settings)
    _expire(session, mid)  # its process died
    second = lifecycle.claim_next(session, settings)
    assert second is not None and second.token != first.token
    assert not lifecycle.renew(session, first, settings)
    assert not lifecycle.succeed(session, first, "merged/x/model.tar", 1, "bfloat16")
    for _ in range(settings.merge_max_attempts - 2):  # the third attempt runs
        _expire(session, mid)
        lifecycle.claim_next(session, settings)
    assert lifecycle.claim_next(session, settings) is None
    got = client.get(url, headers=t.headers).json()
    assert got["state"] == "running"
    _expire(session, mid)
    assert lifecycle.claim_next(session, settings) is None
    got = client.get(url, headers=t.headers).json()
    assert got["state"] == "failed" and "interrupted 3 times" in got["error"], got
    r = client.get(f"{url}/content", headers=t.headers)
    assert r.status_code == 409 and r.json()["error"]["code"] == "merge_failed"

    # asked again: queued anew; the registered model's directory is missing on this service
    again = client.post(url, headers=t.headers)
    assert again.status_code == 202 and again.json()["state"] == "queued"
    assert again.json()["id"] == mid and again.json()["error"] is None
    merger = Merger(app.state.sessionmaker, settings, app.state.storage, app.state.registry)
    assert merger.run_once() and not merger.run_once()
    got = client.get(url, headers=t.headers).json()
    assert got["state"] == "failed" and got["finished_at"] is not None
    assert "not available on this service" in got["error"] and "/" not in got["error"], got
    task = client.get(f"/v1/tasks/{tid}", headers=t.headers).json()
    assert task["state"] == "succeeded" and task["best_job_id"] == job
