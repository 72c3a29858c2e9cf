"""Integration: a finished task's result file (CSV of step metrics, as a file object) and its
usage (exact tokens and GPU-seconds from the executor's train points, cost at the operator's
price), on the native task, the OpenAI-compatible job and GET /v1/usage."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timedelta, timezone

from sqlalchemy import delete

from service.models import File
from service.result_files import RESULT_COLUMNS, result_file_id
from tests.integration.factories import safetensors_bytes

PRICE = 2.0  # Settings.price_per_gpu_hour's default, which the tests' settings keep


def _claimed(client, factory, t) -> tuple[str, str, list[str]]:  # noqa: ANN001
    """A task of two jobs whose first attempt is claimed and running: (task, placement, jobs)."""
    task = factory.task(t, search_space={"learning_rate": [1e-4, 3e-4], "lora_rank": [4]})
    node = factory.node()
    pid = factory.placement(task["id"], node)
    assert client.post(f"/internal/v1/placements/{pid}/claim", headers=factory.worker,
                       json={"node_id": node}).status_code == 200
    jobs = [j["id"] for j in client.get(f"/v1/tasks/{task['id']}/jobs",
                                        headers=t.headers).json()["data"]]
    for job in jobs:
        assert client.post(f"/internal/v1/jobs/{job}/state", headers=factory.worker,
                           json={"placement_id": pid, "state": "running"}).status_code == 200
    return task["id"], pid, jobs


def _train(client, factory, task_id: str, pid: str, jobs: list[str]) -> dict:  # noqa: ANN001
    """Two train steps (tokens, GPU-seconds) and two evaluations of each job, then success;
    returns the hand sums."""
    w = factory.worker
    points = []
    for k, job in enumerate(jobs):
        for step in (1, 2):
            points.append({"job_id": job, "step": step, "split": "train", "loss": 2.0 - step / 10,
                           "tokens": 100 * (k + 1) + step, "gpu_seconds": 0.5 * step})
            points.append({"job_id": job, "step": step, "split": "val", "loss": 2.1 - step / 10})
    r = client.post(f"/internal/v1/tasks/{task_id}/metrics", headers=w,
                    json={"placement_id": pid, "points": points})
    assert r.status_code == 200, r.text
    # a retried batch changes nothing (same job, step and split)
    assert client.post(f"/internal/v1/tasks/{task_id}/metrics", headers=w, json={
        "placement_id": pid, "points": points}).json()["stored"] == 0
    adapter = [("files", ("adapter_config.json", io.BytesIO(b'{"r": 4}'), "application/json")),
               ("files", ("adapter_model.safetensors", io.BytesIO(safetensors_bytes()), "x/y"))]
    for job in jobs:
        assert client.post(f"/internal/v1/tasks/{task_id}/artifacts", headers=w, data={
            "meta": json.dumps({"kind": "adapter", "job_id": job, "placement_id": pid})},
            files=adapter).status_code == 201
        assert client.post(f"/internal/v1/jobs/{job}/state", headers=w, json={
            "placement_id": pid, "state": "completed", "best_val_loss": 1.9,
            "best_step": 2, "last_step": 2}).status_code == 200
    assert client.post(f"/internal/v1/tasks/{task_id}/finished", headers=w,
                       json={"placement_id": pid}).status_code == 200
    per_job = {job: sum(100 * (k + 1) + s for s in (1, 2)) for k, job in enumerate(jobs)}
    return {"jobs": per_job, "tokens": sum(per_job.values()), "gpu_seconds": 1.5 * len(jobs)}


def test_result_file_and_usage_of_a_finished_task(client, factory, session) -> None:  # noqa: ANN001
    t = factory.tenant()
    task_id, pid, jobs = _claimed(client, factory, t)
    running = client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()
    assert running["result_files"] == [] and running["usage"]["trained_tokens"] == 0
    hand = _train(client, factory, task_id, pid, jobs)

    task = client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()
    assert task["state"] == "succeeded"
    fid = result_file_id(task_id)
    assert task["result_files"] == [fid]
    usage = task["usage"]
    assert usage["trained_tokens"] == hand["tokens"] == 606
    assert usage["gpu_seconds"] == hand["gpu_seconds"]
    assert usage["cost"] == round(hand["gpu_seconds"] / 3600 * PRICE, 6)
    assert usage["price_per_gpu_hour"] == PRICE
    assert usage["estimated_tokens"] > 0 and usage["expected_tokens"] > 0  # beside the actual
    listed = client.get("/v1/tasks", headers=t.headers).json()["data"][0]
    assert listed["result_files"] == [fid] and listed["usage"] == usage
    by_job = {j["id"]: j for j in client.get(f"/v1/tasks/{task_id}/jobs",
                                             headers=t.headers).json()["data"]}
    assert {j: by_job[j]["trained_tokens"] for j in jobs} == hand["jobs"]
    assert all(by_job[j]["gpu_seconds"] == 1.5 for j in jobs)

    ft = client.get(f"/v1/fine_tuning/jobs/{task_id}", headers=t.headers).json()
    assert ft["result_files"] == [fid] and ft["trained_tokens"] == hand["tokens"]
    assert ft["usage"] == usage

    meta = client.get(f"/v1/files/{fid}", headers=t.headers).json()
    assert meta["purpose"] == "fine-tune-results" and meta["format"] == "csv"
    assert meta["line_count"] == 4  # two jobs x two steps
    r = client.get(f"/v1/files/{fid}/content", headers=t.headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert meta["bytes"] == len(r.content)
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert tuple(rows[0]) == RESULT_COLUMNS
    assert [(row["job_id"], int(row["step"])) for row in rows] == [(j, s) for j in jobs
                                                                     for s in (1, 2)]
    first = rows[1]
    assert float(first["train_loss"]) == 2.0 - 2 / 10 and float(first["valid_loss"]) == 2.1 - 2 / 10
    assert first["train_accuracy"] == "" and first["job_index"] == "0"
    assert float(first["learning_rate"]) == 1e-4 and first["lora_rank"] == "4"
    assert int(first["tokens"]) == 102 and int(first["trained_tokens"]) == 203
    assert sum(int(row["tokens"]) for row in rows) == hand["tokens"]

    # made once: reads again give the same file, and the tenant's file list holds one
    again = client.get(f"/v1/fine_tuning/jobs/{task_id}", headers=t.headers).json()
    assert again["result_files"] == [fid]
    files = client.get("/v1/files", headers=t.headers).json()["data"]
    assert [f["id"] for f in files if f["purpose"] == "fine-tune-results"] == [fid]
    # a result file is no training file
    r = client.post("/v1/tasks", headers=t.headers, json={
        "base_model": "tiny-llama", "training_file": fid,
        "search_space": {"learning_rate": [1e-4], "lora_rank": [4]}})
    assert r.status_code == 422 and r.json()["error"]["param"] == "training_file"

    # another tenant sees neither the file nor the usage
    other = factory.tenant()
    assert client.get(f"/v1/files/{fid}", headers=other.headers).status_code == 404
    assert client.get(f"/v1/files/{fid}/content", headers=other.headers).status_code == 404
    start = (datetime.now(timezone.utc) - timedelta(hours=1)).isoformat()
    assert client.get("/v1/usage", headers=other.headers,
                      params={"start": start}).json()["tasks"] == []

    report = client.get("/v1/usage", headers=t.headers, params={"start": start}).json()
    assert report["object"] == "usage.report" and report["price_per_gpu_hour"] == PRICE
    assert report["trained_tokens"] == hand["tokens"]
    assert report["gpu_seconds"] == hand["gpu_seconds"] and report["cost"] == usage["cost"]
    assert [(x["task_id"], x["trained_tokens"]) for x in report["tasks"]] == \
        [(task_id, hand["tokens"])]
    earlier = client.get("/v1/usage", headers=t.headers, params={
        "start": "2020-01-01T00:00:00Z", "end": "2020-02-01"}).json()
    assert earlier["trained_tokens"] == 0 and earlier["tasks"] == []


def test_result_file_is_made_on_read_when_missing(client, factory, session) -> None:  # noqa: ANN001
    """A crash between the task's end and its file: the next read makes it."""
    t = factory.tenant()
    task_id, pid, jobs = _claimed(client, factory, t)
    _train(client, factory, task_id, pid, jobs)
    fid = result_file_id(task_id)
    session.execute(delete(File).where(File.id == fid))
    session.commit()
    assert client.get("/v1/tasks", headers=t.headers).json()["data"][0]["result_files"] == []
    assert client.get(f"/v1/fine_tuning/jobs/{task_id}", headers=t.headers).json()[
        "result_files"] == [fid]
    assert client.get(f"/v1/files/{fid}/content", headers=t.headers).text.startswith("step,")
    # a result file the tenant deleted stays deleted
    assert client.delete(f"/v1/files/{fid}", headers=t.headers).status_code == 200
    assert client.get(f"/v1/tasks/{task_id}", headers=t.headers).json()["result_files"] == []


def test_cancelled_before_running_has_no_result_file(client, factory) -> None:  # noqa: ANN001
    t = factory.tenant()
    task_id = factory.task(t)["id"]
    task = client.post(f"/v1/tasks/{task_id}/cancel", headers=t.headers).json()
    assert task["state"] == "cancelled" and task["result_files"] == []
    usage = task["usage"]
    assert usage["trained_tokens"] is None and usage["gpu_seconds"] is None
    assert usage["estimated_tokens"] > 0
    ft = client.get(f"/v1/fine_tuning/jobs/{task_id}", headers=t.headers).json()
    assert ft["result_files"] == [] and ft["trained_tokens"] == 0


def test_usage_period_errors_name_the_field(client, factory) -> None:  # noqa: ANN001
    t = factory.tenant()
    for params, param in (({"start": "yesterday"}, "start"), ({}, "start"),
                          ({"start": "2026-01-01", "end": "2026-13-01"}, "end"),
                          ({"start": "2026-02-01", "end": "2026-01-01"}, "start")):
        r = client.get("/v1/usage", headers=t.headers, params=params)
        assert r.status_code == 422, (params, r.text)
        assert r.json()["error"]["param"] == param, (params, r.json())
    assert client.get("/v1/usage", params={"start": "2026-01-01"}).status_code == 401
    ok = client.get("/v1/usage", headers=t.headers, params={"start": 1_700_000_000})
    assert ok.status_code == 200 and ok.json()["tasks"] == []


def test_worker_reports_bad_usage_numbers_are_422(client, factory) -> None:  # noqa: ANN001
    t = factory.tenant()
    task_id, pid, jobs = _claimed(client, factory, t)
    for bad in ({"tokens": -1}, {"gpu_seconds": -0.5}):
        r = client.post(f"/internal/v1/tasks/{task_id}/metrics", headers=factory.worker, json={
            "placement_id": pid, "points": [{"job_id": jobs[0], "step": 1, "split": "train",
                                             "loss": 1.0, **bad}]})
        assert r.status_code == 422, r.text
