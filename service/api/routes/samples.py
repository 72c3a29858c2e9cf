"""Routes of a task's samples (issue 44): GET /v1/tasks/{task_id}/samples (the tenant: the
completions the task ended with, leading adapters and base model side by side) and the worker's
fenced report POST /internal/v1/tasks/{task_id}/samples (the contract's TaskSamples)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from contract.protocol import Stored, TaskSamples
from service import samples, tasks, worker_api
from service.api.deps import SessionDep, StorageDep, TenantDep, require_worker
from service.api.routes.internal import FENCED
from service.core.errors import invalid

router = APIRouter(tags=["tasks"])
internal = APIRouter(prefix="/internal/v1", tags=["internal"], dependencies=[Depends(require_worker)])


class SampleOut(BaseModel):
    prompt: str
    job_id: str | None = Field(description="The configuration's job; null: the base model.")
    completion: str
    tokens: int = Field(description="New tokens generated.")


class SamplesOut(BaseModel):
    object: str = "list"
    task_id: str
    file_id: str | None = Field(description="The samples' result file (JSONL), null before the task ends "
                                            "with samples (settings.samples).")
    data: list[SampleOut]


@router.get("/v1/tasks/{task_id}/samples", response_model=SamplesOut)
def get_samples(session: SessionDep, tenant: TenantDep, storage: StorageDep, task_id: str) -> SamplesOut:
    """The completions the task ended with: every prompt answered by the base model (job_id null)
    and by each leading configuration, in that order per prompt; empty until the task has them."""
    task = tasks.get_task(session, tenant, task_id)
    file_id, rows = samples.read_samples(session, storage, task)
    return SamplesOut(task_id=task.id, file_id=file_id, data=[SampleOut(**r) for r in rows])


@internal.post("/tasks/{task_id}/samples", response_model=Stored, responses=FENCED)
def post_samples(task_id: str, msg: TaskSamples, session: SessionDep, storage: StorageDep) -> Stored:
    """The attempt's samples, kept as the task's samples file (stored: 1, a repeat 0)."""
    task, _ = worker_api.fence_report(session, task_id, msg.placement_id)
    try:
        stored = samples.store_samples(session, storage, task, msg)
    except ValueError as exc:
        raise invalid(str(exc), param="samples") from exc
    session.commit()
    return Stored(stored=stored)
