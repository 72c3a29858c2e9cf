"""Integration: findings of the outside audit. What a tenant reads (task error, events) carries no
traceback, server path or node identity; a query integer past int64 and a hostile JSON body are
a 422 naming the field, never a 500; nothing is created by a refused request."""

from __future__ import annotations

import json

INT64_OVER = str(2**63)


def _claim(client, factory, node_name: str):  # noqa: ANN001, ANN202
    t = factory.tenant()
    task = factory.task(t)
    node = factory.node(node_name, gpus=2)
    pid = factory.placement(task["id"], node, gpus=(0, 1))
    r = client.post(f"/internal/v1/placements/{pid}/claim", headers=factory.worker,
                    json={"node_id": node})
    assert r.status_code == 200, r.text
    return t, task["id"], node, pid


def _events(client, t, task_id: str) -> list[dict]:  # noqa: ANN001
    r = client.get(f"/v1/tasks/{task_id}/events", headers=t.headers, params={"limit": 100})
    assert r.status_code == 200
    return r.json()["data"]


def test_events_show_no_node_identity(client, factory):  # noqa: ANN001
    t, task_id, node, _ = _claim(client, factory, "gpu-host-secret-7")
    # the node leaves: the task is requeued, and the tenant reads why without the node
    r = client.post(f"/internal/v1/nodes/{node}/deregister", headers=factory.worker,
                    json={"reason": "drained by gpu-host-secret-7's operator"})
    assert r.status_code == 200, r.text
    events = _events(client, t, task_id)
    types = [e["type"] for e in events]
    assert "task_running" in types and "task_requeued" in types, types
    text = json.dumps(events)
    assert node not in text and "gpu-host-secret" not in text, text
    running = next(e for e in events if e["type"] == "task_running")
    assert running["data"]["attempt"] == 1 and running["data"]["gpu_indices"] == [0, 1]
    requeued = next(e for e in events if e["type"] == "task_requeued")
    assert "left the cluster" in requeued["message"]
    # the operator still sees the node
    op = client.get("/v1/cluster", headers={"Authorization": "Bearer test-admin-token"}).json()
    assert node in json.dumps(op)


def test_task_error_has_no_traceback_or_path(client, factory):  # noqa: ANN001
    t, task_id, _, pid = _claim(client, factory, "n-err")
    error = ("Traceback (most recent call last):\n  File \"/srv/loraplex/trainer/engine.py\", "
             "line 12, in step\n    x = y\nRuntimeError: CUDA out of memory at "
             "/srv/loraplex/spool/placement_1/state.pt")
    r = client.post(f"/internal/v1/tasks/{task_id}/failed", headers=factory.worker, json={
        "placement_id": pid, "error": error, "detail": "more at /home/op/.cache/x.log",
        "retryable": False})
    assert r.status_code == 200, r.text
    task = client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()
    assert task["state"] == "failed"
    shown = json.dumps([task, _events(client, t, task_id)])
    for leak in ("Traceback", "/srv/", "/home/", "engine.py\"", "x.log", "more at"):
        assert leak not in shown, (leak, shown)
    assert "RuntimeError: CUDA out of memory at <path>" in task["error"]["message"]


def test_query_integers_past_int64_name_the_parameter(client, factory):  # noqa: ANN001
    t = factory.tenant()
    task = factory.task(t)
    for path, param in ((f"/v1/tasks/{task['id']}/events", "after"),
                        (f"/v1/tasks/{task['id']}/metrics", "after_step"),
                        ("/v1/tasks", "limit"), ("/v1/files", "limit"),
                        (f"/v1/tasks/{task['id']}/events", "limit")):
        for value in (INT64_OVER, "9" * 5000, "-" + INT64_OVER):
            r = client.get(path, headers=t.headers, params={param: value})
            assert r.status_code == 422, (path, param, r.text)
            assert r.json()["error"]["param"] == param, r.text
    assert client.get(f"/v1/tasks/{task['id']}/events", headers=t.headers,
                      params={"after": str(2**63 - 1)}).json()["data"] == []


def test_hostile_json_bodies_are_4xx(client, factory):  # noqa: ANN001
    t = factory.tenant()
    f = factory.file(t)
    bodies = [b"[" * 100_000 + b"]" * 100_000,
              b'{"base_model": "tiny-llama", "training_file": "' + f["id"].encode()
              + b'", "seed": ' + b"9" * 5000 + b"}",
              b'{"base_model": "tiny-llama", "training_file": "' + f["id"].encode()
              + b'", "search_space": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}"]
    for body in bodies:
        r = client.post("/v1/tasks", headers=t.headers | {"Content-Type": "application/json"},
                        content=body)
        assert 400 <= r.status_code < 500, r.text[:300]
        assert set(r.json()["error"]) >= {"code", "message", "param"}
    assert client.get("/v1/tasks", headers=t.headers).json()["data"] == []


def test_every_integer_query_parameter_is_bounded(app):  # noqa: ANN001
    """A new route with an unbounded integer parameter would reach PostgreSQL past int64 (a
    500 or an unnamed 422): every integer parameter of the spec has a maximum within int64."""
    doc = app.openapi()
    seen = 0
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for param in op.get("parameters", []):
                schema = param.get("schema", {})
                for s in [schema, *schema.get("anyOf", [])]:
                    if s.get("type") == "integer":
                        seen += 1
                        assert s.get("maximum", 2**64) <= 2**63 - 1, (method, path, param["name"])
    assert seen >= 5
