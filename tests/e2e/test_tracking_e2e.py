"""End to end, tracking: a task with an MLflow integration (a real `mlflow server` the test
starts, on loopback: the operator allows private addresses) and a W&B one (offline, under the
operator's LORAPLEX_WANDB_DIR) is created with the `loraplex` CLI's flags and trained to the end by a real daemon on a tiny
Llama; the
leader's syncer writes its runs, the task view shows both integrations synced, and what the
tracking servers hold is what the loraplex API says: one run per job with the job's
hyperparameters, train and validation curves equal to the task's stored ones step by step, the
jobs' states and exit reasons, and the task's best job the one run tagged best."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack, wait_for
from tests.e2e.test_train_e2e import dataset, models_yaml  # noqa: F401 - the tiny Llama
from tests.helpers.tracking import Mlflow, MlflowServer, params, read_run, tags

pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("trainer.executor", reason="the training executor has not landed")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")

EXPERIMENT, PROJECT = "e2e-search", "e2e-project"
LEARNING_RATES = [1e-3, 3e-2]


@pytest.fixture(autouse=True)
def tracking_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Read by the stack's environment (tests/e2e/conftest.stack_env): the MLflow server is on
    # loopback, W&B runs go under the test's folder, the syncer polls often.
    monkeypatch.setenv("LORAPLEX_TRACKING_ALLOW_PRIVATE", "true")
    monkeypatch.setenv("LORAPLEX_WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("LORAPLEX_TRACKING_POLL_S", "0.5")
    monkeypatch.setenv("LORAPLEX_TRACKING_BACKOFF_S", "[1]")


@pytest.fixture
def mlflow(tmp_path: Path) -> Iterator[MlflowServer]:
    """Started, not waited for: it comes up while the task trains (the syncer retries it)."""
    root = tmp_path / "mlflow"
    root.mkdir()
    server = MlflowServer(root)
    try:
        yield server
    finally:
        server.stop()


def finite(points: list[dict]) -> list[tuple[int, float]]:
    """A stored curve's (step, loss) pairs; a diverged (null) loss is in no run's history."""
    return [(p["step"], p["loss"]) for p in points
            if p["loss"] is not None and math.isfinite(p["loss"])]


def same_curve(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> bool:
    return [s for s, _ in got] == [s for s, _ in want] and all(
        v == pytest.approx(w, rel=1e-6, abs=1e-9) for (_, v), (_, w) in zip(got, want, strict=True))


def same_param(text: str, value: object) -> bool:
    """An MLflow param (text) shows the job's hyperparameter value."""
    if isinstance(value, bool):
        return text == str(value).lower()
    if isinstance(value, int | float):
        return float(text) == pytest.approx(float(value))
    return text == str(value)


def test_runs_of_a_trained_task_reach_mlflow_and_wandb(mlflow: MlflowServer, stack: Stack,
                                                       tmp_path: Path) -> None:
    from rich.console import Console

    from service.cli import main as cli

    stack.daemon("cpu-node")
    files = {}
    for name, records in (("train", dataset(24, seed=1)), ("val", dataset(8, seed=2))):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in records))
    # the CLI uploads the files and builds the integrations from its flags
    out = Console(record=True, width=400)
    assert cli(["--api-url", stack.url, "--api-key", stack.api_key, "--json", "tasks", "create",
                "--model", "tiny", "--train", str(files["train"]), "--validation",
                str(files["val"]), *(a for lr in LEARNING_RATES for a in ("--lr", str(lr))),
                "--rank", "4", "--batch-size", "4", "--epochs", "1", "--max-seq-len", "64",
                "--seed", "5", "--set", "suffix=e2e", "--set", 'eval={"eval_every_steps": 2}',
                # two jobs, the warmup ranking keeps one: the other exits with a reason
                "--set", 'early_exit={"warmup_fraction": 0.25, "keep_fraction": 0.5}',
                "--mlflow-uri", mlflow.url, "--mlflow-experiment", EXPERIMENT,
                "--wandb-project", PROJECT], console=out) == 0, out.export_text()
    task = json.loads(out.export_text())
    tid = task["id"]
    with stack.http() as http:
        assert [(i["type"], i["mlflow"] or i["wandb"]) for i in task["integrations"]] == [
            ("wandb", {"project": PROJECT, "name": None, "entity": None, "tags": None}),
            ("mlflow", {"tracking_uri": mlflow.url, "experiment_name": EXPERIMENT,
                        "run_name": None})]
        assert [i["status"] for i in task["integrations"]] == ["waiting", "waiting"]
        stack.place(tid, "cpu-node")
        final = wait_for(lambda: (t := http.get(f"/v1/tasks/{tid}").json())["state"] in (
            "succeeded", "failed", "cancelled") and t, 120,
            f"the task to end\n{stack.daemon_log('cpu-node')}")
        assert final["state"] == "succeeded", (final, stack.daemon_log("cpu-node"))
        mlflow.wait_ready()
        view = wait_for(lambda: (t := http.get(f"/v1/tasks/{tid}").json()) and all(
            i["status"] in ("synced", "failed") for i in t["integrations"]) and t, 90,
            f"the integrations to sync\n{stack.service_log()}")
        assert [(i["type"], i["status"], i["last_error"]) for i in view["integrations"]] == [
            ("wandb", "synced", None), ("mlflow", "synced", None)], view["integrations"]
        jobs = {j["id"]: j for j in http.get(f"/v1/tasks/{tid}/jobs").json()["data"]}
        curves = {c["job_id"]: c for c in http.get(f"/v1/tasks/{tid}/metrics").json()["jobs"]}
    best = view["best_job_id"]
    assert len(jobs) == 2 and best in jobs and set(curves) == set(jobs)
    assert any(j["state"] == "exited" and j["exit_reason"] for j in jobs.values()), jobs
    assert all(finite(c["train"]) for c in curves.values())

    # MLflow: a parent run of the task and one run per job
    ml = Mlflow(mlflow.url)
    experiment = ml.get("experiments/get-by-name", experiment_name=EXPERIMENT)["experiment"]
    runs = ml.runs(experiment["experiment_id"], tid)
    by_key = {tags(r)["loraplex.key"]: r for r in runs}
    assert set(by_key) == {"task", *jobs} and len(runs) == 3
    assert tags(by_key["task"])["loraplex.best_job_id"] == best
    assert by_key["task"]["info"]["run_name"] == "e2e"
    assert [k for k, r in by_key.items() if tags(r).get("loraplex.best") == "true"] == [best]
    for job_id, job in jobs.items():
        run = by_key[job_id]
        tag, param = tags(run), params(run)
        assert tag["loraplex.state"] == job["state"]
        assert tag.get("loraplex.exit_reason") == job["exit_reason"]
        assert tag["mlflow.parentRunId"] == by_key["task"]["info"]["run_id"]
        assert run["info"]["status"] == "FINISHED"
        assert job["hyperparameters"] and all(
            same_param(param[k], v) for k, v in job["hyperparameters"].items()), (param, job)
        assert param["job_index"] == str(job["index"]) and param["task_id"] == tid
        run_id = run["info"]["run_id"]
        assert same_curve(ml.history(run_id, "train_loss"), finite(curves[job_id]["train"])), (
            ml.history(run_id, "train_loss"), curves[job_id]["train"])
        assert same_curve(ml.history(run_id, "valid_loss"), finite(curves[job_id]["val"]))

    # W&B: one offline run file per job, with the same history
    for job_id, job in jobs.items():
        found = list((tmp_path / "wandb").glob(
            f"*/{tid}/*/wandb/offline-run-*-{job_id}/run-{job_id}.wandb"))
        assert len(found) == 1, found
        run = read_run(found[0])
        assert (run["id"], run["project"], run["group"]) == (job_id, PROJECT, tid)
        assert run["name"] == f"e2e/job-{job['index']}"
        assert all(run["config"][k] == v for k, v in job["hyperparameters"].items())
        history = run["history"]
        assert same_curve([(h["_step"], h["train_loss"]) for h in history if "train_loss" in h],
                          finite(curves[job_id]["train"]))
        assert same_curve([(h["_step"], h["valid_loss"]) for h in history if "valid_loss" in h],
                          finite(curves[job_id]["val"]))
        assert run["summary"]["best"] is (job_id == best)
        assert run["summary"]["state"] == job["state"]
        assert run["summary"]["exit_reason"] == job["exit_reason"]
