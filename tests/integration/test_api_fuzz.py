"""Integration: arbitrary JSON bodies, ids and strings (NUL bytes, huge numbers, wrong types)
never produce a 500; every failure has the {"error": {code, message, param}} shape."""

from __future__ import annotations

import json
from urllib.parse import quote

from hypothesis import given, settings
from hypothesis import strategies as st

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=8)
TASK_KEYS = ["base_model", "training_file", "validation_file", "search_space", "epochs",
             "max_seq_len", "seed", "early_exit", "eval", "method", "validation_split"]
WEIRD = st.sampled_from(["\x00", "a\x00b", "é" * 50, "x" * 300, "../..", "%00", "0", "-1"])
FUZZ = settings(max_examples=15, deadline=None, database=None)


def _check(r) -> None:  # noqa: ANN001
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"type", "code", "message", "param"}


def test_task_bodies(client, factory):  # noqa: ANN001
    t = factory.tenant()
    f = factory.file(t)["id"]

    @FUZZ
    @given(body=st.dictionaries(st.sampled_from(TASK_KEYS), JSON | WEIRD, max_size=6),
           valid_file=st.booleans())
    def run(body: dict, valid_file: bool) -> None:
        if valid_file:
            body = {"base_model": "tiny-llama", "training_file": f} | body
        _check(client.post("/v1/tasks", headers=t.headers, content=json.dumps(body)))

    run()


def test_ids_and_cursors(client, factory):  # noqa: ANN001
    t = factory.tenant()

    @FUZZ
    @given(ident=st.text(max_size=60) | WEIRD, after=st.text(max_size=40) | WEIRD)
    def run(ident: str, after: str) -> None:
        safe = quote(ident, safe="") or "x"
        for path in (f"/v1/tasks/{safe}", f"/v1/files/{safe}", f"/v1/jobs/{safe}/adapter",
                     f"/v1/tasks/{safe}/events", f"/v1/tasks/{safe}/cancel"):
            _check(client.get(path, headers=t.headers))
        _check(client.get("/v1/tasks", headers=t.headers, params={"after": after}))
        _check(client.get("/v1/files", headers=t.headers, params={"after": after, "limit": 3}))
        _check(client.post("/v1/tasks", json={"base_model": "tiny-llama", "training_file": ident},
                           headers=t.headers | {"Idempotency-Key": quote(after) or "k"}))

    run()


def test_worker_reports(client, factory):  # noqa: ANN001
    t = factory.tenant()
    task = factory.task(t)
    tid = task["id"]
    jid = client.get(f"/v1/tasks/{tid}/jobs", headers=t.headers).json()["data"][0]["id"]
    node = factory.node()
    pid = factory.placement(tid, node)
    w = factory.worker | {"Content-Type": "application/json"}
    assert client.post(f"/internal/v1/placements/{pid}/claim", headers=w,
                       json={"node_id": node}).status_code == 200

    def post(path: str, body: dict):  # noqa: ANN202 - json.dumps writes inf, as a worker would
        return client.post(path, headers=w, content=json.dumps(body))

    @FUZZ
    @given(events=st.lists(st.fixed_dictionaries(
               {"type": st.text(max_size=60) | WEIRD},
               optional={"message": WEIRD | st.text(), "client_key": WEIRD, "data": JSON,
                         "job_id": WEIRD}), max_size=3),
           step=st.integers(min_value=-5, max_value=2**40), loss=st.floats())
    def run(events: list, step: int, loss: float) -> None:
        _check(post(f"/internal/v1/tasks/{tid}/events", {"placement_id": pid, "events": events}))
        _check(post(f"/internal/v1/tasks/{tid}/metrics", {"placement_id": pid, "points": [
            {"job_id": jid, "step": step, "split": "train", "loss": loss}]}))
        _check(post(f"/internal/v1/jobs/{jid}/state",
                    {"placement_id": pid, "state": "running", "last_step": step}))
        _check(client.get(f"/v1/tasks/{tid}/metrics", headers=t.headers))
        _check(client.get(f"/v1/tasks/{tid}/events", headers=t.headers))
        _check(post("/internal/v1/nodes", {
            "name": events[0]["type"] if events else "n", "gpu_type": "x", "gpu_count": 1,
            "gpu_memory_bytes": max(step, 0)}))

    run()
