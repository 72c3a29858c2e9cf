"""Local resume: a new attempt of a task on a node that holds a newer checkpoint of an earlier
attempt (in that attempt's folder) resumes from it instead of the service's older one."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from contract.protocol import PlacementSpec
from worker.checkpoint_links import checkpoint_step as complete_step
from worker.checkpoint_links import link_checkpoint, link_file
from worker.local_state import LocalPlacement
from worker.spool import SPOOL_NAME, read_complete_lines

log = logging.getLogger("loraplex.worker.daemon")
LOCAL_RESUME_NAME = "local_resume.json"  # written last: this placement's seeding is done
OFFERED_NAME = "resume-offered"  # where the service's checkpoint goes when a local one wins


@dataclass
class LocalCheckpoint:
    """A checkpoint that an earlier attempt of the task announced in its spool on this node."""

    directory: Path  # that attempt's placement folder
    record_end: int  # its spool's offset just past the checkpoint's record
    record: dict  # {"type": "artifact", "dir": <state.pt and its job files>, "meta": {...}}
    global_step: int
    offered_step: int = -1  # global_step of the checkpoint the service offered; -1: none

    @property
    def state_file(self) -> Path:
        return self.directory / self.record["dir"] / "state.pt"


def checkpoint_step(path: Path) -> int | None:
    """The executor's global_step in a state.pt, memory-mapped (the tensors are not read);
    None when it cannot be used (torch missing, a foreign or damaged file, a job file it names
    missing or cut beside it)."""
    try:
        return complete_step(path)
    except ImportError:
        return None
    except Exception:  # noqa: BLE001 - unreadable is unusable, whatever the reason
        log.warning("checkpoint unusable path=%s", path, exc_info=True)
        return None


def newest_local_checkpoint(placements_dir: Path, own_dir: Path,
                            task_id: str) -> LocalCheckpoint | None:
    """Of the earlier attempts of task_id on this node, the last complete checkpoint with the
    highest global_step (an attempt's last complete checkpoint is its newest; one with a job
    file missing falls back to the one before)."""
    best: LocalCheckpoint | None = None
    for directory in sorted(placements_dir.iterdir()):
        if directory == own_dir or _spec_task(directory) != task_id:
            continue
        for end, record in reversed(list(_checkpoint_records(directory))):
            step = checkpoint_step(directory / record["dir"] / "state.pt")
            if step is None:
                continue
            if best is None or step > best.global_step:
                best = LocalCheckpoint(directory, end, record, step)
            break
    return best


def seed_local_resume(placements_dir: Path, directory: Path,
                      spec: PlacementSpec) -> LocalCheckpoint | None:
    """Before a placement's executor starts: when an earlier attempt of its task on this node
    announced a checkpoint with a higher global_step than the one the service offers (fetched
    to DIR/resume), resume from that one, so a retry on the same node loses at most the local
    checkpoint interval, not everything since the service last heard from the node.

    The earlier attempt's reports up to that checkpoint may never have reached the service (it
    was cut off, then stopped), while the checkpoint holds their outcome (jobs that ended, their
    adapters). So this attempt replays them first, as its own: its spool starts with the earlier
    spool's loss points, job states and adapters up to the checkpoint, then the checkpoint
    itself, all idempotent at the service (points dedupe on (job, step, split); a job's adapter
    and a checkpoint's step are keys; a repeated job state is a no-op); events are not replayed.
    Then DIR/executor/state.pt is that checkpoint (its job files linked beside it) and DIR/resume moves to DIR/resume-offered, so
    the runner does not copy the older one over it.

    Steps compare by the global_step in both state.pt files (checkpoint_step): an offered one
    that cannot be read is kept. Done once (marker file); a failure part-way leaves a placement
    that resumes from the offered checkpoint. Returns the checkpoint seeded, else None."""
    spool = directory / SPOOL_NAME
    if (directory / LOCAL_RESUME_NAME).exists() or (spool.exists() and spool.stat().st_size):
        return None
    offered_step = -1
    for offered in (directory / "resume" / "state.pt", directory / OFFERED_NAME / "state.pt"):
        if offered.is_file():
            step = checkpoint_step(offered)
            if step is None:
                return None
            offered_step = step
            break
    best = newest_local_checkpoint(placements_dir, directory, spec.task_id)
    if best is None or best.global_step <= offered_step:
        return None
    best.offered_step = offered_step
    lines = [_local_resume_event(best, spec.attempt)]
    for end, record, text in _spool_records(best.directory, best.record_end):
        kind = record.get("type")
        meta = record.get("meta") or {}
        if kind == "artifact" and (end == best.record_end or meta.get("kind") == "adapter"):
            _link_tree(best.directory / record["dir"], directory / record["dir"])
        elif kind not in ("metric", "job_state"):
            continue
        lines.append(text)
    tmp = spool.with_name(spool.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, spool)
    link_checkpoint(best.state_file.parent, directory / "executor")
    if (directory / "resume").is_dir():
        shutil.rmtree(directory / OFFERED_NAME, ignore_errors=True)
        os.replace(directory / "resume", directory / OFFERED_NAME)
    (directory / LOCAL_RESUME_NAME).write_text(json.dumps({
        "from_placement_id": best.directory.name, "global_step": best.global_step,
        "offered_global_step": offered_step, "replayed_records": len(lines) - 1}))
    return best



def seed_before_start(p: LocalPlacement, placements_dir: Path, node_id: str | None) -> None:
    """seed_local_resume for placement p, about to start, logged."""
    try:
        spec = PlacementSpec.model_validate_json((p.directory / "spec.json").read_text())
        seeded = seed_local_resume(placements_dir, p.directory, spec)
    except Exception:  # never keep a placement from starting: it resumes as offered
        log.exception("local resume failed node=%s task=%s placement=%s", node_id,
                      p.task_id, p.placement_id)
        seeded = None
    if seeded is not None:
        log.info("local resume node=%s task=%s placement=%s from=%s global_step=%d "
                 "offered_global_step=%d", node_id, p.task_id, p.placement_id,
                 seeded.directory.name, seeded.global_step, seeded.offered_step)

def _spec_task(directory: Path) -> str | None:
    try:
        return json.loads((directory / "spec.json").read_text()).get("task_id")
    except (OSError, ValueError, AttributeError):
        return None


def _spool_records(directory: Path, stop: int | None = None) -> Iterator[tuple[int, dict, str]]:
    """(end offset, record, line) of each complete, parsable spool line, up to offset stop."""
    offset = 0
    while lines := read_complete_lines(directory / SPOOL_NAME, offset, 10_000):
        for _, end, text in lines:
            if stop is not None and end > stop:
                return
            try:
                record = json.loads(text)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield end, record, text
        offset = lines[-1][1]


def _checkpoint_records(directory: Path) -> Iterator[tuple[int, dict]]:
    """(end offset, record) of each checkpoint announced in a spool whose copy is still there."""
    for end, record, _ in _spool_records(directory):
        if (record.get("type") == "artifact" and (record.get("meta") or {}).get("kind")
                == "checkpoint" and isinstance(record.get("dir"), str)
                and (directory / record["dir"] / "state.pt").is_file()):
            yield end, record


def _local_resume_event(best: LocalCheckpoint, attempt: int) -> str:
    offered = best.offered_step if best.offered_step >= 0 else None
    return json.dumps({"type": "event", "event": {
        "type": "local_resume", "level": "info", "job_id": None,
        "message": f"attempt {attempt} resumes from this node's checkpoint of an earlier attempt "
                   f"at step {best.global_step} (the service's latest: "
                   f"{'none' if offered is None else f'step {offered}'})",
        "data": {"from_placement_id": best.directory.name, "global_step": best.global_step,
                 "offered_global_step": offered}}}, separators=(",", ":"))


def _link_tree(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.startswith("."):
            link_file(path, dst / path.name)

