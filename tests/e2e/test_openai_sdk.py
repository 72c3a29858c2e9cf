"""The official `openai` Python SDK against the real stack (service with its scheduler, PostgreSQL,
Redis, a real daemon training a tiny Llama on CPU), changing nothing but the base URL: files,
fine_tuning.jobs create / list / retrieve / list_events / checkpoints.list / pause / resume /
cancel for SFT (a search space of two learning rates, paused and resumed) and DPO
(a beta search space), models.retrieve, and the SDK's typed errors for bad input. One stack and
one daemon serve the whole module."""

from __future__ import annotations

import io
import json
import os
import random
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack, make_tenant, wait_for
from tests.integration.conftest import TEMPLATE_DB

openai = pytest.importorskip("openai")
pytest.importorskip("torch")

WORDS = "one two three four five six seven eight nine ten".split()
SFT_EXTRAS = {"max_seq_len": 48, "early_exit": {"enabled": False},
              "eval": {"eval_every_steps": 6, "eval_max_samples": 8}}


def chat(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"messages": [{"role": "user", "content": " ".join(WORDS[i:i + 2])},
                          {"role": "assistant", "content": " ".join(WORDS[i + 2:i + 4])}]}
            for i in (rng.randrange(0, 6) for _ in range(n))]


def prefs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": " ".join(WORDS[i:i + 2]), "chosen": " ".join(WORDS[i + 2:i + 4]),
             "rejected": " ".join(WORDS[i + 4:i + 6])}
            for i in (rng.randrange(0, 4) for _ in range(n))]


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture(scope="module")
def sdk_stack(pg, redis_server, tmp_path_factory) -> Iterator[Stack]:  # noqa: ANN001
    """One running service (scheduler on) with one tenant and one daemon for the module."""
    import psycopg
    import redis

    from service.core.localstack import free_port
    from tests.e2e.conftest import REPO, WORKER_TOKEN
    from trainer.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("sdk")
    model_dir = make_tiny_model("llama", root / "tiny-llama", seed=0)
    models = root / "models.yaml"
    models.write_text(f"models:\n  - name: tiny\n    path: {model_dir}\n    parameters: 100000\n"
                      "    gpus: 1\n    max_seq_len: 128\n    family: llama\n")
    name = f"t_{uuid.uuid4().hex[:16]}"
    pg.create_database(name, template=TEMPLATE_DB)
    db = pg.url(name)
    redis.Redis.from_url(redis_server.url).flushall()
    env = dict(os.environ) | {
        "LORAPLEX_DATABASE_URL": db if "+psycopg" in db
        else db.replace("postgresql://", "postgresql+psycopg://"),
        "LORAPLEX_REDIS_URL": redis_server.url, "LORAPLEX_STORAGE_DIR": str(root / "storage"),
        "LORAPLEX_MODELS_FILE": str(models), "LORAPLEX_WORKER_TOKEN": WORKER_TOKEN,
        "LORAPLEX_NODE_TIMEOUT_S": "10", "LORAPLEX_MAINTENANCE_INTERVAL_S": "1",
        "LORAPLEX_SCHEDULER_ENABLED": "true", "LORAPLEX_SCHEDULER_INTERVAL_S": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1"}
    s = Stack(url=f"http://127.0.0.1:{free_port()}", env=env, root=Path(root), db_url=db,
              redis_url=redis_server.url, scheduler=True)
    s.api_key = make_tenant(db, "sdk-tenant")
    s.start_service()
    s.daemon("node", env={"LORAPLEX_CHECKPOINT_EVERY": "4"})
    try:
        yield s
    finally:
        s.stop_daemons()
        s.stop_service()
        with psycopg.connect(f"host=127.0.0.1 port={pg.port} user=loraplex dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def client(sdk_stack: Stack):  # noqa: ANN201 - openai.OpenAI
    return openai.OpenAI(api_key=sdk_stack.api_key, base_url=f"{sdk_stack.url}/v1",
                         max_retries=0, timeout=60)


def upload(client, name: str, rows: list[dict]) -> str:  # noqa: ANN001
    f = client.files.create(file=(name, io.BytesIO(jsonl(rows))), purpose="fine-tune")
    assert f.object == "file" and isinstance(f.created_at, int) and f.bytes > 0
    return f.id


def status(client, job_id: str) -> str:  # noqa: ANN001
    return client.fine_tuning.jobs.retrieve(job_id).status


def wait_status(client, stack: Stack, job_id: str, want: tuple[str, ...], timeout: float = 240,
                ) -> str:  # noqa: ANN001
    return wait_for(lambda: (s := status(client, job_id)) in want and s, timeout,
                    f"{job_id} to be {want}\n{stack.daemon_log('node')[-3000:]}")


def check_finished_job(client, job_id: str, n_jobs: int) -> None:  # noqa: ANN001
    job = client.fine_tuning.jobs.retrieve(job_id)
    assert job.status == "succeeded" and job.fine_tuned_model.endswith(job_id)
    assert job.trained_tokens and job.trained_tokens > 0 and job.finished_at >= job.created_at
    events = list(client.fine_tuning.jobs.list_events(job_id, limit=20))  # pages through all
    assert len({e.id for e in events}) == len(events)
    assert {e.type for e in events} == {"message", "metrics"}
    metrics = [e for e in events if e.type == "metrics"]
    trained = {e.data["job_id"] for e in metrics}
    assert len(trained) == n_jobs and job.model_extra["best_job_id"] in trained
    assert all(e.data["valid_loss"] is not None and e.data["step"] >= 1 for e in metrics)
    cps = client.fine_tuning.jobs.checkpoints.list(job_id).data
    assert len(cps) == n_jobs and all(c.object == "fine_tuning.job.checkpoint" for c in cps)
    best = [c for c in cps if c.model_extra.get("best")]
    assert len(best) == 1 and best[0].model_extra["job_id"] == job.best_job_id
    assert best[0].metrics.valid_loss == min(c.metrics.valid_loss for c in cps)
    assert best[0].step_number >= 1 and best[0].fine_tuning_job_id == job_id
    model = client.models.retrieve(job.fine_tuned_model)
    assert model.id == job.fine_tuned_model and model.object == "model"


def test_sft_job_with_pause_resume_through_the_sdk(client, sdk_stack: Stack) -> None:  # noqa: ANN001
    assert client.models.retrieve("tiny").id == "tiny"
    train = upload(client, "train.jsonl", chat(72, 1))
    val = upload(client, "val.jsonl", chat(8, 2))
    job = client.fine_tuning.jobs.create(
        model="tiny", training_file=train, validation_file=val, suffix="sdk", seed=3,
        metadata={"suite": "sdk", "kind": "sft"},
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "n_epochs": 1, "batch_size": 4, "learning_rate_multiplier": [100, 300],
            "lora_rank": 4}}},
        extra_body=SFT_EXTRAS)
    assert job.object == "fine_tuning.job" and job.status in ("queued", "running")
    assert job.model == "tiny" and job.seed == 3 and job.training_file == train
    assert job.method.type == "supervised"
    assert job.method.supervised.hyperparameters.learning_rate_multiplier == [100, 300]
    assert job.metadata == {"suite": "sdk", "kind": "sft"}
    assert job.model_extra["num_jobs"] == 2

    listed = client.fine_tuning.jobs.list(metadata={"kind": "sft"})
    assert [j.id for j in listed.data] == [job.id]
    assert client.fine_tuning.jobs.list(metadata={"kind": "none"}).data == []

    # pause at once (queued, or just started: then it checkpoints and stops first), resume;
    # a pause mid-training is tests/e2e/test_pause_resume.py's, which checks the GPUs too
    paused = client.fine_tuning.jobs.pause(job.id)
    assert paused.status in ("pausing", "paused")
    wait_status(client, sdk_stack, job.id, ("paused",), 60)
    assert client.fine_tuning.jobs.retrieve(job.id).estimated_finish is None
    with pytest.raises(openai.ConflictError) as err:  # resume only what is paused
        client.fine_tuning.jobs.pause(client.fine_tuning.jobs.cancel(
            client.fine_tuning.jobs.create(model="tiny", training_file=train,
                                           hyperparameters={"lora_rank": 4},
                                           extra_body=SFT_EXTRAS).id).id)
    assert err.value.code == "task_cancelled" and err.value.type == "invalid_request_error"
    resumed = client.fine_tuning.jobs.resume(job.id)
    assert resumed.status == "queued"
    wait_status(client, sdk_stack, job.id, ("succeeded", "failed", "cancelled"))
    check_finished_job(client, job.id, 2)
    steps = {}
    with sdk_stack.http() as http:
        for curve in http.get(f"/v1/tasks/{job.id}/metrics").json()["jobs"]:
            steps[curve["job_id"]] = [p["step"] for p in curve["train"]]
        kinds = [e["type"] for e in http.get(f"/v1/tasks/{job.id}/events",
                                             params={"limit": 1000}).json()["data"]]
    assert all(s == list(range(1, 19)) for s in steps.values()), steps  # each step once
    assert "task_paused" in kinds and "task_resumed" in kinds


def test_dpo_job_and_errors_through_the_sdk(client, sdk_stack: Stack) -> None:  # noqa: ANN001
    train = upload(client, "prefs.jsonl", prefs(24, 3))
    job = client.fine_tuning.jobs.create(
        model="tiny", training_file=train,
        method={"type": "dpo", "dpo": {"hyperparameters": {
            "beta": [0.1, 0.5], "n_epochs": 1, "batch_size": 4,
            "learning_rate_multiplier": 100, "lora_rank": 4}}},
        extra_body=SFT_EXTRAS | {"eval": {"eval_every_steps": 2, "eval_max_samples": 4}})
    assert job.method.type == "dpo" and job.method.dpo.hyperparameters.beta == [0.1, 0.5]
    ids = [j.id for j in client.fine_tuning.jobs.list(limit=100)]
    assert job.id in ids
    wait_status(client, sdk_stack, job.id, ("succeeded", "failed", "cancelled"))
    check_finished_job(client, job.id, 2)
    # bad input: the SDK's typed errors, naming the param; nothing created
    before = len(list(client.fine_tuning.jobs.list(limit=100)))
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.fine_tuning.jobs.create(model="tiny", training_file=train, method={
            "type": "dpo", "dpo": {"hyperparameters": {"beta": -1}}})
    assert err.value.param == "method.dpo.hyperparameters.beta"
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.fine_tuning.jobs.create(model="no-such-model", training_file=train)
    assert err.value.param == "model" and err.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("task_missing")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert len(list(client.fine_tuning.jobs.list(limit=100))) == before
