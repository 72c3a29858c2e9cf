"""The executor subprocess entry: ``python -m worker.runner --placement-dir DIR`` reads the
PlacementSpec the daemon wrote, trains the task with worker.executor and reports through the spool.

The daemon has already put the inputs in DIR (data/train.jsonl, data/validation.jsonl, resume/
with the latest checkpoint's files) and watches DIR/spool.jsonl; adapters and checkpoints are
written as folders under DIR/artifacts and announced by a spool record once complete. Imports
only torch/transformers/peft (through worker/) and service.protocol: GPU nodes have no service
stack. SIGTERM asks the executor to checkpoint and stop; a stale daemon lease (DIR/lease not
touched for LORAPLEX_LEASE_TIMEOUT_S) does the same, so an orphan stops reporting.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from service.protocol import PlacementSpec
from worker.service_client import SPOOL_NAME, SpoolWriter

log = logging.getLogger("loraplex.worker.runner")
LEASE_NAME = "lease"
JOB_LIVE = ("pending", "running")


class StopFlag:
    """Set by SIGTERM or by a stale lease; the executor polls it between steps."""

    def __init__(self, directory: Path, lease_timeout_s: float) -> None:
        self.event = threading.Event()
        self.reason = ""
        self.directory, self.lease_timeout_s = directory, lease_timeout_s

    def set(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            self.event.set()

    def __call__(self) -> bool:
        if not self.event.is_set() and self.lease_timeout_s > 0:
            try:
                age = time.time() - (self.directory / LEASE_NAME).stat().st_mtime
            except FileNotFoundError:
                age = 0.0  # started by hand, without a daemon: no lease to keep
            if age > self.lease_timeout_s:
                self.set(f"daemon lease stale for {age:.0f}s")
        return self.event.is_set()


class SpoolReporter:
    """The executor's callbacks, each appending one spool record (the daemon forwards them)."""

    def __init__(self, spool: SpoolWriter, directory: Path) -> None:
        self.spool, self.directory = spool, directory
        self.artifacts = directory / "artifacts"
        self.artifacts.mkdir(exist_ok=True)

    def train_loss(self, job_id: str, step: int, loss: float, **data: Any) -> None:
        self.spool.metric(job_id, step, "train", float(loss), data or None)

    def val_loss(self, job_id: str, step: int, loss: float, **data: Any) -> None:
        self.spool.metric(job_id, step, "val", float(loss), data or None)

    def job_state(self, job_id: str, state: str, exit_reason: str | None = None,
                  best_val_loss: float | None = None, best_step: int | None = None,
                  last_step: int | None = None, error: str | None = None) -> None:
        update = {"state": state, "exit_reason": exit_reason, "best_val_loss": best_val_loss,
                  "best_step": best_step, "last_step": last_step, "error": error}
        self.spool.job_state(job_id, **{k: v for k, v in update.items() if v is not None})

    def event(self, type_: str, message: str = "", job_id: str | None = None,
              level: str = "info", data: dict | None = None) -> None:
        self.spool.event(type_, message, job_id, level, data)

    def adapter_dir(self, job_id: str) -> Path:
        """A fresh folder the executor exports a job's adapter into (then calls adapter())."""
        return self._fresh(f"adapter-{job_id}")

    def adapter(self, job_id: str, directory: Path, meta: dict | None = None) -> None:
        self.spool.artifact(self._rel(directory), kind="adapter", job_id=job_id, meta=meta)

    def checkpoint_dir(self, step: int) -> Path:
        return self._fresh(f"checkpoint-{step}")

    def checkpoint(self, step: int, directory: Path, meta: dict | None = None) -> None:
        self.spool.artifact(self._rel(directory), kind="checkpoint", step=step, meta=meta)

    def _fresh(self, name: str) -> Path:
        path = self.artifacts / f"{name}-{time.time_ns()}"
        path.mkdir(parents=True)
        return path

    def _rel(self, directory: Path) -> str:
        return str(Path(directory).resolve().relative_to(self.directory.resolve()))


def inputs(directory: Path, spec: PlacementSpec) -> dict[str, Path | None]:
    """The files the daemon fetched for this placement."""
    val = directory / "data" / "validation.jsonl"
    resume = directory / "resume"
    return {"train": directory / "data" / "train.jsonl",
            "validation": val if spec.validation_file_id and val.exists() else None,
            "resume": resume if spec.resume_checkpoint_files and resume.is_dir() else None}


def train(spec: PlacementSpec, directory: Path, reporter: SpoolReporter,
          should_stop: StopFlag) -> dict:
    """Run the task with the training executor; returns {"best_job_id", "summary", "stopped"}."""
    from worker import executor  # heavy: torch + transformers

    return executor.run_placement(spec, inputs(directory, spec), reporter, should_stop)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.runner", description=__doc__)
    ap.add_argument("--placement-dir", type=Path, required=True)
    ap.add_argument("--lease-timeout-s", type=float,
                    default=float(os.environ.get("LORAPLEX_LEASE_TIMEOUT_S", "120")))
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("LORAPLEX_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    directory = args.placement_dir.resolve()
    spec = PlacementSpec.model_validate_json((directory / "spec.json").read_text())
    spool = SpoolWriter(directory / SPOOL_NAME)
    stop = StopFlag(directory, args.lease_timeout_s)
    signal.signal(signal.SIGTERM, lambda s, f: stop.set("SIGTERM"))
    reporter = SpoolReporter(spool, directory)
    log.info("executor starting task=%s placement=%s attempt=%d jobs=%d resume=%s",
             spec.task_id, spec.placement_id, spec.attempt, len(spec.jobs),
             spec.resume_checkpoint_artifact_id)
    try:
        result = train(spec, directory, reporter, stop)
    except Exception as exc:  # reported, then a non-zero exit
        log.exception("executor failed task=%s placement=%s", spec.task_id, spec.placement_id)
        # Bad input (a data file no record of which tokenizes, an unknown model) will fail
        # again on retry; anything else (OOM, a lost device) is worth another attempt.
        retryable = not isinstance(exc, (ValueError, FileNotFoundError))
        spool.failed(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-4000:]}",
                     retryable=retryable)
        spool.close()
        return 1
    if stop.event.is_set() or result.get("stopped"):
        spool.event("executor_stopped", f"stopped: {stop.reason or 'requested'}")
        spool.failed(f"executor stopped: {stop.reason or 'requested'}", retryable=True)
        spool.close()
        return 0
    spool.finished(best_job_id=result.get("best_job_id"), summary=result.get("summary"))
    spool.close()
    log.info("executor finished task=%s placement=%s best_job=%s", spec.task_id,
             spec.placement_id, result.get("best_job_id"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
