"""Integration (real PostgreSQL): the dashboard's pieces of the API. The live view of a task
(service.api.ui.live.tick, behind GET /ui/v1/tasks/{id}/live): a first snapshot with downsampled curves,
then only what changed (new points per curve, new events, job states), nothing when nothing did,
and another tenant's task reads as gone. The metrics route's max_points, and the page's files."""

from __future__ import annotations

import json
import re

from contract.protocol import MetricPointIn
from service import events
from service.api.ui.live import LiveState, tick
from service.models import Job, Task


def _points(job_ids: list[str], steps: range, split: str = "train") -> list[MetricPointIn]:
    return [MetricPointIn(job_id=j, step=s, split=split, loss=10.0 / s + i)
            for i, j in enumerate(job_ids) for s in steps]


def test_live_ticks_send_a_snapshot_then_only_changes(client, factory, session):  # noqa: ANN001
    t = factory.tenant()
    task_id = factory.task(t)["id"]
    task = session.get(Task, task_id)
    job_ids = [j["id"] for j in client.get(f"/v1/tasks/{task_id}/jobs",
                                           headers=t.headers).json()["data"]]
    events.ingest_metrics(session, task, _points(job_ids, range(1, 301)))
    events.ingest_metrics(session, task, _points(job_ids[:1], range(5, 301, 5), "val"))
    session.commit()

    live = LiveState(max_points=40)
    first, ended = tick(session, t.id, task_id, live)
    assert not ended and first["reset"] is True
    assert first["task"]["id"] == task_id and len(first["jobs"]) == len(job_ids)
    assert [e["type"] for e in first["events"]][:1] == ["task_created"] or first["events"]
    for j in job_ids:
        train = first["points"][j]["train"]
        assert 4 <= len(train) <= 40 and train[0][0] == 1 and train[-1][0] == 300
    assert first["points"][job_ids[0]]["val"][-1] == [300, 10.0 / 300]

    again, _ = tick(session, t.id, task_id, live)
    assert again is None  # nothing changed

    events.ingest_metrics(session, task, _points(job_ids, range(301, 304)))
    events.add_event(session, task_id, "log", "hello from the test")
    session.get(Job, job_ids[1]).state = "running"
    session.commit()
    delta, _ = tick(session, t.id, task_id, live)
    assert "reset" not in delta
    assert delta["task"]["job_counts"].get("running") == 1  # its job counts changed
    assert {j: c["train"] for j, c in delta["points"].items()} == {
        j: [[s, 10.0 / s + i] for s in range(301, 304)] for i, j in enumerate(job_ids)}
    assert all(c["val"] == [] for c in delta["points"].values())
    assert [e["message"] for e in delta["events"]] == ["hello from the test"]
    assert [j["state"] for j in delta["jobs"]][1] == "running"

    other = factory.tenant()
    gone, ended = tick(session, other.id, task_id, LiveState(max_points=40))
    assert gone == {"gone": True} and ended


def test_live_task_has_the_usage_of_the_task_route(client, factory):  # noqa: ANN001
    """The page's task comes from the live stream: its usage is GET /v1/tasks/{id}'s, priced."""
    t = factory.tenant()
    task_id = factory.task(t)["id"]
    r = client.get(f"/ui/v1/tasks/{task_id}/live", headers=t.headers, params={"duration_s": 0.1})
    first = json.loads(next(line[5:] for line in r.text.splitlines() if line.startswith("data:")))
    usage = client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()["usage"]
    assert first["task"]["usage"] == usage and usage["price_per_gpu_hour"] is not None, usage


def test_live_route_and_max_points_validation(client, factory):  # noqa: ANN001
    t, other = factory.tenant(), factory.tenant()
    task_id = factory.task(t)["id"]
    r = client.get(f"/ui/v1/tasks/{task_id}/live", headers=t.headers, params={"duration_s": 0.05})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in r.text.split("\n\n") if f.strip()]
    assert frames[0].startswith("event: update\ndata: ") and frames[-1].startswith("event: end")
    assert client.get(f"/ui/v1/tasks/{task_id}/live", headers=other.headers).status_code == 404
    assert client.get(f"/ui/v1/tasks/{task_id}/live").status_code == 401
    for bad in (0, 3, 100_001):
        r = client.get(f"/v1/tasks/{task_id}/metrics", headers=t.headers,
                       params={"max_points": bad})
        assert r.status_code == 422 and r.json()["error"]["param"] == "max_points", r.text


def test_page_and_its_files_are_served(client):  # noqa: ANN001
    r = client.get("/", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/ui/"
    page = client.get("/ui/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name, kind in (("app.js", "javascript"), ("chart.js", "javascript"), ("app.css", "css"),
                       ("usage.js", "javascript"), ("webhooks.js", "javascript")):
        assert f"/ui/static/{name}" in page.text
        r = client.get(f"/ui/static/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"] and r.content
    for bad in ("nope.js", "..%2Fapp.py", "__init__.py", "live.py"):
        assert client.get(f"/ui/static/{bad}").status_code == 404
    for name in ("app.js", "chart.js", "app.css", "usage.js"):  # nothing loaded from elsewhere
        urls = set(re.findall(r"https?://[^\s\"'`)]+", client.get(f"/ui/static/{name}").text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (name, urls)


def test_the_create_form_lists_the_methods_from_the_registry(client):  # noqa: ANN001
    from contract.methods import METHODS

    got = client.get("/ui/v1/methods").json()["data"]
    assert [m["name"] for m in got] == list(METHODS)
    orpo = next(m for m in got if m["name"] == "orpo")
    assert orpo["formats"] == ["preference"] and orpo["knobs"][0]["name"] == "orpo_lambda"
    assert orpo["knobs"][0]["default"] == 0.1
