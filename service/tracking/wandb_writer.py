"""An ended task as W&B runs, written offline under the operator's LORAPLEX_WANDB_DIR: one run
per job (its id the job's, grouped by the task), config = the job's hyperparameters and the
task's settings, history = its train and validation curves by step, summary = its state, exit
reason, best validation loss and whether it is the task's best job.

The runs of one integration go to ``<wandb_dir>/<tenant>/<task>/<integration>/wandb/`` (what
`wandb sync` uploads, with the operator's key). They are written by a process of their own
(service.tracking.wandb_offline) into a fresh folder that replaces the previous one only once
complete, so a retry never leaves two copies of a run."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from contract.protocol import tenant_safe
from contract.states import JobState
from service.core.config import Settings
from service.tracking.records import TaskRecord

log = logging.getLogger("loraplex.tracking")
# The writer runs as a script that needs the standard library and wandb only, started with an
# empty folder as its path's head: nothing of this package or the API's working directory can
# shadow what wandb imports, and it needs no installed loraplex.
WRITER = Path(__file__).with_name("wandb_offline.py")
CHILD = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


class WandbUnavailable(Exception):
    """W&B runs cannot be written by this service at all (not retried)."""


class WandbError(Exception):
    """Writing the runs failed this time (retried)."""


def wandb_installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


def runs_payload(task: TaskRecord, config: dict) -> list[dict]:
    """One item per job for service.tracking.wandb_offline."""
    name = config.get("name") or task.suffix or task.id
    return [{"id": job.id, "project": config["project"], "entity": config.get("entity"),
             "name": f"{name}/job-{job.index}", "group": task.id,
             "tags": list(config.get("tags") or []), "config": task.params(job),
             "history": [{"step": s.step, "metrics": s.metrics} for s in job.steps],
             "summary": job.summary, "failed": job.state in (JobState.FAILED, JobState.CANCELLED)}
            for job in task.jobs]


def writer_reason(stderr: str) -> str:
    """The writer's last error line as a tenant may read it (no path, URL or address)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return f": {tenant_safe(lines[-1], 200)}" if lines else ""


def wandb_root(settings: Settings) -> Path:
    """LORAPLEX_WANDB_DIR as an absolute path: the writer runs in a scratch folder of its own, so
    a relative one would name another place there (Settings resolves it at load already; a copy
    made with model_copy skips that)."""
    return Path(settings.wandb_dir).expanduser().resolve()


def run_folder(settings: Settings, task: TaskRecord, integration_id: str) -> Path:
    return wandb_root(settings) / task.tenant_id / task.id / integration_id


def folder_error(exc: OSError) -> WandbError:
    """What a tenant may read of a filesystem failure under the W&B folder: what went wrong and
    whom to ask, never the server's paths (the operator's log has them)."""
    reason = exc.strerror or type(exc).__name__
    return WandbError(f"the W&B runs could not be written to the service's W&B folder "
                      f"(LORAPLEX_WANDB_DIR): {reason}; ask the operator to check that it exists "
                      "and is writable by the API")


def write_wandb(task: TaskRecord, config: dict, settings: Settings,
                integration_id: str) -> dict:
    """Write the task's runs for one W&B integration (WandbSettings' fields); returns what was
    written (each job's run id and the folder, relative to wandb_dir)."""
    if not wandb_installed():
        raise WandbUnavailable("the wandb package is not installed on this service; ask the "
                               "operator to install it (pip install wandb)")
    final = run_folder(settings, task, integration_id)
    runs = runs_payload(task, config)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        written = write_fresh(task, runs, final)
    except OSError as exc:
        log.warning("wandb folder failed task=%s integration=%s error=%s", task.id,
                    integration_id, exc)
        raise folder_error(exc) from exc
    return {"runs": {r["id"]: r["id"] for r in runs},
            "path": str(written.relative_to(wandb_root(settings)))}


def write_fresh(task: TaskRecord, runs: list[dict], final: Path) -> Path:
    """Write the runs into a fresh folder beside `final` and put it in `final`'s place."""
    fresh = final.parent / f".{final.name}.{uuid.uuid4().hex[:8]}"
    timeout = 60 + 5 * len(runs)
    try:
        with tempfile.TemporaryDirectory(prefix="loraplex-wandb-") as scratch:
            payload = json.dumps({"dir": str(fresh), "scratch": scratch, "runs": runs})
            try:
                done = subprocess.run([sys.executable, "-c", CHILD, str(WRITER)],
                                      input=payload, capture_output=True, text=True,
                                      timeout=timeout, cwd=scratch)
            except subprocess.TimeoutExpired as exc:
                raise WandbError(f"writing the W&B runs took over {timeout} s") from exc
        if done.returncode != 0:
            log.warning("wandb writer failed task=%s rc=%d stderr=%s", task.id, done.returncode,
                        done.stderr[-2000:])
            if done.returncode == 3:
                raise WandbUnavailable("the wandb package is not installed on this service; "
                                       "ask the operator to install it (pip install wandb)")
            raise WandbError(f"writing the W&B runs failed (exit status {done.returncode}"
                             f"{writer_reason(done.stderr)}); the operator's logs say more")
        if final.exists():
            shutil.rmtree(final)
        fresh.rename(final)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    return final
