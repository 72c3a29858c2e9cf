"""End to end over the internal API, a test playing the daemon: POST /internal/v1/nodes/{id}/
deregister takes the node out at once (waiting placements superseded and unqueued, claimed ones
failed over), answers the same when repeated, 404 for an unknown node; a heartbeat brings it back."""

from __future__ import annotations

import httpx
import redis

from tests.e2e.conftest import WORKER_TOKEN, Stack
from tests.e2e.test_daemon_loop import create_task, events, state_of


def test_deregister_supersedes_waiting_and_fails_over_claimed(stack: Stack) -> None:
    with stack.client(WORKER_TOKEN) as worker, stack.http() as http:
        r = worker.post("/internal/v1/nodes", json={"name": "node-x", "gpu_type": "cpu",
                                                    "gpu_count": 2, "gpu_memory_bytes": 1 << 30})
        assert r.status_code == 200, r.text
        node_id = r.json()["node_id"]
        conn = redis.Redis.from_url(stack.redis_url)
        queue = f"rq:queue:loraplex:node:{node_id}"
        running, waiting = create_task(http), create_task(http)
        stack.place(running["id"], "node-x", (0,))
        stack.place(waiting["id"], "node-x", (1,))
        assert conn.llen(queue) == 2
        [claimed] = stack.sql("SELECT id FROM placements WHERE task_id = :t", t=running["id"])
        r = worker.post(f"/internal/v1/placements/{claimed.id}/claim", json={"node_id": node_id})
        assert r.status_code == 200, r.text
        assert state_of(http, running["id"]) == "running"
        [published] = stack.sql("SELECT id FROM placements WHERE task_id = :t", t=waiting["id"])

        r = worker.post(f"/internal/v1/nodes/{node_id}/deregister", json={"reason": "drained"})
        assert r.status_code == 200, r.text
        assert r.json() == {"node_id": node_id, "state": "down",
                            "superseded_placement_ids": [published.id],
                            "requeued_task_ids": [running["id"]]}
        assert conn.llen(queue) == 0
        states = dict(stack.sql("SELECT task_id, state FROM placements"))
        assert states == {running["id"]: "failed", waiting["id"]: "superseded"}
        assert state_of(http, running["id"]) == "queued" == state_of(http, waiting["id"])
        requeued = [e for e in events(http, running["id"]) if e["type"] == "task_requeued"]
        assert len(requeued) == 1 and "its node left the cluster" in requeued[0]["message"]
        assert "node-x" not in requeued[0]["message"]
        with stack.operator() as op:
            assert [n["state"] for n in op.get("/v1/cluster").json()["nodes"]] == ["down"]

        again = worker.post(f"/internal/v1/nodes/{node_id}/deregister", json={})
        assert again.status_code == 200 and again.json()["superseded_placement_ids"] == []
        assert again.json()["requeued_task_ids"] == []
        missing = worker.post("/internal/v1/nodes/node_nope/deregister", json={})
        assert missing.status_code == 404 and missing.json()["error"]["code"]
        bad = worker.post(f"/internal/v1/nodes/{node_id}/deregister", json={"reason": 1})
        assert bad.status_code == 422
        anonymous = httpx.post(f"{stack.url}/internal/v1/nodes/{node_id}/deregister", json={})
        assert anonymous.status_code == 401

        beat = worker.post(f"/internal/v1/nodes/{node_id}/heartbeat", json={})
        assert beat.status_code == 200 and beat.json()["state"] == "up"
        with stack.operator() as op:
            assert [n["state"] for n in op.get("/v1/cluster").json()["nodes"]] == ["up"]
