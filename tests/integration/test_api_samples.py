"""Integration: a task's samples (issue 44). The executor's TaskSamples report (POST
/internal/v1/tasks/{id}/samples) becomes the task's samples result file once, fenced like every
report, announced by a `samples` event; GET /v1/tasks/{id}/samples shows them to the tenant alone;
the task's create refuses bad sample settings with a 422 naming the field."""

from __future__ import annotations

from sqlalchemy import select

from service.models import Event, File, Job
from service.samples import samples_file_id
from tests.integration.test_throughput_profiles import claimed


def test_samples_are_stored_once_and_shown_to_their_tenant(client, factory, session) -> None:  # noqa: ANN001
    tenant = factory.tenant()
    node = factory.node("gpu-a", gpus=1)
    task = factory.task(tenant)["id"]
    r = client.get(f"/v1/tasks/{task}/samples", headers=tenant.headers)
    assert r.status_code == 200 and r.json()["data"] == [] and r.json()["file_id"] is None
    pid = claimed(client, factory, task, node)
    job = session.scalars(select(Job.id).where(Job.task_id == task)).first()
    rows = [{"prompt": "Say hi", "job_id": None, "completion": "hello", "tokens": 2},
            {"prompt": "Say hi", "job_id": job, "completion": "hi there", "tokens": 3}]
    url = f"/internal/v1/tasks/{task}/samples"
    r = client.post(url, headers=factory.worker, json={"placement_id": pid, "samples": rows})
    assert r.status_code == 200 and r.json() == {"stored": 1}, r.text
    assert client.post(url, headers=factory.worker, json={"placement_id": pid, "samples": rows}).json() == {
        "stored": 0}  # a retry
    got = client.get(f"/v1/tasks/{task}/samples", headers=tenant.headers).json()
    assert got["data"] == rows and got["file_id"] == samples_file_id(task)
    # listed among the task's result files, on the one task's view and on the list's
    assert client.get(f"/v1/tasks/{task}", headers=tenant.headers).json()["result_files"] == [got["file_id"]]
    listed = client.get("/v1/tasks", headers=tenant.headers).json()["data"]
    assert [t["result_files"] for t in listed if t["id"] == task] == [[got["file_id"]]]
    session.expire_all()
    f = session.get(File, samples_file_id(task))
    assert f.purpose == "fine-tune-results" and f.format == "jsonl" and f.line_count == 2
    r = client.get(f"/v1/files/{f.id}/content", headers=tenant.headers)
    assert r.status_code == 200 and r.text.count("\n") == 2 and "hi there" in r.text
    [event] = session.scalars(select(Event).where(Event.task_id == task, Event.type == "samples"))
    assert event.data["prompts"] == 1 and event.data["configurations"] == 2
    # another tenant sees neither the task's samples nor their file
    other = factory.tenant()
    assert client.get(f"/v1/tasks/{task}/samples", headers=other.headers).status_code == 404
    assert client.get(f"/v1/files/{f.id}/content", headers=other.headers).status_code == 404


def test_a_report_naming_a_job_the_task_lacks_stores_nothing(client, factory, session) -> None:  # noqa: ANN001
    tenant = factory.tenant()
    node = factory.node("gpu-b", gpus=1)
    task = factory.task(tenant)["id"]
    pid = claimed(client, factory, task, node)
    bad = [{"prompt": "x", "job_id": "job_000000000000000000000000", "completion": "y", "tokens": 1}]
    r = client.post(f"/internal/v1/tasks/{task}/samples", headers=factory.worker,
                    json={"placement_id": pid, "samples": bad})
    assert r.status_code == 422 and r.json()["error"]["param"] == "samples"
    assert session.get(File, samples_file_id(task)) is None


def test_bad_sample_settings_are_a_422_naming_the_field(client, factory) -> None:  # noqa: ANN001
    tenant = factory.tenant()
    for field, value in (("top_k", 9), ("max_new_tokens", 0), ("temperature", -1), ("prompts", [""]),
                         ("prompts", ["p"] * 33), ("top_p", 0)):
        r = client.post("/v1/tasks", headers=tenant.headers, json={
            "base_model": "tiny-llama", "training_file": factory.file(tenant)["id"], "samples": {field: value}})
        assert r.status_code == 422, (field, r.text)
        assert "samples" in r.json()["error"]["param"] and field in r.json()["error"]["param"], r.text
