"""Routes of samples on demand (issue 44): POST /v1/tasks/{task_id}/samples (the tenant's prompts,
answered in the background by chosen adapters and the base model), GET .../samples/{request_id}
(its state and, once succeeded, its completions); the node daemons' claim, lease renewal and
outcome under /internal/v1/sample_requests (contract.sample_requests)."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, Field

from contract.sample_requests import (
    SampleAck,
    SampleClaim,
    SampleFailure,
    SampleLease,
    SampleRequestSettings,
    SampleResult,
    SampleWork,
)
from service import tasks
from service.api.deps import RegistryDep, SessionDep, SettingsDep, TenantDep, require_worker
from service.api.error_docs import errors
from service.api.routes.samples import SampleOut
from service.core.errors import not_found
from service.models import Node, SampleRequest
from service.sample_requests import lifecycle
from service.sample_requests.states import SampleRequestStateName

router = APIRouter(tags=["tasks"])
internal = APIRouter(prefix="/internal/v1/sample_requests", tags=["internal"],
                     dependencies=[Depends(require_worker)])


class SampleRequestOut(BaseModel):
    """A sample request: what was asked (job_ids: the adapters chosen, top_k resolved), its state
    (queued, running, succeeded or failed, as a merged model's) and, once succeeded, its
    completions in data: per prompt, the base model's (job_id null) then each job's."""

    object: str = "sample_request"
    id: str
    task_id: str
    state: SampleRequestStateName
    error: str | None = Field(description="Why it failed (or, while queued again, why its last "
                                          "try ended).")
    prompts: list[str]
    job_ids: list[str] = Field(description="The jobs whose adapters answer, in order.")
    include_base: bool
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    attempts: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    data: list[SampleOut] = Field(description="The completions; empty until succeeded.")


def request_out(row: SampleRequest) -> SampleRequestOut:
    body = SampleRequestSettings.model_validate(row.settings)
    return SampleRequestOut(
        **body.model_dump(exclude={"job_ids", "top_k"}), job_ids=list(row.job_ids),
        id=row.id, task_id=row.task_id, state=row.state, error=row.error, attempts=row.attempts,
        created_at=row.created_at, started_at=row.started_at, finished_at=row.finished_at,
        data=[SampleOut(**s) for s in row.samples or ()])


class SampleRequestsOut(BaseModel):
    object: str = "list"
    data: list[SampleRequestOut]


@router.post("/v1/tasks/{task_id}/samples", status_code=202, response_model=SampleRequestOut)
def request_samples(session: SessionDep, tenant: TenantDep, registry: RegistryDep, task_id: str,
                    body: SampleRequestSettings) -> SampleRequestOut:
    """Answer your own prompts with the task's adapters (job_ids, or the top_k by validation
    loss) and its base model, on a node that serves the model; poll GET .../samples/{id} until
    `succeeded` (or `failed`). The task must have succeeded."""
    task = tasks.get_task(session, tenant, task_id)
    row = lifecycle.request_samples(session, task, body, registry)
    out = request_out(row)
    session.commit()
    return out


@router.get("/v1/tasks/{task_id}/samples/requests", response_model=SampleRequestsOut)
def list_sample_requests(session: SessionDep, tenant: TenantDep, task_id: str) -> SampleRequestsOut:
    """The task's sample requests, newest first (at most 100)."""
    task = tasks.get_task(session, tenant, task_id)
    return SampleRequestsOut(data=[request_out(r) for r in lifecycle.list_requests(session, tenant, task)])


@router.get("/v1/tasks/{task_id}/samples/{request_id}", response_model=SampleRequestOut)
def get_sample_request(session: SessionDep, tenant: TenantDep, task_id: str,
                       request_id: str) -> SampleRequestOut:
    task = tasks.get_task(session, tenant, task_id)
    return request_out(lifecycle.get_request(session, tenant, task, request_id))


@internal.post("/claim", response_model=SampleWork,
               responses={204: {"description": "None due."}, **errors(404, descriptions={
                   404: "The node is not registered (register again)."})})
def claim_sample_request(msg: SampleClaim, session: SessionDep, settings: SettingsDep,
                         registry: RegistryDep) -> SampleWork | Response:
    """The oldest due request for this node, under a fresh lease (204: none)."""
    if session.get(Node, msg.node_id) is None:
        raise not_found("node", msg.node_id, "node_id")
    work = lifecycle.claim_next(session, msg.node_id, msg.warm_models, settings, registry)
    return Response(status_code=204) if work is None else work


@internal.post("/{request_id}/lease", response_model=SampleAck)
def renew_sample_lease(request_id: str, msg: SampleLease, session: SessionDep,
                       settings: SettingsDep) -> SampleAck:
    mine = lifecycle.renew(session, request_id, msg.lease_token, settings)
    row = session.get(SampleRequest, request_id)
    if row is None:
        raise not_found("sample request", request_id)
    return SampleAck(state=row.state, mine=mine)


@internal.post("/{request_id}/result", response_model=SampleAck)
def sample_result(request_id: str, msg: SampleResult, session: SessionDep) -> SampleAck:
    state, mine = lifecycle.succeed(session, request_id, msg)
    return SampleAck(state=state, mine=mine)


@internal.post("/{request_id}/failed", response_model=SampleAck)
def sample_failed(request_id: str, msg: SampleFailure, session: SessionDep,
                  settings: SettingsDep) -> SampleAck:
    state, mine = lifecycle.fail(session, request_id, msg.lease_token, msg.error, msg.retryable,
                                 settings)
    return SampleAck(state=state, mine=mine)
