"""Routes /v1/tasks and /v1/jobs: create (Idempotency-Key), list, get, cancel, jobs, events,
loss curves, adapter downloads; and GET /v1/models."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from contract.protocol import INT32_MAX
from contract.states import TASK_STATES, values
from service import adapters, events, task_views, tasks
from service.api import read_path
from service.api.deps import (
    ReadKeyDep,
    RegistryDep,
    SentJsonDep,
    SessionDep,
    SettingsDep,
    StorageDep,
    TenantDep,
)
from service.api.downloads import file_response
from service.cluster import cluster_changed
from service.core.pagination import cursor_query, id_pattern
from service.core.storage import Storage
from service.dry_run import DryRunOut
from service.dry_run import dry_run as run_dry
from service.model_size import model_parameters
from service.models import Artifact, Job
from service.result_files import ensure_result_files
from service.schemas import EventPage, JobOut, MetricsOut, ModelOut, Page, TaskCreate, TaskOut
from service.task_actions import act

router = APIRouter(tags=["tasks"])
TaskState = Literal[values(TASK_STATES)]
FormatQuery = Annotated[adapters.ArchiveFormat, Query(alias="format")]
ARCHIVE = {200: {"content": {"application/gzip": {}, "application/zip": {}},
                 "description": "Archive with adapter_config.json + adapter_model.safetensors"},
           206: {"description": "The byte range a `Range` header asked for"},
           416: {"description": "The `Range` starts past the end of the archive"}}


@router.get("/v1/models", response_model=Page[ModelOut], tags=["models"])
def list_models(_: TenantDep, registry: RegistryDep) -> Page[ModelOut]:
    data = [ModelOut(id=m.name, family=m.family, parameters=model_parameters(m), gpus=m.gpus,
                     max_seq_len=m.max_seq_len) for m in registry.all()]
    return Page[ModelOut](data=data, last_id=data[-1].id if data else None)


@router.post("/v1/tasks", status_code=201, response_model=TaskOut,
             responses={200: {"model": TaskOut | DryRunOut,
                              "description": "Replay of an Idempotency-Key, or a dry run's "
                                             "jobs and estimate (nothing created)"},
                        409: {"description": "Idempotency-Key reused with another body "
                                             "(its JSON as sent, key order aside; no default "
                                             "is filled in, so a retry replays across "
                                             "upgrades)"}})
def create_task(body: TaskCreate, response: Response, session: SessionDep, tenant: TenantDep,
                settings: SettingsDep, registry: RegistryDep, storage: StorageDep,
                sent: SentJsonDep,
                idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
                dry_run: Annotated[bool, Query(description="Validate and estimate only: the "
                                                           "jobs, tokens, GPU-hours and planned "
                                                           "start/finish; creates nothing.")]
                = False) -> TaskOut | Response:
    if dry_run:
        estimate = run_dry(session, tenant, body, settings, registry, storage)
        session.rollback()
        return _json(estimate)
    task, created = tasks.create_task(session, tenant, body, settings, registry, idempotency_key,
                                      storage, sent)
    if created:
        cluster_changed(session, "task_created", settings)
    else:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
    return task_views.task_out(session, tasks.get_task(session, tenant, task.id),
                          settings.price_per_gpu_hour)


@router.get("/v1/tasks", response_model=Page[TaskOut])
async def list_tasks(request: Request, key: ReadKeyDep, settings: SettingsDep,
                     limit: Annotated[int, Query(ge=1, le=1000)] = 20,
                     after: Annotated[str | None, cursor_query("task", "task")] = None,
                     state: Annotated[TaskState | None, Query()] = None) -> Response:
    # Page[TaskOut]'s JSON, on the event loop (service.api.read_path).
    return Response(await read_path.list_tasks_json(
        request.app.state.read_pool, key, min(limit, settings.max_page_size), after, state,
        settings.price_per_gpu_hour), media_type="application/json")


@router.get("/v1/tasks/{task_id}", response_model=TaskOut)
def get_task(session: SessionDep, tenant: TenantDep, settings: SettingsDep, storage: StorageDep,
             task_id: str) -> TaskOut:
    task = tasks.get_task(session, tenant, task_id)
    ensure_result_files(session, storage, [task])
    return task_views.task_out(session, task, settings.price_per_gpu_hour)


@router.post("/v1/tasks/{task_id}/cancel", response_model=TaskOut)
def cancel_task(session: SessionDep, tenant: TenantDep, settings: SettingsDep,
                storage: StorageDep, task_id: str) -> TaskOut:
    task = act(session, tenant, settings, task_id, "cancel")
    ensure_result_files(session, storage, [task])
    return task_views.task_out(session, task, settings.price_per_gpu_hour)


@router.post("/v1/tasks/{task_id}/pause", response_model=TaskOut,
             responses={409: {"description": "The task is over"}})
def pause_task(session: SessionDep, tenant: TenantDep, settings: SettingsDep,
               task_id: str) -> TaskOut:
    """Stop the task at its next step boundary with a checkpoint and free its GPUs: `pausing`
    while its attempt stops, then `paused` (at once when nothing runs yet)."""
    return task_views.task_out(session, act(session, tenant, settings, task_id, "pause"),
                          settings.price_per_gpu_hour)


@router.post("/v1/tasks/{task_id}/resume", response_model=TaskOut,
             responses={409: {"description": "The task is not paused"}})
def resume_task(session: SessionDep, tenant: TenantDep, settings: SettingsDep,
                task_id: str) -> TaskOut:
    """paused -> queued: the scheduler places it again and it continues from its checkpoint."""
    return task_views.task_out(session, act(session, tenant, settings, task_id, "resume"),
                          settings.price_per_gpu_hour)


@router.get("/v1/tasks/{task_id}/jobs", response_model=Page[JobOut])
def list_jobs(session: SessionDep, tenant: TenantDep, task_id: str) -> Page[JobOut]:
    data = task_views.list_jobs(session, tasks.get_task(session, tenant, task_id))
    return Page[JobOut](data=data, last_id=data[-1].id if data else None)


@router.get("/v1/tasks/{task_id}/events", response_model=EventPage)
def list_events(session: SessionDep, tenant: TenantDep, task_id: str,
                after: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None,
                limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> EventPage:
    task = tasks.get_task(session, tenant, task_id)
    data, more = events.list_events(session, task, after, limit)
    return EventPage(data=data, has_more=more, last_id=data[-1].id if data else after)


@router.get("/v1/tasks/{task_id}/metrics", response_model=MetricsOut)
async def task_metrics(request: Request, key: ReadKeyDep, task_id: str,
                       job_id: Annotated[str | None, Query(
                           pattern=id_pattern("job"), description="Only this job's curves (a "
                           "404 naming `job_id` when it is not one of the task's jobs).")]
                       = None,
                       # a step is an int32 (contract MetricPointIn.step)
                       after_step: Annotated[int | None, Query(ge=-1, le=INT32_MAX)] = None,
                       max_points: Annotated[int | None, Query(
                           ge=4, le=100_000, description="At most this many points per curve: "
                           "the first, the last and each bucket's lowest and highest loss.")]
                       = None) -> Response:
    # MetricsOut's JSON, on the event loop (service.api.read_path).
    return Response(await read_path.task_metrics_json(
        request.app.state.read_pool, key, task_id, job_id, after_step, max_points),
        media_type="application/json")


@router.get("/v1/tasks/{task_id}/adapter", response_class=StreamingResponse, responses=ARCHIVE)
def task_adapter(request: Request, session: SessionDep, tenant: TenantDep, storage: StorageDep,
                 task_id: str, fmt: FormatQuery = "tar.gz") -> Response:
    job, artifact = adapters.task_adapter(session, tasks.get_task(session, tenant, task_id))
    return _archive(request, storage, job, artifact, fmt)


@router.get("/v1/jobs/{job_id}", response_model=JobOut)
def get_job(session: SessionDep, tenant: TenantDep, job_id: str) -> JobOut:
    job = tasks.get_job(session, tenant, job_id)
    task = tasks.get_task(session, tenant, job.task_id)
    return next(j for j in task_views.list_jobs(session, task) if j.id == job.id)


@router.get("/v1/jobs/{job_id}/adapter", response_class=StreamingResponse, responses=ARCHIVE)
def job_adapter(request: Request, session: SessionDep, tenant: TenantDep, storage: StorageDep,
                job_id: str, fmt: FormatQuery = "tar.gz") -> Response:
    job = tasks.get_job(session, tenant, job_id)
    return _archive(request, storage, job, adapters.job_adapter(session, job), fmt)


def _archive(request: Request, storage: Storage, job: Job, artifact: Artifact,
             fmt: adapters.ArchiveFormat) -> Response:
    src, size = adapters.build_archive(storage, artifact, fmt)
    return file_response(request, src, size, adapters.MEDIA_TYPES[fmt],
                         adapters.archive_name(job, fmt), adapters.archive_etag(artifact, fmt))


def _json(model: BaseModel) -> Response:
    """A validated schema as JSON, as is. For the most-read route (the task list):
    FastAPI would validate the returned model a second time, in one more threadpool hop; the
    routes still declare their response_model for the API contract."""
    return Response(model.model_dump_json(), media_type="application/json")
