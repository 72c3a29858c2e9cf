"""The lifecycle of a merged model, in one place: requested (queued, or a failed one queued
again), claimed by the merger (running, under a lease it renews), then succeeded or failed.
One row per job: a second request for the same adapter answers the existing merge."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from service import adapters, outbox
from service.artifact_keys import blob_key
from service.core.config import Settings
from service.core.db import after_commit
from service.core.errors import ApiError, conflict, not_found
from service.core.registry import ModelRegistry
from service.lifecycle import move
from service.merged.states import MERGE_TRANSITIONS, MergeState
from service.models import Artifact, Job, MergedModel, Task, Tenant, new_id, utcnow
from service.schemas import MergedModelOut


def _move(merged: MergedModel, target: MergeState) -> None:
    move("merged model", merged, MERGE_TRANSITIONS, target, MergeState.QUEUED)


# Set when this process committed a merge request: its merger looks at once, not at its next poll.
requested = threading.Event()


def archive_key(merged_id: str) -> str:
    return f"merged/{merged_id}/model.tar"


def _job(session: Session, task: Task, job_id: str | None) -> Job:
    """The job named (one of the task's) or, without one, the task's best job (409 until the
    task succeeded)."""
    if job_id is None:
        return adapters.task_adapter(session, task)[0]
    job = session.scalar(select(Job).where(Job.id == job_id, Job.task_id == task.id))
    if job is None:
        raise not_found("job", job_id, "job_id")
    return job


def request_merge(session: Session, task: Task, job_id: str | None,
                  registry: ModelRegistry) -> tuple[MergedModel, bool]:
    """Queue the merge of a job's adapter (the best job's by default) unless it exists; a failed
    one is queued again. Returns the row and whether it was (re)queued. Flushes; the caller
    commits."""
    job = _job(session, task, job_id)
    artifact = adapters.job_adapter(session, job)
    if registry.get(task.base_model) is None:
        raise conflict(f"base model {task.base_model!r} is no longer registered",
                       code="base_model_unavailable")
    inserted = session.execute(insert(MergedModel).values(
        id=new_id("mrg"), tenant_id=task.tenant_id, task_id=task.id,
        job_id=job.id, artifact_id=artifact.id, state=MergeState.QUEUED.value, attempts=0, created_at=utcnow(),
    ).on_conflict_do_nothing(index_elements=["job_id"]).returning(MergedModel.id)).first() \
        is not None
    merged = session.scalar(select(MergedModel).where(MergedModel.job_id == job.id)
                            .with_for_update().execution_options(populate_existing=True))
    assert merged is not None
    queued = inserted
    if merged.state == MergeState.FAILED or merged.artifact_id != artifact.id:  # ask again: try again
        _move(merged, MergeState.QUEUED)
        merged.error, merged.attempts = None, 0
        merged.artifact_id, merged.lease_token, merged.lease_until = artifact.id, None, None
        merged.started_at = merged.finished_at = merged.dtype = merged.bytes = None
        merged.storage_key = None
        queued = True
    session.flush()
    if queued:
        after_commit(session, requested.set)
    return merged, queued


def get_merge(session: Session, tenant: Tenant, task: Task, job_id: str | None) -> MergedModel:
    """The merge of the job named, or of the task's best job; 404 when none was requested."""
    if job_id is None and task.best_job_id is None:
        raise not_found("merged model of task", task.id)
    merged = session.scalar(select(MergedModel).where(
        MergedModel.tenant_id == tenant.id, MergedModel.task_id == task.id,
        MergedModel.job_id == (job_id or task.best_job_id)))
    if merged is None:
        raise ApiError(404, "merged_model_not_found", "no merged model was requested for job "
                       f"{job_id or task.best_job_id!r}; POST to request one",
                       "job_id" if job_id else None)
    return merged


def ready(merged: MergedModel) -> MergedModel:
    """The merge, if its archive can be downloaded; 409 naming its state otherwise."""
    if merged.state != MergeState.SUCCEEDED or merged.storage_key is None:
        detail = f": {merged.error}" if merged.error else "; poll its state until succeeded"
        raise conflict(f"merged model {merged.id!r} is {merged.state}{detail}",
                       code=f"merge_{merged.state}")
    return merged


def merged_out(merged: MergedModel, base_model: str) -> MergedModelOut:
    return MergedModelOut(
        id=merged.id, task_id=merged.task_id, job_id=merged.job_id, base_model=base_model,
        state=merged.state, error=merged.error, dtype=merged.dtype, bytes=merged.bytes,
        created_at=merged.created_at, started_at=merged.started_at,
        finished_at=merged.finished_at)


# The merger's side (service.merged.runner): each function commits.

@dataclass(frozen=True)
class Claim:
    merged_id: str
    task_id: str
    job_id: str
    token: str
    base_model: str
    artifact_id: str
    files: list[tuple[str, str]]  # the adapter's (name, storage key: artifact_keys.blob_key)


def claim_next(session: Session, settings: Settings) -> Claim | None:
    """Claim the oldest queued merge, or a running one whose lease ran out (its process died),
    under a fresh lease; one interrupted merge_max_attempts times fails instead."""
    while True:
        now = utcnow()
        rows = outbox.lock_due(session, select(MergedModel).where(outbox.lapsed(
            MergedModel, MergeState.QUEUED, MergeState.RUNNING, now))
            .order_by(MergedModel.created_at).limit(1))
        if not rows:
            session.rollback()
            return None
        merged = rows[0]
        if outbox.exhausted(merged, settings.merge_max_attempts):
            _move(merged, MergeState.FAILED)
            merged.finished_at, merged.lease_token = now, None
            merged.error = (f"the merge was interrupted {merged.attempts} times; request it "
                            "again")
            session.commit()
            continue
        task = session.get(Task, merged.task_id)
        artifact = session.get(Artifact, merged.artifact_id)
        assert task is not None and artifact is not None  # both cascade to this row
        _move(merged, MergeState.RUNNING)
        token = outbox.take(merged, settings.merge_lease_s, now)
        merged.started_at = now
        claim = Claim(merged.id, merged.task_id, merged.job_id, token, task.base_model,
                      artifact.id, [(f["name"], blob_key(artifact, f)) for f in artifact.files])
        session.commit()
        return claim


def renew(session: Session, claim: Claim, settings: Settings) -> bool:
    """Extend the claim's lease; False when the merge is no longer this claim's. Commits."""
    return outbox.renew(session, MergedModel.lease_until, claim.merged_id, claim.token,
                        settings.merge_lease_s)


def _end(session: Session, claim: Claim, state: MergeState, **values: object) -> bool:
    merged = outbox.mine(session, MergedModel, claim.merged_id, claim.token)
    if merged is not None:
        _move(merged, state)
        merged.finished_at = utcnow()
        merged.lease_token = merged.lease_until = None
        for name, value in values.items():
            setattr(merged, name, value)
    session.commit()
    return merged is not None


def succeed(session: Session, claim: Claim, key: str, size: int, dtype: str) -> bool:
    return _end(session, claim, MergeState.SUCCEEDED, storage_key=key, bytes=size, dtype=dtype,
                error=None)


def fail(session: Session, claim: Claim, message: str) -> bool:
    return _end(session, claim, MergeState.FAILED, error=message)
