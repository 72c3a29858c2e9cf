"""Integration: the worker side of the API played by a test client — register, heartbeat, claim
from the Redis queue, events, metrics, job states, artifacts, finish/fail — then the user's view."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from datetime import timedelta

import redis
from rq import Queue
from sqlalchemy import select

from contract.protocol import PLACEMENT_FUNC, PlacementSpec, cancel_key, node_queue_name
from service.adapters import portable_config
from service.cluster import mark_stale_nodes
from service.models import Node, Placement
from service.queue import republish_all
from tests.integration.factories import safetensors_bytes

ADAPTER_CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                  "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": "tiny-llama"}


def _upload_adapter(client, factory, task_id, pid, job_id, config=None):  # noqa: ANN001, ANN202
    cfg = json.dumps(config or ADAPTER_CONFIG).encode()
    return client.post(
        f"/internal/v1/tasks/{task_id}/artifacts", headers=factory.worker,
        data={"meta": json.dumps({"kind": "adapter", "job_id": job_id, "placement_id": pid})},
        files=[("files", ("adapter_config.json", io.BytesIO(cfg), "application/json")),
               ("files", ("adapter_model.safetensors", io.BytesIO(safetensors_bytes()),
                          "application/octet-stream"))])


def _queued_ids(settings, node_id):  # noqa: ANN001, ANN202
    conn = redis.Redis.from_url(settings.redis_url)
    q = Queue(node_queue_name(node_id), connection=conn)
    return [(j.func_name, j.args) for j in q.get_jobs()]


def test_worker_round_trip(client, factory, settings):  # noqa: ANN001
    t = factory.tenant()
    task = factory.task(t, search_space={"learning_rate": [1e-4, 3e-4], "lora_rank": [4]})
    tid = task["id"]
    node_id = factory.node("gpu-a", gpus=2)
    pid = factory.placement(tid, node_id, gpus=(1,))
    assert _queued_ids(settings, node_id) == [(PLACEMENT_FUNC, (pid,))]

    w = factory.worker
    hb = client.post(f"/internal/v1/nodes/{node_id}/heartbeat", headers=w, json={})
    assert hb.status_code == 200 and hb.json()["cancelled_placement_ids"] == []

    r = client.post(f"/internal/v1/placements/{pid}/claim", headers=w, json={"node_id": node_id})
    assert r.status_code == 200, r.text
    spec = PlacementSpec.model_validate(r.json())
    assert spec.task_id == tid and spec.gpu_indices == [1] and spec.attempt == 1
    assert spec.base_model_path == "/models/tiny-llama" and spec.settings.max_seq_len == 128
    assert len(spec.jobs) == 2 and spec.resume_checkpoint_artifact_id is None
    assert spec.settings.early_exit.patience == 2 and spec.training_file_format == "chat"
    again = client.post(f"/internal/v1/placements/{pid}/claim", headers=w,
                        json={"node_id": node_id})
    assert again.status_code == 200 and again.json() == r.json()
    other = factory.node("gpu-b")
    r2 = client.post(f"/internal/v1/placements/{pid}/claim", headers=w, json={"node_id": other})
    assert r2.status_code == 409
    assert client.get(f"/v1/tasks/{tid}", headers=t.headers).json()["state"] == "running"

    content = client.get(spec.training_file_url, headers=w)
    assert content.status_code == 200 and content.content.count(b"\n") == 12

    j0, j1 = (j.job_id for j in spec.jobs)
    for job in (j0, j1):
        r = client.post(f"/internal/v1/jobs/{job}/state", headers=w,
                        json={"placement_id": pid, "state": "running"})
        assert r.status_code == 200 and r.json()["state"] == "running"

    events = {"placement_id": pid,
              "events": [{"type": "log", "message": "step 1", "job_id": j0, "client_key": "k1"},
                         {"type": "log", "message": "step 2", "client_key": "k2"}]}
    assert client.post(f"/internal/v1/tasks/{tid}/events", headers=w,
                       json=events).json() == {"stored": 2}
    assert client.post(f"/internal/v1/tasks/{tid}/events", headers=w,
                       json=events).json() == {"stored": 0}

    points = [{"job_id": j, "step": s, "split": "train", "loss": 2.0 - 0.1 * s + (j == j1)}
              for j in (j0, j1) for s in range(1, 4)]
    points += [{"job_id": j0, "step": 3, "split": "val", "loss": 1.5},
               {"job_id": j1, "step": 3, "split": "val", "loss": float("nan")}]
    # json.dumps writes NaN, as a Python worker would
    batch = json.dumps({"placement_id": pid, "points": points})
    jw = w | {"Content-Type": "application/json"}
    assert client.post(f"/internal/v1/tasks/{tid}/metrics", headers=jw,
                       content=batch).json() == {"stored": 8}
    assert client.post(f"/internal/v1/tasks/{tid}/metrics", headers=jw,
                       content=batch).json() == {"stored": 0}

    r = client.post(f"/internal/v1/jobs/{j1}/state", headers=w,
                    json={"placement_id": pid, "state": "exited", "exit_reason": "diverging",
                          "last_step": 3})
    assert r.status_code == 200 and r.json()["exit_reason"] == "diverging"
    r = client.post(f"/internal/v1/jobs/{j0}/state", headers=w,
                    json={"placement_id": pid, "state": "completed", "best_val_loss": 1.5,
                          "best_step": 3})
    assert r.status_code == 200
    # Retrying a terminal state is fine; leaving it is not.
    assert client.post(f"/internal/v1/jobs/{j0}/state", headers=w,
                       json={"placement_id": pid, "state": "completed"}).status_code == 200
    assert client.post(f"/internal/v1/jobs/{j0}/state", headers=w,
                       json={"placement_id": pid, "state": "running"}).status_code == 409

    up = _upload_adapter(client, factory, tid, pid, j0)
    assert up.status_code == 201, up.text
    assert {f["name"] for f in up.json()["files"]} == {"adapter_config.json",
                                                       "adapter_model.safetensors"}
    up2 = _upload_adapter(client, factory, tid, pid, j0)
    assert up2.json()["artifact_id"] == up.json()["artifact_id"]

    fin = client.post(f"/internal/v1/tasks/{tid}/finished", headers=w,
                      json={"placement_id": pid})
    assert fin.status_code == 200 and fin.json() == {"task_id": tid, "state": "succeeded",
                                                     "best_job_id": j0}
    assert client.post(f"/internal/v1/tasks/{tid}/finished", headers=w,
                       json={"placement_id": pid}).status_code == 200

    # The user's view.
    got = client.get(f"/v1/tasks/{tid}", headers=t.headers).json()
    assert got["state"] == "succeeded" and got["best_job_id"] == j0
    assert got["job_counts"] == {"completed": 1, "exited": 1}
    jobs = {j["id"]: j for j in client.get(f"/v1/tasks/{tid}/jobs",
                                           headers=t.headers).json()["data"]}
    assert jobs[j0]["has_adapter"] and jobs[j0]["best_val_loss"] == 1.5
    assert jobs[j1]["exit_reason"] == "diverging" and not jobs[j1]["has_adapter"]
    m = client.get(f"/v1/tasks/{tid}/metrics", headers=t.headers).json()
    curves = {c["job_id"]: c for c in m["jobs"]}
    assert [p["step"] for p in curves[j0]["train"]] == [1, 2, 3]
    assert abs(curves[j1]["train"][0]["loss"] - 2.9) < 1e-9
    assert curves[j1]["val"] == [{"step": 3, "loss": None}]  # NaN reported as null
    ev = client.get(f"/v1/tasks/{tid}/events", headers=t.headers).json()["data"]
    types = [e["type"] for e in ev]
    assert types[:3] == ["task_created", "task_queued", "task_running"]
    assert "job_exited" in types and "adapter_uploaded" in types and types[-1] == "task_succeeded"

    tgz = client.get(f"/v1/tasks/{tid}/adapter", headers=t.headers)
    assert tgz.status_code == 200 and tgz.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(tgz.content), mode="r:gz") as tf:
        assert sorted(tf.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert json.loads(tf.extractfile("adapter_config.json").read()) == portable_config(
            ADAPTER_CONFIG, "tiny-llama")
        assert tf.extractfile("adapter_model.safetensors").read() == safetensors_bytes()
    zp = client.get(f"/v1/jobs/{j0}/adapter", headers=t.headers, params={"format": "zip"})
    assert zp.status_code == 200
    with zipfile.ZipFile(io.BytesIO(zp.content)) as zf:
        assert sorted(zf.namelist()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert zf.read("adapter_model.safetensors") == safetensors_bytes()
    assert client.get(f"/v1/jobs/{j1}/adapter", headers=t.headers).status_code == 404


def test_internal_requires_worker_token(client, factory):  # noqa: ANN001
    t = factory.tenant()
    body = {"name": "n", "gpu_type": "x", "gpu_count": 1, "gpu_memory_bytes": 1}
    assert client.post("/internal/v1/nodes", json=body).status_code == 401
    assert client.post("/internal/v1/nodes", json=body, headers=t.headers).status_code == 401
    r = client.post("/internal/v1/nodes", json=body | {"gpu_count": -1}, headers=factory.worker)
    assert r.status_code == 422 and r.json()["error"]["param"] == "gpu_count"
    assert client.get("/v1/cluster", headers=t.headers).status_code == 401


def test_bad_artifacts_and_reports(client, factory):  # noqa: ANN001
    t = factory.tenant()
    task = factory.task(t)
    tid = task["id"]
    node = factory.node()
    pid = factory.placement(tid, node)
    w = factory.worker
    client.post(f"/internal/v1/placements/{pid}/claim", headers=w, json={"node_id": node})
    job = client.get(f"/v1/tasks/{tid}/jobs", headers=t.headers).json()["data"][0]["id"]
    only_cfg = client.post(
        f"/internal/v1/tasks/{tid}/artifacts", headers=w,
        data={"meta": json.dumps({"kind": "adapter", "job_id": job, "placement_id": pid})},
        files=[("files", ("adapter_config.json", io.BytesIO(b"{}"), "application/json"))])
    assert only_cfg.status_code == 422 and "adapter_model.safetensors" in only_cfg.text
    bad_st = client.post(
        f"/internal/v1/tasks/{tid}/artifacts", headers=w,
        data={"meta": json.dumps({"kind": "adapter", "job_id": job, "placement_id": pid})},
        files=[("files", ("adapter_config.json", io.BytesIO(b"{}"), "application/json")),
               ("files", ("adapter_model.safetensors", io.BytesIO(b"junk"), "x/y"))])
    assert bad_st.status_code == 422
    r = client.post(f"/internal/v1/tasks/{tid}/artifacts", headers=w,
                    data={"meta": "{not json"},
                    files=[("files", ("a", io.BytesIO(b"x"), "x/y"))])
    assert r.status_code == 422 and r.json()["error"]["param"].startswith("meta")
    r = client.post(f"/internal/v1/tasks/{tid}/metrics", headers=w, json={
        "placement_id": pid,
        "points": [{"job_id": "job_other", "step": 1, "split": "train", "loss": 1.0}]})
    assert r.status_code == 422
    r = client.post(f"/internal/v1/jobs/{job}/state", headers=w,
                    json={"placement_id": pid, "state": "exited"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "exit_reason"
    r = client.post(f"/internal/v1/tasks/{tid}/finished", headers=w, json={"placement_id": pid})
    assert r.status_code == 200 and r.json()["state"] == "failed"  # no job left an adapter
    assert client.get(f"/v1/tasks/{tid}", headers=t.headers).json()["error"]["message"] == \
        "no job produced an adapter"


def test_checkpoint_resume_after_retryable_failure(client, factory, session, settings):  # noqa: ANN001
    t = factory.tenant()
    tid = factory.task(t)["id"]
    node = factory.node()
    w = factory.worker
    pid = factory.placement(tid, node)
    client.post(f"/internal/v1/placements/{pid}/claim", headers=w, json={"node_id": node})
    for step in (10, 20):
        r = client.post(f"/internal/v1/tasks/{tid}/artifacts", headers=w,
                        data={"meta": json.dumps({"kind": "checkpoint", "step": step,
                                                  "placement_id": pid})},
                        files=[("files", ("state.pt", io.BytesIO(b"S%d" % step), "x/y"))])
        assert r.status_code == 201
    r = client.post(f"/internal/v1/tasks/{tid}/failed", headers=w,
                    json={"placement_id": pid, "error": "CUDA error", "retryable": True})
    assert r.status_code == 200 and r.json()["state"] == "queued"
    from service.cluster import next_attempt

    assert next_attempt(session, tid) == 2
    pid2 = factory.placement(tid, node, attempt=2)
    spec = client.post(f"/internal/v1/placements/{pid2}/claim", headers=w,
                       json={"node_id": node}).json()
    assert spec["attempt"] == 2 and spec["resume_checkpoint_artifact_id"]
    [url] = spec["resume_checkpoint_files"]
    assert client.get(url, headers=w).content == b"S20"
    # The stale first placement cannot finish the task any more.
    r = client.post(f"/internal/v1/tasks/{tid}/finished", headers=w, json={"placement_id": pid})
    assert r.status_code == 409
    r = client.post(f"/internal/v1/tasks/{tid}/failed", headers=w,
                    json={"placement_id": pid2, "error": "bad data", "retryable": False})
    assert r.json()["state"] == "failed"
    assert client.get(f"/v1/tasks/{tid}", headers=t.headers).json()["error"]["message"] == \
        "bad data"


def test_cancel_reaches_worker(client, factory, settings):  # noqa: ANN001
    t = factory.tenant()
    tid = factory.task(t)["id"]
    node = factory.node()
    w = factory.worker
    pid = factory.placement(tid, node)
    client.post(f"/internal/v1/placements/{pid}/claim", headers=w, json={"node_id": node})
    assert client.post(f"/v1/tasks/{tid}/cancel", headers=t.headers).status_code == 200
    conn = redis.Redis.from_url(settings.redis_url)
    assert conn.get(cancel_key(pid)) == b"1"  # the attempt, never the bare task
    assert conn.get(cancel_key(tid)) is None
    hb = client.post(f"/internal/v1/nodes/{node}/heartbeat", headers=w,
                     json={"running_placement_ids": [pid]}).json()
    assert hb["cancelled_placement_ids"] == [pid]
    job = client.get(f"/v1/tasks/{tid}/jobs", headers=t.headers).json()["data"][0]["id"]
    r = client.post(f"/internal/v1/jobs/{job}/state", headers=w,
                    json={"placement_id": pid, "state": "running"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "task_cancelled"
    r = client.post(f"/internal/v1/tasks/{tid}/finished", headers=w, json={"placement_id": pid})
    assert r.status_code == 409 and r.json()["error"]["code"] == "task_cancelled"


def test_cancel_unqueues_published_placement(client, factory, settings):  # noqa: ANN001
    t = factory.tenant()
    tid = factory.task(t)["id"]
    node = factory.node()
    pid = factory.placement(tid, node)
    assert len(_queued_ids(settings, node)) == 1
    client.post(f"/v1/tasks/{tid}/cancel", headers=t.headers)
    assert _queued_ids(settings, node) == []
    r = client.post(f"/internal/v1/placements/{pid}/claim", headers=factory.worker,
                    json={"node_id": node})
    assert r.status_code == 409


def test_republish_after_redis_wipe(client, factory, session, settings):  # noqa: ANN001
    t = factory.tenant()
    node = factory.node()
    pids = [factory.placement(factory.task(t)["id"], node) for _ in range(2)]
    conn = redis.Redis.from_url(settings.redis_url)
    conn.flushall()
    assert _queued_ids(settings, node) == []
    assert republish_all(session, settings) == 2
    assert sorted(a[0] for _, a in _queued_ids(settings, node)) == sorted(pids)
    assert republish_all(session, settings) == 0  # already queued: no duplicates


def test_stale_node_goes_down_and_task_requeues(client, factory, session, settings):  # noqa: ANN001
    t = factory.tenant()
    tid = factory.task(t)["id"]
    node = factory.node()
    idle = factory.node()
    pid = factory.placement(tid, node)
    w = factory.worker
    client.post(f"/internal/v1/placements/{pid}/claim", headers=w, json={"node_id": node})
    row = session.get(Node, node)
    row.last_heartbeat_at = row.last_heartbeat_at - timedelta(seconds=settings.node_timeout_s + 5)
    session.commit()
    assert mark_stale_nodes(session, settings) == [node]
    session.expire_all()
    assert session.get(Node, node).state == "down" and session.get(Node, idle).state == "up"
    assert session.scalar(select(Placement.state).where(Placement.id == pid)) == "failed"
    assert client.get(f"/v1/tasks/{tid}", headers=t.headers).json()["state"] == "queued"
    cluster = client.get("/v1/cluster", headers={"Authorization": "Bearer test-admin-token"})
    assert cluster.status_code == 200
    assert cluster.json()["gpus_up"] == 2 and cluster.json()["queued_tasks"] == 1
    hb = client.post(f"/internal/v1/nodes/{node}/heartbeat", headers=w,
                     json={"running_placement_ids": [pid]}).json()
    assert hb["state"] == "up" and hb["cancelled_placement_ids"] == [pid]  # stop the orphan


def test_ended_task_retires_waiting_placements(client, factory, session, settings):  # noqa: ANN001
    t = factory.tenant()
    tid = factory.task(t)["id"]
    a, b = factory.node(), factory.node()
    w = factory.worker
    running = factory.placement(tid, a)
    client.post(f"/internal/v1/placements/{running}/claim", headers=w, json={"node_id": a})
    spare = factory.placement(tid, b)
    assert len(_queued_ids(settings, b)) == 1
    r = client.post(f"/internal/v1/tasks/{tid}/failed", headers=w,
                    json={"placement_id": running, "error": "OOM", "retryable": False})
    assert r.json()["state"] == "failed"
    session.expire_all()
    assert session.get(Placement, spare).state == "superseded"
    assert _queued_ids(settings, b) == []
