"""Integration: samples on demand (issue 44) through the API, without torch. POST
/v1/tasks/{id}/samples checks the whole request first (a 422 naming the field stores nothing), a
node daemon claims it under a lease through the internal API and reports its completions, the
tenant reads its state and completions, another tenant sees nothing; a request whose node died
(lease ended) is claimed again and the stale claim can record nothing; attempts are bounded; the
prompts go with the task."""

from __future__ import annotations

import io
import json
from datetime import timedelta

from sqlalchemy import delete, func, select, update

from service.models import Node, SampleRequest, Task, utcnow
from tests.integration.factories import safetensors_bytes

CLAIM = "/internal/v1/sample_requests/claim"


def _job_with_adapter(client, factory, tid: str, pid: str, job: str, loss: float | None,  # noqa: ANN001
                      adapter: bool = True) -> None:
    w = factory.worker
    end = {"state": "completed", "best_val_loss": loss} if loss is not None else {"state": "failed"}
    for body in ({"state": "running"}, end):
        r = client.post(f"/internal/v1/jobs/{job}/state", headers=w, json={"placement_id": pid} | body)
        assert r.status_code == 200, r.text
    if not adapter:
        return
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    r = client.post(
        f"/internal/v1/tasks/{tid}/artifacts", headers=w,
        data={"meta": json.dumps({"kind": "adapter", "job_id": job, "placement_id": pid})},
        files=[("files", ("adapter_config.json", io.BytesIO(json.dumps(cfg).encode()), "x/y")),
               ("files", ("adapter_model.safetensors", io.BytesIO(safetensors_bytes()), "x/y"))])
    assert r.status_code == 201, r.text


def _task(client, factory, tenant, finish: bool = True) -> tuple[str, list[str], str]:  # noqa: ANN001
    """A task of three jobs: j0 (loss 2) and j1 (loss 1) with adapters, j2 failed without one."""
    task = factory.task(tenant, search_space={"learning_rate": [1e-4, 2e-4, 3e-4], "lora_rank": [4]})
    tid = task["id"]
    node = factory.node()
    pid = factory.placement(tid, node)
    assert client.post(f"/internal/v1/placements/{pid}/claim", headers=factory.worker,
                       json={"node_id": node}).status_code == 200
    jobs = [j["id"] for j in client.get(f"/v1/tasks/{tid}/jobs", headers=tenant.headers).json()["data"]]
    _job_with_adapter(client, factory, tid, pid, jobs[0], 2.0)
    _job_with_adapter(client, factory, tid, pid, jobs[1], 1.0)
    _job_with_adapter(client, factory, tid, pid, jobs[2], None, adapter=False)
    if finish:
        r = client.post(f"/internal/v1/tasks/{tid}/finished", headers=factory.worker,
                        json={"placement_id": pid})
        assert r.json()["state"] == "succeeded", r.text
    return tid, jobs, node


def _count(session) -> int:  # noqa: ANN001
    session.expire_all()
    return session.scalar(select(func.count()).select_from(SampleRequest))


def test_bad_requests_are_a_422_naming_the_field_and_store_nothing(client, factory, session) -> None:  # noqa: ANN001
    t = factory.tenant()
    running, _, _ = _task(client, factory, t, finish=False)
    r = client.post(f"/v1/tasks/{running}/samples", headers=t.headers, json={"prompts": ["hi"]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "task_id", r.text
    assert r.json()["error"]["code"] == "task_not_succeeded"
    tid, jobs, _ = _task(client, factory, t)
    url = f"/v1/tasks/{tid}/samples"
    for body, param in (
            ({"prompts": []}, "prompts"),
            ({"prompts": ["p"] * 33}, "prompts"),
            ({"prompts": ["x" * 8001]}, "prompts"),
            ({"prompts": [""]}, "prompts"),
            ({"prompts": ["p"], "max_new_tokens": 0}, "max_new_tokens"),
            ({"prompts": ["p"], "max_new_tokens": 1025}, "max_new_tokens"),
            ({"prompts": ["p"], "temperature": 3}, "temperature"),
            ({"prompts": ["p"], "top_p": 0}, "top_p"),
            ({"prompts": ["p"], "top_k": 9}, "top_k"),
            ({"prompts": ["p"], "job_ids": ["a"] * 9}, "job_ids"),
            ({"prompts": ["p"], "job_ids": [jobs[2]]}, "job_ids"),  # no adapter
            ({"prompts": ["p"], "job_ids": ["job_nope"]}, "job_ids"),
            ({"prompts": ["p"], "job_ids": [jobs[0], jobs[0]]}, "job_ids"),
            ({"prompts": ["p"], "job_ids": [jobs[0]], "top_k": 1}, "top_k"),
            ({"prompts": ["p"], "top_k": 0, "include_base": False}, "include_base"),
            ({"prompts": ["p"], "seeed": 1}, "seeed")):
        r = client.post(url, headers=t.headers, json=body)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
        assert "Traceback" not in r.text and "/tmp" not in r.text
    r = client.post(url, headers=t.headers, json={"prompts": ["p"], "job_ids": [jobs[2]]})
    assert jobs[2] in r.json()["error"]["message"] and "no adapter" in r.json()["error"]["message"]
    assert _count(session) == 0
    # another tenant's task (or job) is not found
    other = factory.tenant()
    assert client.post(url, headers=other.headers, json={"prompts": ["p"]}).status_code == 404
    assert _count(session) == 0


def test_a_request_is_claimed_answered_and_shown_to_its_tenant_alone(client, factory, session) -> None:  # noqa: ANN001
    t, other = factory.tenant(), factory.tenant()
    tid, jobs, node = _task(client, factory, t)
    r = client.post(f"/v1/tasks/{tid}/samples", headers=t.headers,
                    json={"prompts": ["Say hi", "Count"], "top_k": 5, "max_new_tokens": 4, "seed": 7})
    assert r.status_code == 202, r.text
    req = r.json()
    # the jobs with an adapter, best first; the job without one is left out
    assert req["state"] == "queued" and req["job_ids"] == [jobs[1], jobs[0]]
    assert req["data"] == [] and req["prompts"] == ["Say hi", "Count"] and req["seed"] == 7
    url = f"/v1/tasks/{tid}/samples/{req['id']}"
    assert client.get(url, headers=other.headers).status_code == 404
    assert client.get(f"/v1/tasks/{tid}/samples/requests", headers=other.headers).status_code == 404
    assert client.get(f"/v1/tasks/{tid}/samples/smpl_nope", headers=t.headers).status_code == 404
    assert client.get(f"/v1/tasks/{tid}/samples/requests", headers=t.headers).json()["data"][0]["id"] == req["id"]

    assert client.post(CLAIM, headers=t.headers, json={"node_id": node}).status_code in (401, 403)
    assert client.post(CLAIM, headers=factory.worker, json={"node_id": "node_nope"}).status_code == 404
    work = client.post(CLAIM, headers=factory.worker, json={"node_id": node})
    assert work.status_code == 200, work.text
    w = work.json()
    assert w["request_id"] == req["id"] and w["prompts"] == ["Say hi", "Count"] and w["attempt"] == 1
    assert [a["job_id"] for a in w["adapters"]] == [jobs[1], jobs[0]] and w["base_model"] == "tiny-llama"
    files = w["adapters"][0]["files"]
    assert sorted(f.rsplit("/", 1)[1] for f in files) == ["adapter_config.json", "adapter_model.safetensors"]
    assert client.get(files[0], headers=factory.worker).status_code == 200
    assert client.post(CLAIM, headers=factory.worker, json={"node_id": node}).status_code == 204
    assert client.get(url, headers=t.headers).json()["state"] == "running"
    base = f"/internal/v1/sample_requests/{req['id']}"
    assert client.post(f"{base}/lease", headers=factory.worker,
                       json={"lease_token": w["lease_token"]}).json() == {"state": "running", "mine": True}

    rows = [{"prompt": p, "job_id": j, "completion": f"{p}-{j}", "tokens": 3}
            for p in ("Say hi", "Count") for j in (None, jobs[1], jobs[0])]
    stray = rows + [{"prompt": "Count", "job_id": jobs[2], "completion": "x", "tokens": 1}]
    r = client.post(f"{base}/result", headers=factory.worker,
                    json={"lease_token": w["lease_token"], "samples": stray})
    assert r.status_code == 422 and r.json()["error"]["param"] == "samples"
    assert client.post(f"{base}/result", headers=factory.worker,
                       json={"lease_token": "nope", "samples": rows}).json()["mine"] is False
    r = client.post(f"{base}/result", headers=factory.worker,
                    json={"lease_token": w["lease_token"], "samples": rows})
    assert r.json() == {"state": "succeeded", "mine": True}, r.text
    done = client.get(url, headers=t.headers).json()
    assert done["state"] == "succeeded" and done["data"] == rows and done["finished_at"] is not None
    # a late report of the same claim changes nothing
    assert client.post(f"{base}/failed", headers=factory.worker,
                       json={"lease_token": w["lease_token"], "error": "x"}).json()["mine"] is False
    assert client.get(url, headers=t.headers).json() == done

    # the prompts go with the task
    session.execute(delete(Task).where(Task.id == tid))
    session.commit()
    assert _count(session) == 0


def _expire(session, request_id: str) -> None:  # noqa: ANN001
    session.execute(update(SampleRequest).where(SampleRequest.id == request_id).values(
        lease_until=utcnow() - timedelta(seconds=1)))
    session.commit()


def test_a_request_whose_node_died_is_retried_then_fails_clearly(client, factory, session, settings) -> None:  # noqa: ANN001
    t = factory.tenant()
    tid, jobs, node = _task(client, factory, t)
    req = client.post(f"/v1/tasks/{tid}/samples", headers=t.headers,
                      json={"prompts": ["p"], "job_ids": [jobs[0]]}).json()
    url, base = f"/v1/tasks/{tid}/samples/{req['id']}", f"/internal/v1/sample_requests/{req['id']}"
    first = client.post(CLAIM, headers=factory.worker, json={"node_id": node}).json()
    _expire(session, req["id"])  # its node died
    second = client.post(CLAIM, headers=factory.worker, json={"node_id": node}).json()
    assert second["request_id"] == req["id"] and second["attempt"] == 2
    assert second["lease_token"] != first["lease_token"]
    stale = client.post(f"{base}/lease", headers=factory.worker, json={"lease_token": first["lease_token"]})
    assert stale.json() == {"state": "running", "mine": False}
    ok = [{"prompt": "p", "job_id": None, "completion": "c", "tokens": 1}]
    assert client.post(f"{base}/result", headers=factory.worker,
                       json={"lease_token": first["lease_token"], "samples": ok}).json()["mine"] is False
    # the node gives it back retryably: queued again, with why
    r = client.post(f"{base}/failed", headers=factory.worker, json={
        "lease_token": second["lease_token"], "error": "executor at /srv/x crashed", "retryable": True})
    assert r.json() == {"state": "queued", "mine": True}
    got = client.get(url, headers=t.headers).json()
    assert got["state"] == "queued" and "/srv" not in got["error"]
    third = client.post(CLAIM, headers=factory.worker, json={"node_id": node}).json()
    assert third["attempt"] == settings.sample_max_attempts == 3
    _expire(session, req["id"])
    assert client.post(CLAIM, headers=factory.worker, json={"node_id": node}).status_code == 204
    got = client.get(url, headers=t.headers).json()
    assert got["state"] == "failed" and "interrupted 3 times" in got["error"] and got["data"] == []


def test_a_request_the_node_cannot_run_fails_with_its_message(client, factory) -> None:  # noqa: ANN001
    t = factory.tenant()
    tid, _, node = _task(client, factory, t)
    req = client.post(f"/v1/tasks/{tid}/samples", headers=t.headers,
                      json={"prompts": ["p"], "top_k": 0}).json()
    assert req["job_ids"] == [] and req["include_base"] is True
    work = client.post(CLAIM, headers=factory.worker, json={"node_id": node}).json()
    assert work["adapters"] == []
    r = client.post(f"/internal/v1/sample_requests/{req['id']}/failed", headers=factory.worker,
                    json={"lease_token": work["lease_token"], "error": "the prompts do not tokenize"})
    assert r.json() == {"state": "failed", "mine": True}
    got = client.get(f"/v1/tasks/{tid}/samples/{req['id']}", headers=t.headers).json()
    assert got["state"] == "failed" and got["error"] == "the prompts do not tokenize"


def test_a_warm_executor_of_the_model_gets_the_request_first(client, factory, session) -> None:  # noqa: ANN001
    t = factory.tenant()
    tid, _, cold = _task(client, factory, t)
    warm = factory.node()
    session.execute(update(Node).where(Node.id == warm).values(
        executors=[{"key": "tiny-llama|sft|2048|*", "gpu_indices": [0], "placement_ids": []}],
        executors_at=utcnow()))
    session.commit()
    req = client.post(f"/v1/tasks/{tid}/samples", headers=t.headers, json={"prompts": ["p"]}).json()
    assert client.post(CLAIM, headers=factory.worker, json={"node_id": cold}).status_code == 204
    work = client.post(CLAIM, headers=factory.worker,
                       json={"node_id": warm, "warm_models": ["tiny-llama"]}).json()
    assert work["request_id"] == req["id"]
