"""Integration: the served schema says what the app does. List cursors have a stated format (a
malformed one is a 422, a well-formed one naming nothing of the caller's a documented 404, both
naming `after`); a 405 lists every method of its path in `Allow`; the node messages take the
types they document (a JSON `false` is no byte count)."""

from __future__ import annotations

import re

from sqlalchemy import func, select

from service.models import Node

WELL_FORMED = {"file": "file_" + "0" * 24, "task": "task_" + "0" * 24,
               "whep": "whep_" + "0" * 24, "job": "job_" + "0" * 24}


def _param(app, path: str, name: str) -> dict:  # noqa: ANN001
    op = app.openapi()["paths"][path]["get"]
    return op, next(p for p in op["parameters"] if p["name"] == name)


def test_cursors_state_their_format_and_a_wrong_one_is_a_documented_4xx(
        app, client, factory) -> None:  # noqa: ANN001
    t = factory.tenant()
    task = factory.task(t)
    cases = [("/v1/files", "/v1/files", "after", "file"),
             ("/v1/tasks", "/v1/tasks", "after", "task"),
             ("/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs", "after", "task"),
             ("/v1/webhooks", "/v1/webhooks", "after", "whep"),
             ("/v1/tasks/{task_id}/metrics", f"/v1/tasks/{task['id']}/metrics", "job_id", "job")]
    for spec_path, url, name, prefix in cases:
        op, param = _param(app, spec_path, name)
        pattern = param["schema"]["anyOf"][0]["pattern"]
        assert re.fullmatch(pattern, WELL_FORMED[prefix]), (spec_path, pattern)
        assert {"404", "422"} <= set(op["responses"]), spec_path
        for value, status in (("nope", 422), (WELL_FORMED[prefix], 404)):
            r = client.get(url, headers=t.headers, params={name: value})
            assert r.status_code == status, (url, value, r.text)
            assert r.json()["error"]["param"] == name, r.text
    # a real cursor pages
    r = client.get("/v1/tasks", headers=t.headers, params={"after": task["id"]})
    assert r.status_code == 200 and r.json()["data"] == []


def test_a_405_allows_every_method_of_its_path(client, factory) -> None:  # noqa: ANN001
    t = factory.tenant()
    task = factory.task(t)
    file_id = task["training_file"]
    for path, methods in ((f"/v1/files/{file_id}", {"GET", "DELETE"}),
                          ("/v1/files", {"GET", "POST"}),
                          (f"/v1/tasks/{task['id']}/merged", {"GET", "POST"}),
                          ("/v1/webhooks/whep_x", {"GET", "PATCH", "DELETE"})):
        r = client.options(path, headers=t.headers)
        assert r.status_code == 405, (path, r.text)
        allowed = {m.strip() for m in r.headers["allow"].split(",")} - {"HEAD"}
        assert allowed == methods, (path, r.headers["allow"])
        assert r.json()["error"]["code"] == "method_not_allowed"


def test_node_messages_take_their_documented_types(client, factory, session) -> None:  # noqa: ANN001
    good = {"name": "n1", "gpu_type": "H100", "gpu_count": 2, "gpu_memory_bytes": 80 * 2**30}
    count = session.scalar(select(func.count()).select_from(Node))
    for field, value in (("gpu_memory_bytes", False), ("gpu_count", True), ("gpu_count", 2.5),
                         ("gpu_memory_bytes", "1024"), ("gpu_memory_bytes", 2.0**63)):
        r = client.post("/internal/v1/nodes", headers=factory.worker, json=good | {field: value})
        assert r.status_code == 422, (field, value, r.text)
        assert r.json()["error"]["param"] == field
    assert session.scalar(select(func.count()).select_from(Node)) == count
    # JSON Schema's integer holds 2.0 (what schemathesis sends as valid): a count of 2
    r = client.post("/internal/v1/nodes", headers=factory.worker,
                    json=good | {"name": "n2", "gpu_count": 2.0, "gpu_memory_bytes": 1024.0})
    assert r.status_code == 200, r.text
    assert session.get(Node, r.json()["node_id"]).gpu_count == 2
    node = factory.node()
    executor = {"key": "k", "gpu_indices": [0], "free_rows": 4, "total_rows": 8}
    for patch in ({"queued_jobs": False}, {"free_rows": 4.5}, {"free_rows": "4"},
                  {"gpu_indices": [True]}, {"gpu_indices": [-1]}, {"gpu_indices": [0.5]}):
        r = client.post(f"/internal/v1/nodes/{node}/heartbeat", headers=factory.worker,
                        json={"executors": [executor | patch]})
        assert r.status_code == 422, (patch, r.text)
    r = client.post(f"/internal/v1/nodes/{node}/heartbeat", headers=factory.worker,
                    json={"executors": [executor | {"free_rows": 4.0, "gpu_indices": [1.0]}],
                          "gpu_utilization": [0.5, 1]})
    assert r.status_code == 200, r.text
