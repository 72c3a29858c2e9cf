"""Routes /internal/v1/* for worker daemons (worker token): nodes, heartbeats, claims, file and
checkpoint downloads, and the fenced reports of an attempt: events, metric points, job states,
artifacts, throughput, task end."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, File, Form, UploadFile
from fastapi.responses import StreamingResponse
from pydantic import ValidationError, WithJsonSchema

from contract.protocol import (
    ArtifactMeta,
    ArtifactOut,
    ClaimRequest,
    EventBatch,
    EventIn,
    ExecutorTimings,
    Heartbeat,
    HeartbeatResponse,
    JobStateUpdate,
    MetricBatch,
    NodeDeregister,
    NodeDeregistered,
    NodeRegister,
    NodeRegistered,
    PlacementSpec,
    Stored,
    TaskAck,
    TaskFailed,
    TaskFinished,
    ThroughputReport,
    node_queue_name,
)
from service import artifact_store, profiles, worker_api
from service.api.deps import (
    RegistryDep,
    SessionDep,
    SettingsDep,
    StorageDep,
    require_worker,
)
from service.artifact_keys import blob_key
from service.cluster import cluster_changed, heartbeat, register_node
from service.core.errors import invalid, not_found
from service.events import ingest_events
from service.models import Artifact, Node
from service.models import File as FileRow
from service.result_files import make_result_file_after_end
from service.schemas import JobOut
from service.task_views import job_out

router = APIRouter(prefix="/internal/v1", tags=["internal"], dependencies=[Depends(require_worker)])
HEARTBEAT_INTERVAL_S = 10.0
# Every report is fenced (service.worker_api.fence_report): only the task's current live
# placement of a task that is not over is stored.
FENCED: dict[int | str, dict] = {
    409: {"description": "Refused, nothing stored: the task is over (code task_<state>) or the "
                         "placement is not its current attempt (code stale_attempt)."},
    404: {"description": "Unknown task, job or placement (or a placement of another task)."}}


@router.post("/nodes", response_model=NodeRegistered)
def register(msg: NodeRegister, session: SessionDep, settings: SettingsDep) -> NodeRegistered:
    node, changed = register_node(session, msg)
    session.commit()
    if changed:
        cluster_changed(session, "node_registered", settings)
    return NodeRegistered(node_id=node.id, queue=node_queue_name(node.id),
                          heartbeat_interval_s=min(HEARTBEAT_INTERVAL_S,
                                                   settings.node_timeout_s / 3))


@router.post("/nodes/{node_id}/heartbeat", response_model=HeartbeatResponse)
def node_heartbeat(node_id: str, msg: Heartbeat, session: SessionDep,
                   settings: SettingsDep) -> HeartbeatResponse:
    node = session.get(Node, node_id)
    if node is None:
        raise not_found("node", node_id)
    response, came_back = heartbeat(session, node, msg)
    session.commit()
    if came_back:
        cluster_changed(session, "node_up", settings)
    return response


@router.post("/nodes/{node_id}/deregister", response_model=NodeDeregistered)
def node_deregister(node_id: str, msg: NodeDeregister, session: SessionDep,
                    settings: SettingsDep) -> NodeDeregistered:
    return worker_api.deregister_node(session, node_id, msg, settings)


@router.post("/placements/{placement_id}/claim", response_model=PlacementSpec)
def claim(placement_id: str, msg: ClaimRequest, session: SessionDep,
          registry: RegistryDep) -> PlacementSpec:
    return worker_api.claim_placement(session, placement_id, msg.node_id, registry)


@router.get("/files/{file_id}/content", response_class=StreamingResponse,
            responses={200: {"content": {"application/jsonl": {}}}})
def file_content(file_id: str, session: SessionDep, storage: StorageDep) -> StreamingResponse:
    row = session.get(FileRow, file_id)
    if row is None or row.deleted_at is not None:
        raise not_found("file", file_id)
    return StreamingResponse(storage.iter_bytes(row.storage_key), media_type="application/jsonl")


@router.get("/artifacts/{artifact_id}/files/{name}", response_class=StreamingResponse,
            responses={200: {"content": {"application/octet-stream": {}}}})
def artifact_file(artifact_id: str, name: str, session: SessionDep,
                  storage: StorageDep) -> StreamingResponse:
    artifact = session.get(Artifact, artifact_id)
    entry = next((f for f in artifact.files if f["name"] == name), None) if artifact else None
    if artifact is None or entry is None:
        raise not_found("artifact file", f"{artifact_id}/{name}")
    return StreamingResponse(storage.iter_bytes(blob_key(artifact, entry)),
                             media_type="application/octet-stream")


@router.post("/tasks/{task_id}/events", response_model=Stored, responses=FENCED)
def post_events(task_id: str, msg: EventBatch, session: SessionDep) -> Stored:
    stored = worker_api.report_events(session, task_id, msg)
    session.commit()
    return Stored(stored=stored)


@router.post("/tasks/{task_id}/metrics", response_model=Stored, responses=FENCED)
def post_metrics(task_id: str, msg: MetricBatch, session: SessionDep) -> Stored:
    stored = worker_api.report_metrics(session, task_id, msg)
    session.commit()
    return Stored(stored=stored)


@router.post("/jobs/{job_id}/state", response_model=JobOut, responses=FENCED)
def post_job_state(job_id: str, msg: JobStateUpdate, session: SessionDep) -> JobOut:
    job, has_adapter = worker_api.report_job_state(session, job_id, msg)
    session.commit()
    return job_out(job, has_adapter)


# The meta part is ArtifactMeta's JSON: an object part of a multipart body, which OpenAPI sends
# as application/json. (A pydantic model as a Form() parameter would be read as the whole form.)
MetaPart = Annotated[str, Form(), WithJsonSchema(ArtifactMeta.model_json_schema())]


@router.post("/tasks/{task_id}/artifacts", response_model=ArtifactOut, status_code=201,
             responses=FENCED)
def upload_artifact(task_id: str, session: SessionDep, storage: StorageDep,
                    settings: SettingsDep, meta: MetaPart,
                    files: Annotated[list[UploadFile], File(min_length=1)]) -> ArtifactOut:
    try:
        parsed = ArtifactMeta.model_validate_json(meta)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise invalid(f"meta: {field or ''} {first['msg']}".strip(),
                      param=f"meta.{field}" if field else "meta") from exc
    artifact = artifact_store.store_artifact(
        session, storage, task_id, parsed, [(f.filename or "", f.file) for f in files],
        settings.max_artifact_bytes)
    session.commit()
    return ArtifactOut(artifact_id=artifact.id, kind=artifact.kind, key=artifact.key,
                       files=artifact.files)


@router.post("/tasks/{task_id}/throughput", response_model=Stored, responses=FENCED)
def post_throughput(task_id: str, msg: ThroughputReport, session: SessionDep) -> Stored:
    """An executor's measurement, kept as a throughput profile (stored: 1 new key, 0 updated)."""
    new = profiles.store_throughput(session, task_id, msg)
    session.commit()
    return Stored(stored=int(new))


@router.post("/tasks/{task_id}/timings", response_model=Stored, responses=FENCED)
def post_timings(task_id: str, msg: ExecutorTimings, session: SessionDep) -> Stored:
    """Where an executor's time went for the task: the attempt's `timings` event (its data the
    phases' seconds as <phase>_s, wall_s, first_step_s and the details); a repeat stores
    nothing (stored: 1, else 0)."""
    task, _ = worker_api.fence_report(session, task_id, msg.placement_id)
    data = {"wall_s": msg.wall_s, "first_step_s": msg.first_step_s,
            **{f"{k}_s": v for k, v in msg.phases.items()}, **msg.details}
    first = "" if msg.first_step_s is None else f", first step at {msg.first_step_s:.1f} s"
    event = EventIn(type="timings", message=f"executor wall {msg.wall_s:.1f} s{first}",
                    data=data, client_key=f"{msg.placement_id}:timings")
    stored = ingest_events(session, task, [event])
    session.commit()
    return Stored(stored=stored)


@router.post("/tasks/{task_id}/finished", response_model=TaskAck, responses=FENCED)
def finished(task_id: str, msg: TaskFinished, session: SessionDep, settings: SettingsDep,
             storage: StorageDep) -> TaskAck:
    task = worker_api.task_finished(session, task_id, msg, settings)
    ack = TaskAck(task_id=task.id, state=task.state, best_job_id=task.best_job_id)
    make_result_file_after_end(session, storage, task_id)
    return ack


@router.post("/tasks/{task_id}/failed", response_model=TaskAck, responses=FENCED)
def failed(task_id: str, msg: TaskFailed, session: SessionDep, settings: SettingsDep,
           storage: StorageDep) -> TaskAck:
    task = worker_api.task_failed(session, task_id, msg, settings)
    ack = TaskAck(task_id=task.id, state=task.state, best_job_id=task.best_job_id)
    make_result_file_after_end(session, storage, task_id)  # a no-op unless it ended for good
    return ack
