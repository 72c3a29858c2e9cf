"""OpenAI-compatible fine-tuning API (/v1/fine_tuning/jobs, /v1/models/{id}): a fine-tuning job is
a loraplex task seen through the shapes of OpenAI's API (service.api.openai_compat)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from contract.states import TaskState
from service import tasks
from service.api.deps import (
    RegistryDep,
    SentJsonDep,
    SessionDep,
    SettingsDep,
    StorageDep,
    TenantDep,
)
from service.api.openai_compat import views
from service.api.openai_compat.create import remap_error, to_task_create
from service.api.openai_compat.schemas import (
    CheckpointPage,
    FineTuningJobCreate,
    FineTuningJobOut,
    FineTuningJobPage,
    JobEventPage,
)
from service.cluster import cluster_changed
from service.core.config import Settings
from service.core.errors import ApiError, invalid, not_found
from service.core.pagination import cursor_query
from service.core.storage import Storage
from service.dry_run import DryRunOut
from service.dry_run import dry_run as run_dry
from service.model_size import model_parameters
from service.models import Task
from service.result_files import ensure_result_files
from service.schemas import ModelOut
from service.task_actions import act

router = APIRouter(tags=["fine_tuning"])
Limit = Annotated[int, Query(ge=1, le=100)]
After = Annotated[str | None, Query(max_length=64, description=(
    "The `id` of the last item of the previous page; one that names none of the job's is a 404 "
    "naming `after`."))]
JobCursor = Annotated[str | None, cursor_query("task", "fine-tuning job")]
JOB_RESPONSES = {404: {"description": "No such job of this tenant"},
                 409: {"description": "The transition is not allowed from the job's status"}}


def _one(session: SessionDep, task: Task, settings: Settings,
         storage: Storage | None = None) -> FineTuningJobOut:
    """The job's view; with storage, its result file is made first if it ended without one."""
    if storage is not None:
        ensure_result_files(session, storage, [task])
    return views.job_outs(session, [task], settings.price_per_gpu_hour)[0]


# One model for the 200 (a dry run's estimate is a 200 too): a response_model beside a
# responses= model would document both at once (their $ref and anyOf together: neither fits).
@router.post("/v1/fine_tuning/jobs", response_model=FineTuningJobOut | DryRunOut,
             responses={200: {"description": "The job (also a replayed Idempotency-Key), or a "
                                             "dry run's jobs and estimate (nothing created)"},
                        409: {"description": "Idempotency-Key reused with another body "
                                             "(its JSON as sent, key order aside; no default "
                                             "is filled in, so a retry replays across "
                                             "upgrades)"}})
def create_job(body: FineTuningJobCreate, session: SessionDep, tenant: TenantDep,
               settings: SettingsDep, registry: RegistryDep, sent: SentJsonDep,
               idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
               dry_run: Annotated[bool, Query(description="Validate and estimate only.")] = False
               ) -> FineTuningJobOut | Response:
    native, where = to_task_create(body)
    try:
        if dry_run:
            estimate = run_dry(session, tenant, native, settings, registry)
            session.rollback()
            return Response(estimate.model_dump_json(), media_type="application/json")
        task, created = tasks.create_task(session, tenant, native, settings, registry,
                                          idempotency_key, sent=sent)
    except ApiError as exc:
        raise remap_error(exc, where) from None
    if created:
        cluster_changed(session, "task_created", settings)
    return _one(session, tasks.get_task(session, tenant, task.id), settings)


def _metadata_filter(request: Request) -> dict[str, str] | None:
    """OpenAI's `metadata[k]=v` query filter."""
    found = {}
    for key, value in request.query_params.multi_items():
        if key.startswith("metadata[") and key.endswith("]"):
            name = key[len("metadata["):-1]
            if not name or len(name) > 64 or len(value) > 512:
                raise invalid("metadata filter keys are 1-64 characters, values at most 512",
                              param="metadata")
            found[name] = value
    return found or None


@router.get("/v1/fine_tuning/jobs", response_model=FineTuningJobPage)
def list_jobs(request: Request, session: SessionDep, tenant: TenantDep, settings: SettingsDep,
              storage: StorageDep, after: JobCursor = None,
              limit: Limit = 20) -> FineTuningJobPage:
    """Newest first; `after` is the last id of the previous page; `metadata[k]=v` filters."""
    rows, more = views.list_jobs(session, tenant, limit, after, _metadata_filter(request))
    ensure_result_files(session, storage, rows)
    return FineTuningJobPage(data=views.job_outs(session, rows, settings.price_per_gpu_hour),
                             has_more=more)


@router.get("/v1/fine_tuning/jobs/{job_id}", response_model=FineTuningJobOut,
            responses=JOB_RESPONSES)
def retrieve_job(session: SessionDep, tenant: TenantDep, settings: SettingsDep,
                 storage: StorageDep, job_id: str) -> FineTuningJobOut:
    return _one(session, tasks.get_task(session, tenant, job_id), settings, storage)


@router.post("/v1/fine_tuning/jobs/{job_id}/cancel", response_model=FineTuningJobOut,
             responses=JOB_RESPONSES)
def cancel_job(session: SessionDep, tenant: TenantDep, settings: SettingsDep,
               storage: StorageDep, job_id: str) -> FineTuningJobOut:
    return _one(session, act(session, tenant, settings, job_id, "cancel"), settings, storage)


@router.post("/v1/fine_tuning/jobs/{job_id}/pause", response_model=FineTuningJobOut,
             responses=JOB_RESPONSES)
def pause_job(session: SessionDep, tenant: TenantDep, settings: SettingsDep,
              job_id: str) -> FineTuningJobOut:
    """Checkpoint at the next step boundary and free the GPUs: pausing, then paused."""
    return _one(session, act(session, tenant, settings, job_id, "pause"), settings)


@router.post("/v1/fine_tuning/jobs/{job_id}/resume", response_model=FineTuningJobOut,
             responses=JOB_RESPONSES)
def resume_job(session: SessionDep, tenant: TenantDep, settings: SettingsDep,
               job_id: str) -> FineTuningJobOut:
    """paused -> queued; training continues from the pause's checkpoint."""
    return _one(session, act(session, tenant, settings, job_id, "resume"), settings)


@router.get("/v1/fine_tuning/jobs/{job_id}/events", response_model=JobEventPage,
            responses=JOB_RESPONSES)
def list_events(session: SessionDep, tenant: TenantDep, job_id: str, after: After = None,
                limit: Limit = 20) -> JobEventPage:
    """Newest first: messages (the task's events) and metrics (per job and evaluation)."""
    data, more = views.job_events(session, tasks.get_task(session, tenant, job_id), after, limit)
    return JobEventPage(data=data, has_more=more)


@router.get("/v1/fine_tuning/jobs/{job_id}/checkpoints", response_model=CheckpointPage,
            responses=JOB_RESPONSES)
def list_checkpoints(session: SessionDep, tenant: TenantDep, job_id: str, after: After = None,
                     limit: Limit = 10) -> CheckpointPage:
    """Each job's adapter at its best-validation step; `best` marks the job's pick."""
    data, more = views.job_checkpoints(session, tasks.get_task(session, tenant, job_id), after,
                                       limit)
    return CheckpointPage(data=data, has_more=more, first_id=data[0].id if data else None,
                          last_id=data[-1].id if data else None)


@router.get("/v1/models/{model_id:path}", response_model=ModelOut, tags=["models"],
            responses={404: {"description": "No such model"}})
def retrieve_model(session: SessionDep, tenant: TenantDep, registry: RegistryDep,
                   model_id: str) -> ModelOut:
    """A registered base model, or a fine-tuned model of this tenant (`ft:...`)."""
    task_id = views.task_of_model_name(model_id)
    if task_id is not None:
        task = session.get(Task, task_id)
        if task is None or task.tenant_id != tenant.id or task.state != TaskState.SUCCEEDED:
            raise not_found("model", model_id, param="model")
        base = registry.get(task.base_model)
        return ModelOut(id=views.fine_tuned_model_name(task) or model_id,
                        family=base.family if base else None,
                        parameters=model_parameters(base) if base else None,
                        gpus=base.gpus if base else 1, max_seq_len=task.settings["max_seq_len"],
                        created=views.unix(task.finished_at) or 0, owned_by=tenant.id)
    model = registry.get(model_id)
    if model is None:
        raise not_found("model", model_id, param="model")
    return ModelOut(id=model.name, family=model.family, parameters=model_parameters(model),
                    gpus=model.gpus, max_seq_len=model.max_seq_len)
