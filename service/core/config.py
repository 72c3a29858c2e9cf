"""Service settings, read once from the environment (prefix ``LORAPLEX_``) or a .env file.
Nothing else in the service reads os.environ; everything takes a Settings or calls get_settings()."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# the fair-share weight, stated once: the service's setting and the planner's default
DEFAULT_SCHEDULER_FAIRNESS = 0.25


class Settings(BaseSettings):
    """All knobs of the API process; defaults fit the local stack of scripts/loraplex-up.sh."""

    model_config = SettingsConfigDict(env_prefix="LORAPLEX_", env_file=".env", extra="ignore")

    database_url: str = "postgresql+psycopg://loraplex@127.0.0.1:5432/loraplex"
    redis_url: str = "redis://127.0.0.1:6379/0"
    storage_dir: Path = Path("var/storage")
    models_file: Path = Path("var/models.yaml")
    # Bearer token of the worker daemons for /internal/v1/*.
    worker_token: str = "dev-worker-token"
    # Bearer token for operator routes (GET /v1/cluster); the worker token when unset.
    admin_token: str | None = None
    max_upload_bytes: int = 100 * 1024 * 1024
    max_artifact_bytes: int = 4 * 1024 * 1024 * 1024
    max_configurations: int = 64
    max_page_size: int = 100
    # Operator-set price of one GPU-hour (in the operator's currency; 0: free): a task's and a
    # tenant's cost is its GPU-seconds (service.usage) / 3600 times this.
    price_per_gpu_hour: float = Field(default=2.0, ge=0, allow_inf_nan=False)
    # A node that has not heartbeated for this long while the service was healthy is marked
    # down (silence is counted from the service's own recovery: service.cluster.ServiceHealth).
    node_timeout_s: float = 60.0
    # A failed placement is retried (with the latest checkpoint) up to this many attempts.
    max_attempts: int = 3
    # Republish published-but-unclaimed placements from Postgres when the app starts.
    republish_on_startup: bool = True
    # Every this many seconds the API marks silent nodes down and re-publishes placements
    # missing from Redis (0 disables; safe with several API replicas). Each pass also checks the
    # database: an outage shorter than one interval can go unseen, so keep it well under
    # node_timeout_s / 3.
    maintenance_interval_s: float = 15.0
    # False: the API never calls the scheduler (placements come from elsewhere, e.g. tests).
    scheduler_enabled: bool = True
    # Knobs read by service.scheduler (CP-SAT; service/scheduler/planner.py says what they do).
    # Time unit of the plan; durations round up to it.
    scheduler_unit_s: int = 60
    # CP-SAT's deterministic work limit per replan (its own units; the same state gives the same
    # plan whatever the machine's load): 0.1 plans 200 tasks on 256 GPUs in ~1 s on 2 cores.
    scheduler_work_limit: float = 0.1
    # Wall-clock safety net of one solve (only reached when the machine is far slower).
    scheduler_time_limit_s: float = 10.0
    # Bounded waiting, counted from a task's arrival: a soft per-task bound whose penalty grows
    # past half of it and steeply past it. Never dropped for the whole plan.
    scheduler_max_wait_s: int = 4 * 3600
    # Weight of the fair-share term (worst tenant's mean slowdown) against weighted flow time.
    scheduler_fairness: float = DEFAULT_SCHEDULER_FAIRNESS
    # Weight of the longest planned flow time (arrival to end) as a fraction of the queue's total
    # weight: > 0 starts old long tasks sooner (p99) at some cost in mean completion; 0: off.
    scheduler_tail: float = 0.0
    # A task's own priority (0-10 in the API) may not exceed its tenant's ceiling
    # (tenants.max_task_priority, set by operators); this is the ceiling of tenants without one.
    scheduler_default_task_priority_ceiling: int = 10
    # "background": requests commit and signal the app's replanner thread (coalesced bursts,
    # plus a periodic pass every scheduler_interval_s); "sync": replan inside the request.
    scheduler_replan: Literal["background", "sync"] = "background"
    scheduler_interval_s: float = 5.0
    scheduler_debounce_s: float = 0.1
    log_level: str = "INFO"
    # API worker processes of `python -m service.api.serve` (uvicorn --workers); 0: one per CPU
    # available to the process, 2 to 8. One of them, the leader, runs the background loops.
    api_workers: int = 0
    # How often an API process that does not lead tries to take the leader lock (service.core.leader):
    # when the leader dies, another process runs the replanner and maintenance within this time.
    leader_retry_s: float = 5.0
    # Webhooks (service.webhooks). A URL whose host resolves to a loopback, private, link-local,
    # multicast or reserved address is refused (at create and at every delivery) unless this is
    # true: for a receiver on the operator's own network.
    webhook_allow_private: bool = False
    # Fernet key(s) (comma-separated, the first encrypts; `python -m service.webhooks.security`
    # prints a new one) that encrypt the endpoints' signing secrets at rest. Unset: secrets are
    # stored as they are (a warning at start-up); rows written either way stay readable.
    webhook_secret_key: str | None = None
    # One delivery attempt's HTTP timeout; an attempt is claimed for twice this plus a second, so
    # a process that dies mid-delivery has its attempts retried by another one after that.
    webhook_timeout_s: float = 5.0
    # Waits between the failed attempts of one delivery (the last repeats) and the time after
    # which it is given up (failed); a redelivery starts both over.
    webhook_backoff_s: list[float] = [5, 30, 120, 600, 3600, 10800, 21600]
    webhook_give_up_s: float = 24 * 3600
    # How often each API process looks for due deliveries (0: this process delivers none).
    webhook_poll_s: float = 1.0
    # Merged models (service.merged): the leader merges one at a time in a thread (it needs the
    # [train] extra and about the base model's size in memory). It looks for queued merges every
    # merge_poll_s (0: this service runs none); a merge whose process died is taken up again
    # once merge_lease_s passed without its heartbeat, at most merge_max_attempts times.
    merge_poll_s: float = 2.0
    merge_lease_s: float = 300.0
    merge_max_attempts: int = 3
    merge_max_shard_size: str = "5GB"
    # Samples on demand (service.sample_requests): node daemons claim them; a node that dies
    # leaves its request claimable again once sample_lease_s passed without a renewal, at most
    # sample_max_attempts times. A request of a model a node serves warm waits sample_warm_wait_s
    # for that node before any other node may take it.
    sample_lease_s: float = 120.0
    sample_max_attempts: int = 3
    sample_warm_wait_s: float = 10.0

    # Tracking integrations (service.tracking): after a task ends, the leader writes every job as
    # a run to the MLflow servers and W&B projects its `integrations` name, from the metrics in
    # PostgreSQL (never from the GPU nodes). An MLflow tracking URI whose host resolves to a
    # loopback, private, link-local or reserved address is refused (at create and at every sync,
    # the webhooks' rule) unless this is true: for an MLflow server on the operator's network.
    tracking_allow_private: bool = False
    # Where W&B runs are written, offline (one folder per task: <tenant>/<task>/wandb/offline-run-*;
    # `wandb sync` uploads them with the operator's W&B key). Needs the `wandb` package.
    wandb_dir: Path = Path("var/wandb")
    # One MLflow request's timeout; a sync is claimed for tracking_lease_s (a process that dies
    # mid-sync leaves it to be retried after that).
    tracking_timeout_s: float = 10.0
    tracking_lease_s: float = 900.0
    # Waits between failed syncs of one integration (the last repeats), and the time after the
    # task's end when it is given up (failed).
    tracking_backoff_s: list[float] = [10, 60, 300, 1800, 3600, 10800]
    tracking_give_up_s: float = 24 * 3600
    # How often the leader looks for due syncs (0: this service syncs none).
    tracking_poll_s: float = 5.0

    @field_validator("storage_dir", "models_file", "wandb_dir")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        # Relative defaults (var/...) mean the directory the service was started in, fixed at
        # load: a subprocess started elsewhere (the W&B writer runs in a scratch folder) or a
        # later chdir must not move them.
        return path.expanduser().resolve()

    @property
    def operator_token(self) -> str:
        return self.admin_token or self.worker_token


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (tests build their own Settings and pass them to create_app)."""
    return Settings()
