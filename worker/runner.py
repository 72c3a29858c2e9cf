"""The executor subprocess entry: ``python -m worker.runner --placement-dir DIR`` reads the
PlacementSpec the daemon wrote, trains the task with trainer.executor and reports through the spool.

The daemon has already put the inputs in DIR (data/train.jsonl, data/validation.jsonl, resume/
with the latest checkpoint's files) and watches DIR/spool.jsonl; adapters and checkpoints are
written as folders under DIR/artifacts and announced by a spool record once complete. Imports
only torch/transformers/peft (through worker/) and contract.protocol: GPU nodes have no service
stack. SIGTERM asks the executor to checkpoint at the end of its step and stop (the checkpoint is
uploaded before the exit); a stale daemon lease (DIR/lease not touched for
LORAPLEX_LEASE_TIMEOUT_S) does the same, so an orphan stops reporting. A placement of g > 1 GPUs
runs the adapter-parallel executor (one process per GPU), g = 1 the one-GPU executor.

The daemon runs this for a placement that runs alone (g > 1, or co-location off); a placement
that shares an executor runs in worker.host, through the same per-placement parts below
(PlacementRun, open_task, settle): its spool, callbacks, resume input and terminal record.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from contract.protocol import ADAPTER_FILES, PlacementSpec, tenant_safe
from contract.states import JOB_FINISHED, JobState
from worker.checkpoint_links import link_checkpoint
from worker.spool import SPOOL_NAME, SpoolWriter

log = logging.getLogger("loraplex.worker.runner")
LEASE_NAME = "lease"
INIT_ADAPTER_ARCHIVE = "init_adapter.archive"  # in the placement's data/, fetched by the daemon


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

    def train_loss(self, job_id: str, step: int, loss: float,
                   usage: tuple[int, float] | None = None, **data: Any) -> None:
        """usage: (tokens, GPU-seconds) of the job's step (MetricPointIn.tokens, gpu_seconds)."""
        self.spool.metric(job_id, step, "train", float(loss), data or None, usage)

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


def unpack_adapter(archive: Path, dest: Path) -> Path:
    """The two PEFT files of an uploaded adapter archive (.tar.gz or .zip; at its top or under
    one folder, as the service checked at upload) written into dest, nothing else of it;
    ValueError for an archive without them (a retry would not help)."""
    import tarfile
    import zipfile

    found: dict[str, bytes] = {}

    def keep(name: str, read: Any) -> None:
        name = name.removeprefix("./").rstrip("/")
        base = name.rsplit("/", 1)[-1]
        if base in ADAPTER_FILES and name.count("/") <= 1:
            found[base] = read()

    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    if not info.is_dir():
                        keep(info.filename, lambda i=info: zf.read(i))
        else:
            with tarfile.open(archive, mode="r:*") as tf:
                for member in tf:
                    fh = tf.extractfile(member) if member.isfile() else None
                    if fh is not None:
                        keep(member.name, fh.read)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"init adapter archive unreadable: {exc}") from exc
    missing = [n for n in ADAPTER_FILES if n not in found]
    if missing:
        raise ValueError(f"init adapter archive lacks {', '.join(missing)}")
    dest.mkdir(parents=True, exist_ok=True)
    for name, blob in found.items():
        (dest / name).write_bytes(blob)
    return dest


def init_adapter_dir(directory: Path, spec: PlacementSpec) -> str | None:
    """The directory of the PEFT adapter the task's jobs start from (unpacked from the archive
    the daemon fetched, into the placement's folder), or None: fresh adapters."""
    if spec.init_adapter_file_id is None:
        return None
    archive = directory / "data" / INIT_ADAPTER_ARCHIVE  # fetched by the daemon
    if not archive.exists():
        raise FileNotFoundError(f"init adapter {spec.init_adapter_file_id} was not fetched")
    return str(unpack_adapter(archive, directory / "init_adapter"))


class _Bridge:
    """Maps trainer.executor's Callbacks onto spool records: keeps each job's best validation
    point, uploads a job's best adapter (else its final one) just before its terminal state,
    and announces a resumable checkpoint each time the executor has written a new state.pt
    (the last one too: an attempt that finished but whose report never reached the service,
    e.g. from a node declared down, lets its retry on this node resume with nothing left to do)."""

    def __init__(self, reporter: SpoolReporter, out: Path) -> None:
        self.reporter, self.out = reporter, out
        self.best: dict[str, tuple[float, int]] = {}
        self.last_step: dict[str, int] = {}
        self.adapters: dict[str, dict[str, Path]] = {}
        self.extra: dict[tuple[str, int, str], dict] = {}  # on_metrics numbers of the next point
        self.usage: dict[tuple[str, int], tuple[int, float]] = {}  # on_usage of the next point
        self.ckpt_seen = self._state_id()

    def _state_id(self) -> tuple[int, int] | None:
        """Which state.pt is there: the executor replaces it (a new inode) on every write, so
        (inode, mtime in ns) changes even when two writes share a coarse clock tick."""
        try:
            st = (self.out / "state.pt").stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    def on_metrics(self, job_id: str, step: int, split: str, data: dict) -> None:
        # JSON has no NaN/inf: a diverged number travels as null
        self.extra[(job_id, step, split)] = {
            k: (float(v) if math.isfinite(v) else None) for k, v in data.items()}

    def on_usage(self, job_id: str, step: int, tokens: int, gpu_seconds: float) -> None:
        self.usage[(job_id, step)] = (int(tokens), float(gpu_seconds))

    def on_train_loss(self, job_id: str, step: int, loss: float) -> None:
        self.last_step[job_id] = step
        self.reporter.train_loss(job_id, step, loss, self.usage.pop((job_id, step), None),
                                 **self.extra.pop((job_id, step, "train"), {}))
        self.announce_checkpoint()

    def announce_checkpoint(self) -> None:
        """Upload the checkpoint when the executor wrote a new state.pt (it does so atomically):
        state.pt and the job files it names, hard-linked into the artifact's folder. One whose
        files a newer checkpoint deleted meanwhile is skipped (the newer one is announced next)."""
        seen = self._state_id()
        if seen is not None and seen != self.ckpt_seen:
            self.ckpt_seen = seen
            step = max(self.last_step.values(), default=0)
            target = self.reporter.checkpoint_dir(step)
            try:
                link_checkpoint(self.out, target)
            except (OSError, RuntimeError) as exc:
                log.warning("checkpoint skipped dir=%s error=%s", self.out, exc)
                shutil.rmtree(target, ignore_errors=True)
                return
            self.reporter.checkpoint(step, target)

    def on_throughput(self, data: dict) -> None:
        self.reporter.spool.throughput(**data)

    def on_eval(self, job_id: str, step: int, loss: float) -> None:
        self.reporter.val_loss(job_id, step, loss, **self.extra.pop((job_id, step, "val"), {}))
        if math.isfinite(loss) and (job_id not in self.best or loss < self.best[job_id][0]):
            self.best[job_id] = (loss, step)

    def on_adapter(self, job_id: str, kind: str, path: Path) -> None:
        self.adapters.setdefault(job_id, {})[kind] = Path(path)

    def on_job_state(self, job_id: str, state: str, details: dict) -> None:
        best = self.best.get(job_id)
        if state in JOB_FINISHED:
            exported = self.adapters.get(job_id, {})
            src = exported.get("best") or exported.get("final")
            if src is not None and (src / "adapter_model.safetensors").exists():
                target = self.reporter.adapter_dir(job_id)
                for name in ("adapter_config.json", "adapter_model.safetensors"):
                    shutil.copyfile(src / name, target / name)
                self.reporter.adapter(job_id, target, meta={"step": best[1] if best else None,
                                                            "val_loss": best[0] if best else None})
        self.reporter.job_state(
            job_id, state, exit_reason=details.get("exit_reason") if state == JobState.EXITED else None,
            best_val_loss=best[0] if best else None, best_step=best[1] if best else None,
            last_step=self.last_step.get(job_id), error=details.get("error"))

    def on_event(self, job_id: str, message: str, fields: dict) -> None:
        if message == "timings":  # the executor's phase split: its own report (ExecutorTimings)
            self.reporter.spool.report("timings", timings_report(fields))
            return
        if message == "samples":  # the task's closing completions: their own report (TaskSamples)
            self.reporter.spool.report("samples", {"samples": fields["samples"]})
            return
        self.reporter.event(message[:48], message, job_id or None, data=fields or None)


def timings_report(timings: dict) -> dict:
    """ExecutorTimings' fields (but placement_id) from the executor's timings(): wall_s and
    first_step_s, every other number named <phase>_s a phase, the rest details."""
    def number(v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    phases = {k[:-2]: float(v) for k, v in timings.items()
              if k.endswith("_s") and k not in ("wall_s", "first_step_s") and number(v)}
    details = {k: v for k, v in timings.items() if k not in ("wall_s", "first_step_s")
               and not (k.endswith("_s") and k[:-2] in phases)
               and (v is None or isinstance(v, (bool, str)) or number(v))}
    first = timings.get("first_step_s")
    return {"wall_s": float(timings.get("wall_s") or 0.0),
            "first_step_s": float(first) if number(first) else None,
            "phases": phases, "details": details}


def executor_config(spec: PlacementSpec, directory: Path):  # noqa: ANN201 - trainer import is lazy
    """The trainer's configuration of this placement: the task's settings as the contract has
    them (contract.protocol), the daemon's files, and one rank per GPU of the placement."""
    from trainer.config import ExecutorConfig
    from trainer.jobs import TrainJob

    paths = inputs(directory, spec)
    start = init_adapter_dir(directory, spec)
    cfg = spec.settings
    jobs = [replace(TrainJob.from_hyperparameters(j.job_id, j.hyperparameters, epochs=cfg.epochs,
                                                   seed=cfg.seed + j.index), init_adapter=start)
            for j in spec.jobs]
    return ExecutorConfig(
        model_dir=spec.base_model_path, train_file=str(paths["train"]),
        output_dir=str(directory / "executor"), jobs=jobs, method=spec.method,
        val_file=str(paths["validation"]) if paths["validation"] else None,
        settings=cfg,
        # the work a lost node costs is bounded by the time between checkpoints (each one is
        # uploaded as soon as it is written): every S seconds, or N steps where an operator names
        # N (0, the default: no step count; a step count is no bound in seconds, and a checkpoint
        # holds every trained job's adapter and AdamW moments: 2-5 GB for an 8B search's jobs)
        checkpoint_every=int(os.environ.get("LORAPLEX_CHECKPOINT_EVERY", "0")) or None,
        checkpoint_every_s=float(os.environ.get("LORAPLEX_CHECKPOINT_EVERY_S", "300")) or None,
        world_size=max(1, len(spec.gpu_indices)),
        # memory models measured on this node (work_dir/placements/<id> -> work_dir): one
        # profiling run per model, sequence length and GPU kind, reused by later placements
        profile_cache=os.environ.get("LORAPLEX_PROFILE_CACHE")
        or str(directory.parent.parent / "memory_profiles.json"))


def open_task(spec: PlacementSpec, directory: Path, reporter: SpoolReporter,
              on_task_end: Any = None) -> tuple[Any, Any, _Bridge]:
    """The placement's task as an executor takes it: (ExecutorConfig, Callbacks writing its
    spool, the bridge that keeps its best points), its output folder seeded with the resume
    checkpoint. on_task_end: the Callbacks' (a shared executor's end of this task)."""
    from trainer.config import Callbacks

    cfg = executor_config(spec, directory)
    out = Path(cfg.output_dir)
    out.mkdir(exist_ok=True)
    resume = inputs(directory, spec)["resume"]
    if resume is not None and (resume / "state.pt").exists():
        link_checkpoint(resume, out)  # state.pt and its job files, whole (else the start fails)
    bridge = _Bridge(reporter, out)
    callbacks = Callbacks(on_train_loss=bridge.on_train_loss, on_eval=bridge.on_eval,
                          on_job_state=bridge.on_job_state, on_adapter=bridge.on_adapter,
                          on_event=bridge.on_event, on_metrics=bridge.on_metrics,
                          on_throughput=bridge.on_throughput, on_usage=bridge.on_usage)
    if on_task_end is not None:
        callbacks.on_task_end = on_task_end
    return cfg, callbacks, bridge


def settle(bridge: _Bridge, status: dict, stopped: bool) -> dict:
    """What a task that left its executor hands over: {"stopped": True} (it checkpointed at a
    step boundary), else {"best_job_id", "summary"}. Either way its last checkpoint is announced
    first (finished: a small one, no job left in it, which says that nothing is left)."""
    bridge.announce_checkpoint()
    if stopped:
        return {"stopped": True}
    finished = {j: b for j, b in bridge.best.items()
                if status.get(j, {}).get("state") in JOB_FINISHED}
    best = min(finished, key=lambda j: finished[j][0]) if finished else None
    return {"best_job_id": best if best in bridge.adapters else None,
            "summary": {"jobs": {j: s.get("state") for j, s in status.items()}}}


def train(spec: PlacementSpec, directory: Path, reporter: SpoolReporter,
          should_stop: StopFlag) -> dict:
    """Run the task (one GPU, or adapter-parallel over the placement's GPUs); returns
    {"best_job_id", "summary", "stopped"}."""
    from trainer.launch import run_executor

    cfg, callbacks, bridge = open_task(spec, directory, reporter)
    status = run_executor(cfg, callbacks, should_stop)
    return settle(bridge, status, should_stop.event.is_set())


class PlacementRun:
    """A placement inside an executor process: its spec, spool, reporter, stop flag (SIGTERM, a
    stale lease) and its terminal record. worker.runner runs one alone; worker.host runs several
    on one shared executor, each reporting through its own folder the same way."""

    def __init__(self, directory: Path, lease_timeout_s: float) -> None:
        self.directory = directory.resolve()
        self.spec = PlacementSpec.model_validate_json((self.directory / "spec.json").read_text())
        self.spool = SpoolWriter(self.directory / SPOOL_NAME)
        self.stop = StopFlag(self.directory, lease_timeout_s)
        self.reporter = SpoolReporter(self.spool, self.directory)

    def finished(self, result: dict) -> None:
        self.spool.finished(best_job_id=result.get("best_job_id"), summary=result.get("summary"))
        log.info("executor finished task=%s placement=%s best_job=%s", self.spec.task_id,
                 self.spec.placement_id, result.get("best_job_id"))

    def failed(self, exc: BaseException) -> None:
        # Bad input (a data file no record of which tokenizes, an unknown model) will fail
        # again on retry; anything else (OOM, a lost device) is worth another attempt.
        retryable = not isinstance(exc, (ValueError, FileNotFoundError))
        self.spool.failed(tenant_safe(f"{type(exc).__name__}: {exc}"), retryable=retryable,
                          detail="".join(traceback.format_exception(exc)))

    def stopped(self, reason: str) -> None:
        self.spool.event("executor_stopped", f"stopped: {reason}")
        self.spool.failed(f"executor stopped: {reason}", retryable=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.runner", description=__doc__)
    ap.add_argument("--placement-dir", type=Path, required=True)
    ap.add_argument("--lease-timeout-s", type=float,
                    default=float(os.environ.get("LORAPLEX_LEASE_TIMEOUT_S", "120")))
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("LORAPLEX_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    run = PlacementRun(args.placement_dir, args.lease_timeout_s)
    spec, stop = run.spec, run.stop
    signal.signal(signal.SIGTERM, lambda s, f: stop.set("SIGTERM"))
    log.info("executor starting task=%s placement=%s attempt=%d jobs=%d resume=%s",
             spec.task_id, spec.placement_id, spec.attempt, len(spec.jobs),
             spec.resume_checkpoint_artifact_id)
    try:
        try:
            result = train(spec, run.directory, run.reporter, stop)
        except Exception as exc:  # reported, then a non-zero exit
            log.exception("executor failed task=%s placement=%s", spec.task_id,
                          spec.placement_id)
            run.failed(exc)
            return 1
        if stop.event.is_set() or result.get("stopped"):
            run.stopped(stop.reason or "requested")
        else:
            run.finished(result)
        return 0
    finally:
        run.spool.close()


if __name__ == "__main__":
    sys.exit(main())
