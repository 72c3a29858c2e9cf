"""The lifecycle of a sample request, in one place: asked for (queued; checked whole first, so a
4xx stores nothing), claimed by a node daemon (running, under a lease it renews), then succeeded
(its completions kept in the row) or failed. A request whose node died is claimed again once its
lease ends; one interrupted sample_max_attempts times fails with a message saying so."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.protocol import tenant_safe
from contract.sample_requests import SampleAdapter, SampleRequestSettings, SampleResult, SampleWork
from contract.states import NodeState, TaskState
from service import outbox
from service.core.config import Settings
from service.core.errors import ApiError, conflict, invalid, not_found
from service.core.registry import ModelRegistry
from service.lifecycle import move
from service.models import Artifact, Job, Node, SampleRequest, Task, Tenant, new_id, utcnow
from service.sample_requests.states import SAMPLE_REQUEST_TRANSITIONS, SampleRequestState

DEFAULT_TOP_K = 3
S = SampleRequestState


def _move(row: SampleRequest, target: SampleRequestState) -> None:
    move("sample request", row, SAMPLE_REQUEST_TRANSITIONS, target, S.QUEUED)


def _adapter(session: Session, job_id: str) -> Artifact | None:
    return session.scalar(select(Artifact).where(Artifact.job_id == job_id,
                                                 Artifact.kind == "adapter"))


def _chosen_jobs(session: Session, task: Task, body: SampleRequestSettings) -> list[str]:
    """The jobs whose adapters answer: those named (each the task's, each with an adapter; a 422
    naming job_ids otherwise), or the top k by best validation loss among those with one."""
    if body.job_ids is not None:
        if body.top_k is not None:
            raise invalid("give job_ids or top_k, not both", "top_k")
        if len(set(body.job_ids)) != len(body.job_ids):
            raise invalid("job_ids: name each job once", "job_ids")
        for job_id in body.job_ids:
            job = session.scalar(select(Job).where(Job.id == job_id, Job.task_id == task.id))
            if job is None:
                raise invalid(f"job {job_id!r} is not a job of task {task.id!r}", "job_ids",
                              code="job_not_found")
            if _adapter(session, job_id) is None:
                raise invalid(f"job {job_id!r} has no adapter (it ended {job.state} without a "
                              "best or final adapter)", "job_ids", code="job_without_adapter")
        return list(body.job_ids)
    k = DEFAULT_TOP_K if body.top_k is None else body.top_k
    ranked = session.scalars(
        select(Job.id).join(Artifact, (Artifact.job_id == Job.id) & (Artifact.kind == "adapter"))
        .where(Job.task_id == task.id)
        .order_by(Job.best_val_loss.asc().nulls_last(), Job.index)).all()
    return list(dict.fromkeys(ranked))[:k]


def request_samples(session: Session, task: Task, body: SampleRequestSettings,
                    registry: ModelRegistry) -> SampleRequest:
    """Queue the request once every part of it is good; a 422 naming the field (or a 409: the
    base model is gone) stores nothing. Flushes; the caller commits."""
    if task.state != TaskState.SUCCEEDED:
        raise invalid(f"task {task.id!r} is {task.state}; samples on demand need a task that "
                      f"{TaskState.SUCCEEDED}", "task_id", code="task_not_succeeded")
    job_ids = _chosen_jobs(session, task, body)
    if not job_ids and not body.include_base:
        raise invalid("nothing would answer: no job has an adapter to choose and include_base "
                      "is false", "include_base" if body.job_ids is None else "job_ids")
    if registry.get(task.base_model) is None:
        raise conflict(f"base model {task.base_model!r} is no longer registered",
                       code="base_model_unavailable")
    row = SampleRequest(id=new_id("smpl"), tenant_id=task.tenant_id, task_id=task.id,
                        state=S.QUEUED.value, settings=body.model_dump(mode="json"),
                        job_ids=job_ids, attempts=0, created_at=utcnow())
    session.add(row)
    session.flush()
    return row


def get_request(session: Session, tenant: Tenant, task: Task, request_id: str) -> SampleRequest:
    row = session.scalar(select(SampleRequest).where(
        SampleRequest.id == request_id, SampleRequest.tenant_id == tenant.id,
        SampleRequest.task_id == task.id))
    if row is None:
        raise not_found("sample request", request_id, "request_id")
    return row


def list_requests(session: Session, tenant: Tenant, task: Task) -> list[SampleRequest]:
    return list(session.scalars(select(SampleRequest).where(
        SampleRequest.tenant_id == tenant.id, SampleRequest.task_id == task.id)
        .order_by(SampleRequest.created_at.desc(), SampleRequest.id).limit(100)))


# The node daemons' side (service.api.routes.sample_requests): each function commits.

def _warm_elsewhere(session: Session, node_id: str, settings: Settings) -> set[str]:
    """The base models a warm shared executor serves on an up node other than node_id."""
    fresh = utcnow() - timedelta(seconds=settings.node_timeout_s)
    models: set[str] = set()
    for executors in session.scalars(select(Node.executors).where(
            Node.id != node_id, Node.state == NodeState.UP, Node.executors_at >= fresh)):
        models.update(str(e.get("key", "")).split("|", 1)[0] for e in executors or ()
                      if isinstance(e, dict) and not e.get("placement_ids"))
    return models


def _work(session: Session, row: SampleRequest, task: Task, registry: ModelRegistry,
          settings: Settings) -> SampleWork | str:
    """The claim's message, or why the request cannot run anywhere (it fails with that)."""
    entry = registry.get(task.base_model)
    if entry is None:
        return f"base model {task.base_model!r} is no longer registered"
    adapters = []
    for job_id in row.job_ids:
        artifact = _adapter(session, job_id)
        if artifact is None:
            return f"the adapter of job {job_id!r} is gone"
        adapters.append(SampleAdapter(job_id=job_id, files=[
            f"/internal/v1/artifacts/{artifact.id}/files/{f['name']}" for f in artifact.files]))
    body = SampleRequestSettings.model_validate(row.settings)
    return SampleWork(
        request_id=row.id, lease_token=row.lease_token or "", lease_s=settings.sample_lease_s,
        task_id=task.id, attempt=row.attempts, base_model=task.base_model,
        base_model_path=str(entry.path), prompts=body.prompts, adapters=adapters,
        include_base=body.include_base, max_new_tokens=body.max_new_tokens,
        temperature=body.temperature, top_p=body.top_p, seed=body.seed)


def _end(row: SampleRequest, state: SampleRequestState, error: str | None = None) -> None:
    _move(row, state)
    row.error, row.finished_at = error, utcnow()
    row.lease_token = row.lease_until = None


def claim_next(session: Session, node_id: str, warm_models: list[str], settings: Settings,
               registry: ModelRegistry) -> SampleWork | None:
    """Claim the oldest due request for this node (queued, or running with its lease ended: its
    node died) under a fresh lease; a request of a model another node serves warm is left to that
    node for sample_warm_wait_s. One interrupted sample_max_attempts times fails instead."""
    now = utcnow()
    elsewhere = _warm_elsewhere(session, node_id, settings) - set(warm_models)
    young = now - timedelta(seconds=settings.sample_warm_wait_s)
    due = session.execute(
        select(SampleRequest, Task).join(Task, Task.id == SampleRequest.task_id)
        .where(outbox.lapsed(SampleRequest, S.QUEUED, S.RUNNING, now))
        .order_by(SampleRequest.created_at).limit(50)
        .with_for_update(of=SampleRequest, skip_locked=True)).all()
    for row, task in due:
        if outbox.exhausted(row, settings.sample_max_attempts):
            _end(row, S.FAILED, f"the sampling was interrupted {row.attempts} times (its node "
                                "went away); request it again")
            continue
        if task.base_model in elsewhere and row.created_at > young:
            continue  # a warm executor of its model serves on another node: there first
        _move(row, S.RUNNING)
        outbox.take(row, settings.sample_lease_s, now)
        row.node_id, row.started_at = node_id, now
        work = _work(session, row, task, registry, settings)
        if isinstance(work, str):
            _end(row, S.FAILED, work)
            continue
        session.commit()
        return work
    session.commit()
    return None


def _mine(session: Session, request_id: str, token: str) -> SampleRequest | None:
    row = outbox.mine(session, SampleRequest, request_id, token, SampleRequest.state == S.RUNNING)
    if row is None and session.get(SampleRequest, request_id) is None:
        raise not_found("sample request", request_id)
    return row


def renew(session: Session, request_id: str, token: str, settings: Settings) -> bool:
    """Extend the claim's lease; False when the request is no longer this claim's. Commits."""
    return outbox.renew(session, SampleRequest.lease_until, request_id, token,
                        settings.sample_lease_s, SampleRequest.state == S.RUNNING)


def succeed(session: Session, request_id: str, msg: SampleResult) -> tuple[str, bool]:
    """Keep the claim's completions (a 422 naming samples for a row of a job not chosen); the
    request's state and whether the claim was still the request's."""
    row = _mine(session, request_id, msg.lease_token)
    if row is None:
        state = session.get(SampleRequest, request_id).state
        session.rollback()
        return state, False
    allowed = set(row.job_ids) | ({None} if row.settings.get("include_base", True) else set())
    stray = sorted({str(s.job_id) for s in msg.samples if s.job_id not in allowed})
    if stray:
        session.rollback()
        raise ApiError(422, "invalid_request", f"samples name jobs the request did not choose: "
                       f"{stray[:3]}", "samples")
    row.samples = [s.model_dump(mode="json") for s in msg.samples]
    _end(row, S.SUCCEEDED)
    session.commit()
    return row.state, True


def fail(session: Session, request_id: str, token: str, error: str, retryable: bool,
         settings: Settings) -> tuple[str, bool]:
    """The claim could not make them: retryable (its node or executor went away) queues the
    request again while attempts remain; else it fails with the (tenant-safe) message."""
    row = _mine(session, request_id, token)
    if row is None:
        state = session.get(SampleRequest, request_id).state
        session.rollback()
        return state, False
    message = tenant_safe(error)
    if retryable and row.attempts < settings.sample_max_attempts:
        _move(row, S.QUEUED)
        row.lease_token = row.lease_until = None
        row.error = message
    elif retryable:
        _end(row, S.FAILED, f"the sampling was interrupted {row.attempts} times ({message}); "
                            "request it again")
    else:
        _end(row, S.FAILED, message)
    session.commit()
    return row.state, True
