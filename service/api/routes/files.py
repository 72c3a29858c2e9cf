"""Routes /v1/files: upload (multipart JSONL, validated line by line), list, get, content,
delete. Every file is scoped to the calling tenant."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from service import files as svc
from service.api.deps import RegistryDep, SessionDep, SettingsDep, StorageDep, TenantDep
from service.api.error_docs import errors
from service.core.errors import ApiError
from service.core.pagination import cursor_query
from service.schemas import DeletedOut, FileOut, Page

router = APIRouter(prefix="/v1/files", tags=["files"])
UPLOAD_OVERHEAD = 65536  # multipart headers and boundaries around the file part
_UPLOAD_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {
        "type": "object", "required": ["file"], "properties": {
            "file": {"type": "string", "format": "binary",
                     "description": "JSONL: chat (`messages`), `prompt`/`completion`, `text`, "
                                    "or preference (`prompt`/`chosen`/`rejected`, or `input`/"
                                    "`preferred_output`/`non_preferred_output`); with purpose "
                                    "`adapter`, a PEFT LoRA adapter archive (.tar.gz or "
                                    ".zip of `adapter_config.json` and "
                                    "`adapter_model.safetensors`)."},
            "purpose": {"type": "string", "minLength": 1, "maxLength": 32,
                        "default": "fine-tune"},
            "base_model": {"type": "string", "minLength": 1, "maxLength": 200,
                           "description": "With purpose `adapter` only: the registered base "
                                          "model (`GET /v1/models`) the adapter is for; the "
                                          "upload checks its name, target modules and shapes "
                                          "against that model (a 422 naming `file` when they "
                                          "do not fit). Without it, the models the adapter's "
                                          "`base_model_name_or_path` names are checked."}}}}}}}


def _out(row: object) -> FileOut:
    return FileOut.model_validate(row, from_attributes=True)


async def _read_form(request: Request, max_bytes: int) -> Any:
    """The multipart form, read as it streams in with a running byte count: a 413 as soon as
    the body passes the limit, whether or not it sent a Content-Length."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(422, "invalid_request", "expected a multipart/form-data body with a "
                       "'file' part", "file")
    limit = max_bytes + UPLOAD_OVERHEAD

    async def _body() -> Any:
        seen = 0
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > limit:
                raise ApiError(413, "file_too_large", f"upload is over the limit of {max_bytes} "
                               "bytes", "file")
            yield chunk

    try:
        return await MultiPartParser(request.headers, _body(), max_files=1, max_fields=8).parse()
    except MultiPartException as exc:
        raise ApiError(422, "invalid_request", f"malformed multipart body: {exc.message}",
                       "file") from exc


@router.post("", status_code=201, response_model=FileOut, openapi_extra=_UPLOAD_BODY,
             responses={201: {"description": "Stored: a new file"},
                        200: {"model": FileOut, "description": "The same bytes with the same "
                              "purpose are already one of your files: that file, unchanged "
                              "(uploads are deduplicated by content per tenant)"}}
             | errors(401, 413, 422, descriptions={
                 413: "File over the size limit",
                 422: "A bad line (number and field in the message: the file must be UTF-8 "
                      "JSONL records of one known format), no file part, or an adapter that "
                      "no task could start from (`param`: `file`); a `base_model` that is not "
                      "registered or given with a purpose other than `adapter`"}))
async def upload_file(request: Request, response: Response, session: SessionDep,
                      tenant: TenantDep, storage: StorageDep, settings: SettingsDep,
                      registry: RegistryDep) -> FileOut:
    """Upload a file (201). Uploads are deduplicated by content per tenant: bytes this tenant
    already uploaded with the same purpose (and not deleted) are validated again and answer
    200 with that file as it is (its id, filename and created_at); nothing new is stored."""
    # The tenant is known (its key checked) before a byte of the body is read.
    form = await _read_form(request, settings.max_upload_bytes)
    try:
        upload, purpose = form.get("file"), form.get("purpose", "fine-tune")
        if not isinstance(upload, UploadFile):
            raise ApiError(422, "invalid_request", "file: a 'file' part is required", "file")
        if not isinstance(purpose, str) or not 0 < len(purpose) <= 32:
            raise ApiError(422, "invalid_request", "purpose: a string of 1 to 32 characters",
                           "purpose")
        base_model = form.get("base_model")
        if base_model is not None and (not isinstance(base_model, str)
                                       or not 0 < len(base_model) <= 200):
            raise ApiError(422, "invalid_request", "base_model: a string of 1 to 200 "
                           "characters", "base_model")
        row, created = await run_in_threadpool(
            svc.create_file, session, storage, tenant, upload.filename or "upload.jsonl",
            upload.file, settings.max_upload_bytes, purpose, registry, base_model)
        await run_in_threadpool(session.commit)
        if not created:
            response.status_code = 200
    finally:
        await form.close()
    return _out(row)


@router.get("", response_model=Page[FileOut], responses=errors(401, 422))
def list_files(session: SessionDep, tenant: TenantDep, settings: SettingsDep,
               limit: Annotated[int, Query(ge=1, le=1000)] = 20,
               after: Annotated[str | None, cursor_query("file", "file")] = None
               ) -> Page[FileOut]:
    rows, more = svc.list_files(session, tenant, min(limit, settings.max_page_size), after)
    return Page[FileOut](data=[_out(r) for r in rows], has_more=more,
                         last_id=rows[-1].id if rows else None)


@router.get("/{file_id}", response_model=FileOut, responses=errors(401, 404, 422))
def get_file(session: SessionDep, tenant: TenantDep, file_id: str) -> FileOut:
    return _out(svc.get_file(session, tenant, file_id))


@router.get("/{file_id}/content", response_class=StreamingResponse,
            responses={200: {"content": {"application/jsonl": {}, "text/csv": {}}}}
            | errors(401, 404, 422))
def file_content(session: SessionDep, tenant: TenantDep, storage: StorageDep,
                 file_id: str) -> StreamingResponse:
    row = svc.get_file(session, tenant, file_id)
    media = {"csv": "text/csv", "adapter": "application/octet-stream"}.get(
        row.format, "application/jsonl")
    return StreamingResponse(storage.iter_bytes(row.storage_key), media_type=media)


@router.delete("/{file_id}", response_model=DeletedOut, responses=errors(401, 404, 409, 422))
def delete_file(session: SessionDep, tenant: TenantDep, storage: StorageDep,
                file_id: str) -> DeletedOut:
    row = svc.delete_file(session, storage, tenant, file_id)
    session.commit()
    return DeletedOut(id=row.id, object="file")
