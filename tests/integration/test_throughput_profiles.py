"""Integration: executors' throughput reports (POST /internal/v1/tasks/{id}/throughput) become
throughput_profiles rows keyed by the node's GPU type, fenced like every other report, and the
scheduler's next duration estimate for the same model is tokens to train / the measured rate."""

from __future__ import annotations

import json
import math

from sqlalchemy import func, select

from service.models import File, Placement, Task, ThroughputProfile, utcnow
from service.scheduler.loop import build_instance

GPU_TYPE = "H100-80GB"  # what factory.node registers
SPACE = {"learning_rate": [1e-4, 3e-4], "lora_rank": [4], "batch_size": [2, 4]}  # 2x2,4x2
MIX = [4, 2, 4, 2]


def report(placement_id: str, **overrides: object) -> dict:
    body: dict = {"placement_id": placement_id, "gpus": 1, "seq_len": 128, "batch_sizes": MIX,
                  "tokens_per_s": 1234.5, "samples_per_s": 9.5, "memory_k0": 2.5e9,
                  "memory_k1": 1024.0}
    body.update(overrides)
    return body


def claimed(client, factory, task_id: str, node_id: str, gpus=(0,), attempt: int = 1) -> str:  # noqa: ANN001
    pid = factory.placement(task_id, node_id, gpus=gpus, attempt=attempt)
    r = client.post(f"/internal/v1/placements/{pid}/claim", headers=factory.worker,
                    json={"node_id": node_id})
    assert r.status_code == 200, r.text
    return pid


def profiles(session) -> list[ThroughputProfile]:  # noqa: ANN001
    session.expire_all()
    return list(session.scalars(select(ThroughputProfile).order_by(ThroughputProfile.id)))


def snapshot(session) -> list[tuple]:  # noqa: ANN001
    return [(p.base_model, p.gpu_type, p.seq_len, p.batch_key, p.gpus, p.tokens_per_s,
             p.samples_per_s, p.memory_k0, p.memory_k1, p.updated_at) for p in profiles(session)]


def test_report_stores_then_updates_one_profile(client, factory, session) -> None:  # noqa: ANN001
    node = factory.node("gpu-a", gpus=2)
    task = factory.task(factory.tenant(), search_space=SPACE)["id"]
    pid = claimed(client, factory, task, node)
    url = f"/internal/v1/tasks/{task}/throughput"
    r = client.post(url, headers=factory.worker, json=report(pid))
    assert r.status_code == 200 and r.json() == {"stored": 1}, r.text
    [row] = profiles(session)
    assert (row.base_model, row.gpu_type, row.seq_len, row.batch_key, row.gpus) == \
        ("tiny-llama", GPU_TYPE, 128, "2x2,4x2", 1)
    assert (row.tokens_per_s, row.samples_per_s, row.memory_k0, row.memory_k1) == \
        (1234.5, 9.5, 2.5e9, 1024.0)
    first_update = row.updated_at

    # The next window of the same mix replaces the numbers of the same row.
    r = client.post(url, headers=factory.worker,
                    json=report(pid, tokens_per_s=2000.0, batch_sizes=[2, 2, 4, 4],
                                samples_per_s=None, memory_k0=None, memory_k1=None))
    assert r.status_code == 200 and r.json() == {"stored": 0}, r.text
    [again] = profiles(session)
    assert again.id == row.id and again.tokens_per_s == 2000.0 and again.samples_per_s is None
    assert again.updated_at > first_update
    # A retried report changes nothing but the time stamp.
    before = snapshot(session)
    assert client.post(url, headers=factory.worker, json=report(
        pid, tokens_per_s=2000.0, samples_per_s=None, memory_k0=None,
        memory_k1=None)).json() == {"stored": 0}
    assert [s[:-1] for s in snapshot(session)] == [s[:-1] for s in before]

    # Another mix and another length are other profiles; a placement of one GPU cannot have
    # measured two.
    assert client.post(url, headers=factory.worker, json=report(pid, batch_sizes=[8])
                       ).json() == {"stored": 1}
    assert client.post(url, headers=factory.worker, json=report(pid, seq_len=64)
                       ).json() == {"stored": 1}
    assert client.post(url, headers=factory.worker, json=report(pid, gpus=2)).status_code == 422
    assert sorted((p.batch_key, p.seq_len, p.gpus) for p in profiles(session)) == \
        [("2x2,4x2", 64, 1), ("2x2,4x2", 128, 1), ("8x1", 128, 1)]


def test_gpu_type_is_the_nodes_and_the_gpu_count_is_part_of_the_key(client, factory, session
                                                                   ) -> None:  # noqa: ANN001
    r = client.post("/internal/v1/nodes", headers=factory.worker, json={
        "name": "l40s-1", "gpu_type": "L40S", "gpu_count": 4, "gpu_memory_bytes": 48 * 2**30})
    node = r.json()["node_id"]
    task = factory.task(factory.tenant(), search_space=SPACE)["id"]
    pid = claimed(client, factory, task, node, gpus=(0, 1))
    url = f"/internal/v1/tasks/{task}/throughput"
    assert client.post(url, headers=factory.worker, json=report(pid, gpus=2, tokens_per_s=3000.0)
                       ).json() == {"stored": 1}
    assert client.post(url, headers=factory.worker, json=report(pid, gpus=1, tokens_per_s=1600.0)
                       ).json() == {"stored": 1}
    assert sorted((p.gpu_type, p.gpus, p.tokens_per_s) for p in profiles(session)) == \
        [("L40S", 1, 1600.0), ("L40S", 2, 3000.0)]
    # More GPUs than the placement holds cannot have been measured.
    r = client.post(url, headers=factory.worker, json=report(pid, gpus=3))
    assert r.status_code == 422 and r.json()["error"]["param"] == "gpus"


def test_only_the_live_attempt_may_report(client, factory, session) -> None:  # noqa: ANN001
    node = factory.node("gpu-a", gpus=2)
    w = factory.worker
    task = factory.task(factory.tenant(), search_space=SPACE)["id"]
    old = claimed(client, factory, task, node)
    url = f"/internal/v1/tasks/{task}/throughput"
    assert client.post(url, headers=w, json=report(old)).status_code == 200
    before = snapshot(session)
    r = client.post(f"/internal/v1/tasks/{task}/failed", headers=w,
                    json={"placement_id": old, "error": "node lost", "retryable": True})
    assert r.status_code == 200 and r.json()["state"] == "queued"

    # The failed attempt is fenced off; nothing changes.
    r = client.post(url, headers=w, json=report(old, tokens_per_s=1.0))
    assert r.status_code == 409 and r.json()["error"]["code"] == "stale_attempt"
    assert snapshot(session) == before
    # A superseded plan of the next attempt is fenced off too.
    stale = factory.placement(task, node, attempt=2, publish=False)
    session.get(Placement, stale).state = "superseded"
    session.commit()
    assert client.post(url, headers=w, json=report(stale, tokens_per_s=1.0)).status_code == 409
    assert snapshot(session) == before

    # The next attempt's live placement reports.
    new = claimed(client, factory, task, node, attempt=2)
    assert client.post(url, headers=w, json=report(new, tokens_per_s=1500.0)
                       ).json() == {"stored": 0}
    assert [p.tokens_per_s for p in profiles(session)] == [1500.0]

    # Once the task is over, its placement is fenced off as well.
    fin = client.post(f"/internal/v1/tasks/{task}/finished", headers=w,
                      json={"placement_id": new})
    assert fin.status_code == 200 and fin.json()["state"] in ("succeeded", "failed")
    before = snapshot(session)
    r = client.post(url, headers=w, json=report(new, tokens_per_s=1.0))
    assert r.status_code == 409 and r.json()["error"]["code"] == f"task_{fin.json()['state']}"
    assert snapshot(session) == before


def test_unknown_task_or_placement_auth_and_bad_values(client, factory, session) -> None:  # noqa: ANN001
    node = factory.node("gpu-a", gpus=2)
    t = factory.tenant()
    task = factory.task(t, search_space=SPACE)["id"]
    other = factory.task(t, search_space=SPACE)["id"]
    pid = claimed(client, factory, task, node)
    w = factory.worker
    url = f"/internal/v1/tasks/{task}/throughput"

    assert client.post("/internal/v1/tasks/task_nope/throughput", headers=w,
                       json=report(pid)).status_code == 404
    r = client.post(f"/internal/v1/tasks/{other}/throughput", headers=w, json=report(pid))
    assert r.status_code == 404 and r.json()["error"]["param"] == "placement_id"
    assert client.post(url, headers=w, json=report("pl_nope")).status_code == 404

    assert client.post(url, json=report(pid)).status_code == 401
    assert client.post(url, headers=t.headers, json=report(pid)).status_code == 401
    assert client.post(url, headers={"Authorization": "Bearer wrong"},
                       json=report(pid)).status_code == 401

    bad = [{"tokens_per_s": 0}, {"tokens_per_s": -5.0}, {"tokens_per_s": "fast"},
           {"gpus": 0}, {"gpus": 65}, {"seq_len": 0}, {"batch_sizes": []},
           {"batch_sizes": [4, 0]}, {"batch_sizes": [-2]}, {"samples_per_s": 0},
           {"placement_id": None}, {"extra": 1}]
    for change in bad:
        r = client.post(url, headers=w, json=report(pid) | change)
        assert r.status_code == 422, (change, r.text)
        assert r.json()["error"]["code"] == "invalid_request"
    missing = report(pid)
    del missing["tokens_per_s"]
    assert client.post(url, headers=w, json=missing).status_code == 422
    nan = json.dumps(report(pid, tokens_per_s=float("nan")))  # NaN, as json.dumps writes it
    r = client.post(url, headers=w | {"Content-Type": "application/json"}, content=nan)
    assert r.status_code == 422, r.text
    many = report(pid, batch_sizes=list(range(1, 200)))  # a key longer than the column
    r = client.post(url, headers=w, json=many)
    assert r.status_code == 422 and r.json()["error"]["param"] == "batch_sizes"
    assert profiles(session) == []


def _estimate(session, settings, task_id: str) -> int:  # noqa: ANN001
    session.expire_all()
    inst, _, _ = build_instance(session, settings, utcnow())
    [spec] = [s for s in inst.tasks if s.id == task_id]
    gpus, seconds = spec.by_gpu_type[GPU_TYPE]
    assert gpus == 1 and spec.duration_s == seconds  # tiny-llama fits one GPU
    return seconds


def _tokens_to_train(session, task_id: str) -> float:  # noqa: ANN001
    """Every job trains all its steps (early exit off): steps * batch size * tokens per sample,
    tokens per sample guessed from the training file as the estimator does (4 bytes a token)."""
    task = session.get(Task, task_id)
    file = session.get(File, task.training_file_id)
    per_sample = min(task.settings["max_seq_len"], file.bytes / file.line_count / 4.0)
    sizes = [b for b in SPACE["batch_size"] for _ in SPACE["learning_rate"]]
    samples = task.num_train_samples * task.settings["epochs"]
    return sum(math.ceil(samples / b) * b * per_sample for b in sizes)


def test_a_stored_profile_drives_the_next_estimate_of_the_model(client, factory, session,
                                                               settings) -> None:  # noqa: ANN001
    node = factory.node("gpu-a", gpus=2)
    t = factory.tenant()
    measured = factory.task(t, search_space=SPACE)["id"]
    pid = claimed(client, factory, measured, node, gpus=(0, 1))
    nxt = factory.task(t, search_space=SPACE, early_exit={"enabled": False})["id"]
    assert session.get(Task, nxt).state == "queued"
    tokens = _tokens_to_train(session, nxt)
    analytic = _estimate(session, settings, nxt)
    url = f"/internal/v1/tasks/{measured}/throughput"

    # Measured on 2 GPUs; the next task is planned on 1: one GPU's share by the scaling rule.
    assert client.post(url, headers=factory.worker, json=report(pid, gpus=2, tokens_per_s=0.38)
                       ).status_code == 200
    per_gpu = 0.38 / 1.9  # 1 + multi_gpu_scaling (0.9) for the second GPU
    two_gpu = _estimate(session, settings, nxt)
    assert two_gpu == math.ceil(tokens / per_gpu) and two_gpu != analytic

    # Measured on the task's own GPU count with its own mix: used as it is.
    assert client.post(url, headers=factory.worker, json=report(pid, gpus=1, tokens_per_s=0.9)
                       ).status_code == 200
    exact = _estimate(session, settings, nxt)
    assert exact == math.ceil(tokens / 0.9) and exact != analytic

    # Profiles of another model, GPU type or length leave the estimate alone.
    session.add_all([
        ThroughputProfile(base_model="big-model", gpu_type=GPU_TYPE, seq_len=128,
                          batch_key="2x2,4x2", gpus=1, tokens_per_s=1.0),
        ThroughputProfile(base_model="tiny-llama", gpu_type="A10G", seq_len=128,
                          batch_key="2x2,4x2", gpus=1, tokens_per_s=1.0),
        ThroughputProfile(base_model="tiny-llama", gpu_type=GPU_TYPE, seq_len=256,
                          batch_key="2x2,4x2", gpus=1, tokens_per_s=1.0)])
    session.commit()
    assert _estimate(session, settings, nxt) == exact


def test_another_batch_mix_uses_the_nearest_measured_mix(client, factory, session,
                                                         settings) -> None:  # noqa: ANN001
    node = factory.node("gpu-a", gpus=2)
    t = factory.tenant()
    measured = factory.task(t, search_space=SPACE)["id"]
    pid = claimed(client, factory, measured, node)
    url = f"/internal/v1/tasks/{measured}/throughput"
    # What an executor reports when admission fits a subset: 2x2,4x2 (12 samples a step) and a
    # far larger mix 64x4 (256 samples a step), faster, so a median would pick it.
    for mix, rate in ((MIX, 1.0), ([64] * 4, 9.0)):
        assert client.post(url, headers=factory.worker,
                           json=report(pid, batch_sizes=mix, tokens_per_s=rate)).status_code == 200
    space = SPACE | {"learning_rate": [1e-4]}  # 2x1,4x1: 6 samples a step, no profile of its own
    nxt = factory.task(t, search_space=space, early_exit={"enabled": False})["id"]
    task = session.get(Task, nxt)
    file = session.get(File, task.training_file_id)
    per_sample = min(task.settings["max_seq_len"], file.bytes / file.line_count / 4.0)
    tokens = sum(math.ceil(task.num_train_samples * task.settings["epochs"] / b) * b * per_sample
                 for b in (2, 4))
    assert _estimate(session, settings, nxt) == math.ceil(tokens / 1.0)
    assert session.scalar(select(func.count()).select_from(ThroughputProfile)) == 2
