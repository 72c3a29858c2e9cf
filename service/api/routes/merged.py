"""Routes /v1/tasks/{task_id}/merged: request the merge of the task's best adapter (or a job's)
into its base model, read its state, download the merged model's tar archive (Range supported)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from service import tasks
from service.api.deps import RegistryDep, SessionDep, StorageDep, TenantDep
from service.api.downloads import file_response
from service.merged import lifecycle
from service.schemas import MergedModelOut

router = APIRouter(tags=["merged models"])
JobQuery = Annotated[str | None, Query(
    min_length=1, max_length=40, description="A job of the task; the task's best job when "
    "omitted (then the task must have succeeded).")]
TAR = {200: {"content": {"application/x-tar": {}},
             "description": "Tar archive of a transformers model directory: config.json, "
                            "sharded *.safetensors in the base model's dtype, tokenizer files"},
       206: {"description": "The byte range a `Range` header asked for"},
       416: {"description": "The `Range` starts past the end of the archive"}}


@router.post("/v1/tasks/{task_id}/merged", status_code=202, response_model=MergedModelOut,
             responses={200: {"model": MergedModelOut,
                              "description": "The merge already requested (any state but "
                                             "failed; a failed one is queued again: 202)"}})
def request_merged(response: Response, session: SessionDep, tenant: TenantDep,
                   registry: RegistryDep, task_id: str, job_id: JobQuery = None) -> MergedModelOut:
    """Merge the adapter into the base model's weights in the background (`queued`, `running`,
    then `succeeded` or `failed`); stored once per job."""
    task = tasks.get_task(session, tenant, task_id)
    merged, queued = lifecycle.request_merge(session, task, job_id, registry)
    out = lifecycle.merged_out(merged, task.base_model)
    session.commit()
    if not queued:
        response.status_code = 200
    return out


@router.get("/v1/tasks/{task_id}/merged", response_model=MergedModelOut)
def get_merged(session: SessionDep, tenant: TenantDep, task_id: str,
               job_id: JobQuery = None) -> MergedModelOut:
    task = tasks.get_task(session, tenant, task_id)
    return lifecycle.merged_out(lifecycle.get_merge(session, tenant, task, job_id),
                                task.base_model)


@router.get("/v1/tasks/{task_id}/merged/content", response_class=Response, responses=TAR)
def merged_content(request: Request, session: SessionDep, tenant: TenantDep,
                   storage: StorageDep, task_id: str, job_id: JobQuery = None) -> Response:
    task = tasks.get_task(session, tenant, task_id)
    merged = lifecycle.ready(lifecycle.get_merge(session, tenant, task, job_id))
    key = merged.storage_key
    return file_response(request, storage.open(key), storage.size(key), "application/x-tar",
                         f"merged-{merged.job_id}.tar", f'"{merged.id}-{int(merged.finished_at.timestamp())}"')
