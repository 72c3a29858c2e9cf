"""Integration: tracking integrations. A task's `integrations` (W&B, MLflow) through the native
create and the OpenAI-compatible one (bad input: a 422 naming the field, nothing stored), shown
with their sync status; after the task ended the service writes every job as a run, from the
metrics in PostgreSQL: to a real MLflow tracking server the test starts (read back through its
REST API), and to W&B offline run files (read back record by record)."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from service.models import Event, IdempotencyKey, Job, Task, TaskIntegration


@pytest.fixture
def settings(settings):  # noqa: ANN001, ANN201 - the conftest's, with the syncer off
    return settings.model_copy(update={"tracking_poll_s": 0.0})


def counts(session) -> dict:  # noqa: ANN001
    session.expire_all()
    return {m.__name__: session.scalar(select(func.count()).select_from(m))
            for m in (Task, Job, Event, IdempotencyKey, TaskIntegration)}


WANDB = {"type": "wandb", "wandb": {"project": "lora-search", "name": "bot", "entity": "team",
                                    "tags": ["nightly"]}}


def test_bad_integrations_are_422_naming_the_field_and_store_nothing(client, factory, session
                                                                     ) -> None:  # noqa: ANN001
    t = factory.tenant()
    train = factory.file(t)["id"]
    native = {"base_model": "tiny-llama", "training_file": train, "max_seq_len": 128,
              "search_space": {"learning_rate": [1e-4], "lora_rank": [4]}}
    openai = {"model": "tiny-llama", "training_file": train}
    cases = [
        ([{"type": "neptune", "neptune": {}}], "integrations.type", "integrations[0].type"),
        ([WANDB, {"type": "comet"}], "integrations.type", "integrations[1].type"),
        ([{"type": "wandb"}], "integrations.wandb", "integrations[0].wandb"),
        ([{"type": "wandb", "wandb": {"name": "x"}}], "integrations.wandb.project",
         "integrations[0].wandb.project"),
        ([{"type": "wandb", "wandb": {"project": ""}}], "integrations.wandb.project", None),
        ([{"type": "wandb", "wandb": {"project": "p", "tags": ["x" * 65]}}],
         "integrations.wandb.tags", "integrations[0].wandb.tags[0]"),
        ([{"type": "wandb", "wandb": {"project": "p", "color": "red"}}],
         "integrations.wandb.color", None),
        ([{"type": "wandb", "wandb": {"project": "p"}, "mlflow": {"tracking_uri": "http://x"}}],
         "integrations.mlflow", "integrations[0].mlflow"),
        ([{"type": "mlflow", "mlflow": {}}], "integrations.mlflow.tracking_uri", None),
        ([{"type": "mlflow", "mlflow": {"tracking_uri": "ftp://mlflow.example.com"}}],
         "integrations.mlflow.tracking_uri", "http and https"),
        ([{"type": "mlflow", "mlflow": {"tracking_uri": "not a url"}}],
         "integrations.mlflow.tracking_uri", None),
        ([{"type": "mlflow", "mlflow": {"tracking_uri": "http://u:p@mlflow.example.com"}}],
         "integrations.mlflow.tracking_uri", "credentials"),
        ([{"type": "mlflow", "mlflow": {"tracking_uri": "http://mlflow.example.com/?a=1"}}],
         "integrations.mlflow.tracking_uri", "query"),
        # the webhooks' SSRF rule: loopback and private addresses only if the operator allows
        ([WANDB, {"type": "mlflow", "mlflow": {"tracking_uri": "http://127.0.0.1:5000"}}],
         "integrations.mlflow.tracking_uri", "LORAPLEX_TRACKING_ALLOW_PRIVATE"),
        ([{"type": "mlflow", "mlflow": {"tracking_uri": "http://10.1.2.3"}}],
         "integrations.mlflow.tracking_uri", "integrations[0].mlflow.tracking_uri"),
        ([WANDB] * 9, "integrations", None),
        ("wandb", "integrations", None),
    ]
    before = counts(session)
    for integrations, param, says in cases:
        for path, body in (("/v1/tasks", native), ("/v1/fine_tuning/jobs", openai)):
            for params in ({}, {"dry_run": "true"}):
                r = client.post(path, headers=t.headers, params=params,
                                json=body | {"integrations": integrations})
                assert r.status_code == 422, (path, integrations, r.text)
                error = r.json()["error"]
                assert error["param"] == param, (path, integrations, error)
                assert says is None or says in error["message"], (path, error)
    assert counts(session) == before

    # null and [] are no integrations
    for value in (None, []):
        task = factory.task(t, integrations=value)
        assert task["integrations"] == []
        job = client.post("/v1/fine_tuning/jobs", headers=t.headers,
                          json=openai | {"integrations": value}).json()
        assert job["integrations"] is None


def test_integrations_are_stored_and_shown_waiting(client, factory, session) -> None:  # noqa: ANN001
    t = factory.tenant()
    mlflow = {"type": "mlflow", "mlflow": {"tracking_uri": "https://8.8.8.8:5000/mlflow",
                                           "experiment_name": "search"}}
    task = factory.task(t, integrations=[WANDB, mlflow])
    expected = [
        {"type": "wandb", "wandb": WANDB["wandb"], "mlflow": None, "status": "waiting",
         "attempts": 0, "last_error": None, "synced_at": None},
        {"type": "mlflow", "wandb": None, "mlflow": {**mlflow["mlflow"], "run_name": None},
         "status": "waiting", "attempts": 0, "last_error": None, "synced_at": None}]
    assert task["integrations"] == expected
    assert client.get(f"/v1/tasks/{task['id']}", headers=t.headers).json()["integrations"] \
        == expected
    listed = client.get("/v1/tasks", headers=t.headers).json()["data"][0]
    assert listed["integrations"] == expected
    job = client.get(f"/v1/fine_tuning/jobs/{task['id']}", headers=t.headers).json()
    assert job["integrations"] == expected

    # the OpenAI surface takes OpenAI's shape as the SDK sends it
    train = factory.file(t)["id"]
    r = client.post("/v1/fine_tuning/jobs", headers=t.headers, json={
        "model": "tiny-llama", "training_file": train,
        "integrations": [{"type": "wandb", "wandb": {"project": "p"}}]})
    assert r.status_code == 200, r.text
    assert r.json()["integrations"] == [
        {"type": "wandb", "wandb": {"project": "p", "name": None, "entity": None, "tags": None},
         "mlflow": None, "status": "waiting", "attempts": 0, "last_error": None,
         "synced_at": None}]
    rows = session.scalars(select(TaskIntegration).where(
        TaskIntegration.task_id == task["id"]).order_by(TaskIntegration.position)).all()
    assert [(r.type, r.state) for r in rows] == [("wandb", "pending"), ("mlflow", "pending")]
