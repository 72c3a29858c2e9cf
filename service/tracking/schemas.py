"""The `integrations` of a task create (OpenAI's W&B shape, plus loraplex's MLflow) and of the
task and fine-tuning job views, with each integration's sync status."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.tracking.states import SyncStatus

Name = Annotated[str, Field(min_length=1, max_length=128)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WandbSettings(_In):
    """OpenAI's W&B integration: where each job's run goes (written offline by the service)."""

    project: Name = Field(description="The W&B project of the runs.")
    name: Name | None = Field(default=None, description="Display name of the runs (each job's "
                              "run is `<name>/job-<index>`); default the task's id.")
    entity: Name | None = Field(default=None, description="The W&B team or user; default the "
                                "key's default entity when the runs are synced.")
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        default=None, max_length=50, description="Tags of every run (up to 50).")


class MlflowSettings(_In):
    """loraplex's MLflow integration: the tracking server and experiment of the runs."""

    tracking_uri: str = Field(min_length=1, max_length=2048, description="http(s) URL of the "
                              "MLflow tracking server (no credentials, query or fragment).")
    experiment_name: Annotated[str, Field(min_length=1, max_length=500)] = Field(
        default="loraplex", description="Created when the server lacks it.")
    run_name: Name | None = Field(default=None, description="Name of the task's parent run; "
                                  "default the task's suffix, else its id.")


class IntegrationIn(_In):
    """One integration: `type` names it and the object of that name holds its settings."""

    type: Literal["wandb", "mlflow"]
    wandb: WandbSettings | None = None
    mlflow: MlflowSettings | None = None


class IntegrationOut(BaseModel):
    """An integration as created, with its sync: waiting (the task has not ended), pending (due,
    or retried after last_error), synced, or failed (given up; last_error says why)."""

    type: Literal["wandb", "mlflow"]
    wandb: WandbSettings | None = None
    mlflow: MlflowSettings | None = None
    status: SyncStatus
    attempts: int = Field(description="Sync attempts so far.")
    last_error: str | None = None
    synced_at: int | None = Field(default=None, description="Unix seconds.")
