"""Integration: an Idempotency-Key's digest is of the canonical request (the validated body without
its defaults), so a retry across an upgrade that added a setting, or one spelling a default out,
replays instead of answering 409; keys stored with the digests of earlier versions (the JSON as
sent, the body with every default) still replay."""

from __future__ import annotations

import hashlib
import json

from sqlalchemy import select

from service.idempotency import canonical_request, legacy_request_hash, request_hash
from service.models import IdempotencyKey, Task
from service.schemas import TaskCreate


def _raw_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def _recorded(session, tenant_id: str, key: str, digest: str, task_id: str) -> None:  # noqa: ANN001
    """The key as a version before this one stored it: its digest, pointing at its task."""
    session.add(IdempotencyKey(tenant_id=tenant_id, key=key, request_hash=digest,
                               resource_id=task_id))
    session.commit()


def test_a_body_recorded_before_a_new_setting_replays(client, factory, session) -> None:  # noqa: ANN001
    t = factory.tenant()
    f = factory.file(t)["id"]
    # the body a client sent before the settings it leaves out existed, and its task
    body = {"training_file": f, "base_model": "tiny-llama", "max_seq_len": 64,
            "search_space": {"lora_rank": [4], "learning_rate": [1e-4]}}
    task = factory.task(t, f, **body)
    _recorded(session, t.id, "before-upgrade", _raw_digest(body), task["id"])
    # sent again, keys in another order: a replay of that task, not a 409
    again = dict(reversed(list(body.items())))
    r = client.post("/v1/tasks", content=json.dumps(again), headers=t.headers | {
        "Idempotency-Key": "before-upgrade", "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == task["id"] and r.headers["Idempotent-Replayed"] == "true"
    # another body under that key is still a 409 and creates nothing
    r = client.post("/v1/tasks", headers=t.headers | {"Idempotency-Key": "before-upgrade"},
                    json=body | {"seed": 3})
    assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_key_reused"
    session.expire_all()
    assert len(session.scalars(select(Task).where(Task.tenant_id == t.id)).all()) == 1


def test_the_digest_is_of_the_canonical_request(client, factory, session) -> None:  # noqa: ANN001
    """A create stores the digest of what it asked for (the validated body without defaults): a
    retry that spells a default out replays; the OpenAI-compatible route does the same."""
    t = factory.tenant()
    f = factory.file(t)["id"]
    body = {"base_model": "tiny-llama", "training_file": f, "max_seq_len": 64}
    r = client.post("/v1/tasks", headers=t.headers | {"Idempotency-Key": "native"}, json=body)
    assert r.status_code == 201, r.text
    spelled = body | {"integrations": [], "seed": 0, "eval": {"eval_min_samples": 64}}  # defaults
    again = client.post("/v1/tasks", headers=t.headers | {"Idempotency-Key": "native"}, json=spelled)
    assert again.status_code == 200 and again.json()["id"] == r.json()["id"], again.text
    other = client.post("/v1/tasks", headers=t.headers | {"Idempotency-Key": "native"},
                        json=body | {"seed": 1})
    assert other.status_code == 409
    job = {"model": "tiny-llama", "training_file": f,
           "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}}}
    r = client.post("/v1/fine_tuning/jobs", headers=t.headers | {"Idempotency-Key": "openai"},
                    json=job)
    assert r.status_code == 200, r.text
    first = r.json()["id"]
    r = client.post("/v1/fine_tuning/jobs", headers=t.headers | {"Idempotency-Key": "openai"},
                    json=job)
    assert r.status_code == 200 and r.json()["id"] == first
    rows = {row.key: row.request_hash for row in session.scalars(
        select(IdempotencyKey).where(IdempotencyKey.tenant_id == t.id))}
    assert rows["native"] == request_hash(canonical_request(TaskCreate.model_validate(body)))
    assert rows["openai"] != _raw_digest(job)  # the canonical task request, not the raw JSON


def test_a_key_stored_by_an_earlier_version_still_replays(client, factory, session) -> None:  # noqa: ANN001
    t = factory.tenant()
    f = factory.file(t)["id"]
    body = {"base_model": "tiny-llama", "training_file": f, "max_seq_len": 64}
    task = factory.task(t, f, **body)
    _recorded(session, t.id, "legacy", legacy_request_hash(TaskCreate.model_validate(body)),
              task["id"])
    r = client.post("/v1/tasks", headers=t.headers | {"Idempotency-Key": "legacy"}, json=body)
    assert r.status_code == 200 and r.json()["id"] == task["id"], r.text
