"""An ended task as MLflow runs, through the tracking server's REST API (httpx; no mlflow package):
a parent run for the task and one child run per job (`mlflow.parentRunId`) with its
hyperparameters as params, its train and validation curves as metrics by step, its state and exit
reason as tags and `loraplex.best=true` on the task's best job.

Idempotent across retries: the task's runs are found by their `loraplex.task_id` tag first; a
job's run that a previous attempt finished (status no longer RUNNING) is kept, one it left
half-written is deleted and written again, the parent is reused. Each call connects to the
address its host resolved to when the sync began (checked against the operator's SSRF rule)."""

from __future__ import annotations

import math
from typing import Any

import httpx

from contract.states import JobState, TaskState
from service.core.config import Settings
from service.tracking.integrations import check_tracking_uri
from service.tracking.records import JobRecord, TaskRecord, millis
from service.webhooks.security import Target

USER_AGENT = "loraplex-tracking/1"
TASK_KEY = "task"  # loraplex.key of the parent run; a job's run has its job id
BATCH = 1000  # runs/log-batch takes at most 1000 metrics (and 100 params, 100 tags) per call
# An ended task's or job's state as its run's status (the two share failed and cancelled).
RUN_STATUS = {TaskState.SUCCEEDED: "FINISHED", JobState.COMPLETED: "FINISHED",
              JobState.EXITED: "FINISHED", JobState.FAILED: "FAILED", JobState.CANCELLED: "KILLED"}


class MlflowError(Exception):
    """The tracking server refused a call or could not be reached (the sync is retried)."""


class MlflowApi:
    """The few REST calls a sync makes, to one pinned address."""

    def __init__(self, http: httpx.Client, target: Target) -> None:
        self._http, self._target = http, target
        self._base = target.url.rstrip("/") + "/api/2.0/mlflow/"

    def call(self, method: str, endpoint: str, body: dict | None = None,
             params: dict | None = None) -> dict:
        extensions = ({"sni_hostname": self._target.sni_hostname}
                      if self._target.sni_hostname else {})
        try:
            r = self._http.request(method, self._base + endpoint, json=body, params=params,
                                   headers={"host": self._target.host_header,
                                            "user-agent": USER_AGENT},
                                   extensions=extensions)
        except httpx.HTTPError as exc:
            raise MlflowError(f"{endpoint}: {type(exc).__name__}: {exc}") from exc
        try:
            data = r.json() if r.content else {}
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise MlflowError(f"{endpoint}: HTTP {r.status_code}: not a JSON object (is this an "
                              "MLflow tracking server?)")
        if r.status_code >= 400:
            code = data.get("error_code", "")
            raise MlflowError(f"{endpoint}: HTTP {r.status_code} {code}".rstrip() + ": "
                              + str(data.get("message", r.text[:200])))
        return data

    def experiment(self, name: str) -> str:
        """The id of the experiment of this name, created when the server lacks it."""
        try:
            found = self.call("GET", "experiments/get-by-name", params={"experiment_name": name})
        except MlflowError as exc:
            if "RESOURCE_DOES_NOT_EXIST" not in str(exc):
                raise
        else:
            experiment = found["experiment"]
            if experiment.get("lifecycle_stage") == "deleted":
                raise MlflowError(f"experiment {name!r} is deleted on the tracking server; "
                                  "restore it or choose another experiment_name")
            return experiment["experiment_id"]
        try:
            return self.call("POST", "experiments/create", {"name": name})["experiment_id"]
        except MlflowError as exc:  # created by another sync meanwhile
            if "RESOURCE_ALREADY_EXISTS" not in str(exc):
                raise
            return self.experiment(name)

    def task_runs(self, experiment_id: str, task_id: str) -> dict[str, dict]:
        """The live runs a previous attempt made for the task, by their loraplex.key."""
        runs: dict[str, dict] = {}
        token = None
        while True:
            body: dict[str, Any] = {"experiment_ids": [experiment_id], "max_results": 1000,
                                    "filter": f"tags.`loraplex.task_id` = '{task_id}'",
                                    "run_view_type": "ACTIVE_ONLY"}
            if token:
                body["page_token"] = token
            page = self.call("POST", "runs/search", body)
            for run in page.get("runs", []):
                tags = {t["key"]: t.get("value") for t in run.get("data", {}).get("tags", [])}
                if "loraplex.key" in tags:
                    runs[tags["loraplex.key"]] = run["info"]
            token = page.get("next_page_token")
            if not token:
                return runs

    def create_run(self, experiment_id: str, name: str, start: int | None,
                   tags: dict[str, str]) -> str:
        body: dict[str, Any] = {"experiment_id": experiment_id, "run_name": name,
                                "tags": _pairs(tags)}
        if start is not None:
            body["start_time"] = start
        return self.call("POST", "runs/create", body)["run"]["info"]["run_id"]

    def log(self, run_id: str, params: dict | None = None, tags: dict | None = None,
            metrics: list[dict] | None = None) -> None:
        if params or tags:
            self.call("POST", "runs/log-batch", {"run_id": run_id, "params": _pairs(params or {}),
                                                 "tags": _pairs(tags or {})})
        metrics = metrics or []
        for i in range(0, len(metrics), BATCH):
            self.call("POST", "runs/log-batch", {"run_id": run_id,
                                                 "metrics": metrics[i:i + BATCH]})

    def end_run(self, run_id: str, status: str, end: int | None) -> None:
        body: dict[str, Any] = {"run_id": run_id, "status": status}
        if end is not None:
            body["end_time"] = end
        self.call("POST", "runs/update", body)


def _pairs(values: dict) -> list[dict[str, str]]:
    return [{"key": k, "value": _text(v)} for k, v in values.items() if v is not None]


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _metric(key: str, value: float, at: int, step: int) -> dict:
    return {"key": key, "value": value, "timestamp": at, "step": step}


def job_metrics(job: JobRecord) -> list[dict]:
    """A job's curves (every step's train and validation values) and its best validation loss
    at its best step."""
    out = [_metric(key, value, millis(s.at), s.step)
           for s in job.steps for key, value in s.metrics.items()]
    if job.best_val_loss is not None and math.isfinite(job.best_val_loss):
        at = millis(job.finished_at) or (out[-1]["timestamp"] if out else 0)
        out.append(_metric("best_valid_loss", job.best_val_loss, at, job.best_step or 0))
    return out


def _job_run(api: MlflowApi, experiment_id: str, parent_id: str, task: TaskRecord,
             job: JobRecord, existing: dict | None) -> str:
    if existing is not None:
        if existing.get("status") != "RUNNING":  # a previous attempt wrote it all
            return existing["run_id"]
        api.call("POST", "runs/delete", {"run_id": existing["run_id"]})  # half-written
    run_id = api.create_run(experiment_id, f"job-{job.index}",
                            millis(job.started_at or task.started_at or task.created_at),
                            {"mlflow.parentRunId": parent_id, "loraplex.task_id": task.id,
                             "loraplex.job_id": job.id, "loraplex.key": job.id})
    api.log(run_id, params=task.params(job), metrics=job_metrics(job),
            tags={"loraplex.state": job.state, "loraplex.exit_reason": job.exit_reason,
                  "loraplex.best": job.best})
    api.end_run(run_id, RUN_STATUS.get(job.state, "KILLED"),
                millis(job.finished_at or task.finished_at))
    return run_id


def write_mlflow(task: TaskRecord, config: dict, settings: Settings) -> dict:
    """Write the task's runs to the tracking server of `config` (MlflowSettings' fields);
    returns what was written (experiment, parent and each job's run id). MlflowError, or the
    address check's AddressRefused, when it could not."""
    target = check_tracking_uri(config["tracking_uri"], settings)
    with httpx.Client(timeout=settings.tracking_timeout_s, follow_redirects=False,
                      trust_env=False) as http:
        api = MlflowApi(http, target)
        experiment_id = api.experiment(config.get("experiment_name") or "loraplex")
        existing = api.task_runs(experiment_id, task.id)
        parent = existing.get(TASK_KEY)
        parent_id = parent["run_id"] if parent else api.create_run(
            experiment_id, config.get("run_name") or task.suffix or task.id,
            millis(task.started_at or task.created_at),
            {"loraplex.task_id": task.id, "loraplex.key": TASK_KEY})
        api.log(parent_id, params=task.settings)
        runs = {job.id: _job_run(api, experiment_id, parent_id, task, job,
                                 existing.get(job.id)) for job in task.jobs}
        best = next((j for j in task.jobs if j.best), None)
        api.log(parent_id, tags={
            "loraplex.state": task.state, "loraplex.best_job_id": task.best_job_id,
            "loraplex.best_run_id": runs.get(task.best_job_id or "")},
            metrics=[_metric("best_valid_loss", best.best_val_loss, millis(task.finished_at) or 0,
                             best.best_step or 0)]
            if best is not None and best.best_val_loss is not None
            and math.isfinite(best.best_val_loss) else None)
        api.end_run(parent_id, RUN_STATUS.get(task.state, "KILLED"), millis(task.finished_at))
    return {"experiment_id": experiment_id, "parent_run_id": parent_id, "runs": runs}
