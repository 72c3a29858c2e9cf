"""Routes /v1/files: upload (multipart JSONL, validated line by line), list, get, content,
delete. Every file is scoped to the calling tenant."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import StreamingResponse

from service import files as svc
from service.deps import SessionDep, SettingsDep, StorageDep, TenantDep
from service.schemas import DeletedOut, FileOut, Page

router = APIRouter(prefix="/v1/files", tags=["files"])


def _out(row: object) -> FileOut:
    return FileOut.model_validate(row, from_attributes=True)


@router.post("", status_code=201, response_model=FileOut,
             responses={413: {"description": "File over the size limit"},
                        422: {"description": "A bad line (number and field in the message)"}})
def upload_file(session: SessionDep, tenant: TenantDep, storage: StorageDep,
                settings: SettingsDep, file: Annotated[UploadFile, File()],
                purpose: Annotated[str, Form(max_length=32)] = "fine-tune") -> FileOut:
    row = svc.create_file(session, storage, tenant, file.filename or "upload.jsonl", file.file,
                          settings.max_upload_bytes, purpose)
    session.commit()
    return _out(row)


@router.get("", response_model=Page[FileOut])
def list_files(session: SessionDep, tenant: TenantDep, settings: SettingsDep,
               limit: Annotated[int, Query(ge=1, le=1000)] = 20,
               after: Annotated[str | None, Query(max_length=40)] = None) -> Page[FileOut]:
    rows, more = svc.list_files(session, tenant, min(limit, settings.max_page_size), after)
    return Page[FileOut](data=[_out(r) for r in rows], has_more=more,
                         last_id=rows[-1].id if rows else None)


@router.get("/{file_id}", response_model=FileOut)
def get_file(session: SessionDep, tenant: TenantDep, file_id: str) -> FileOut:
    return _out(svc.get_file(session, tenant, file_id))


@router.get("/{file_id}/content", response_class=StreamingResponse,
            responses={200: {"content": {"application/jsonl": {}}}})
def file_content(session: SessionDep, tenant: TenantDep, storage: StorageDep,
                 file_id: str) -> StreamingResponse:
    row = svc.get_file(session, tenant, file_id)
    return StreamingResponse(storage.iter_bytes(row.storage_key), media_type="application/jsonl")


@router.delete("/{file_id}", response_model=DeletedOut)
def delete_file(session: SessionDep, tenant: TenantDep, storage: StorageDep,
                file_id: str) -> DeletedOut:
    row = svc.delete_file(session, storage, tenant, file_id)
    session.commit()
    return DeletedOut(id=row.id, object="file")
