"""Training files: JSONL validation line by line (chat, prompt/completion, DPO preference),
storage of the blob, and tenant-scoped list/get/delete."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import ApiError, conflict, not_found
from service.models import TASK_TERMINAL, File, Task, Tenant, new_id, utcnow
from service.storage import Storage

ROLES = ("system", "user", "assistant", "tool")
FORMAT_KEYS = {
    "chat": ("messages",),
    "preference": ("prompt", "chosen", "rejected"),
    "completion": ("prompt", "completion"),
}
METHOD_FORMATS = {"sft": ("chat", "completion"), "dpo": ("preference",)}


class FileValidationError(ValueError):
    """A bad line: says which line (1-based) and which field."""

    def __init__(self, line: int, field: str | None, reason: str) -> None:
        self.line, self.field, self.reason = line, field, reason
        where = f"line {line}" + (f", field '{field}'" if field else "")
        super().__init__(f"{where}: {reason}")


def detect_format(record: dict) -> str | None:
    if "messages" in record:
        return "chat"
    if "chosen" in record or "rejected" in record:
        return "preference"
    if "prompt" in record or "completion" in record:
        return "completion"
    return None


def _check_str(record: dict, key: str, line: int) -> None:
    if key not in record:
        raise FileValidationError(line, key, "missing required field")
    value = record[key]
    if not isinstance(value, str):
        raise FileValidationError(line, key, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise FileValidationError(line, key, "must not be empty")


def _check_messages(messages: object, line: int, field: str = "messages") -> None:
    if not isinstance(messages, list) or not messages:
        raise FileValidationError(line, field, "must be a non-empty list of messages")
    for i, msg in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(msg, dict):
            raise FileValidationError(line, where, "must be an object with role and content")
        role = msg.get("role")
        if role not in ROLES:
            raise FileValidationError(line, f"{where}.role", f"must be one of {', '.join(ROLES)}")
        content = msg.get("content")
        if not isinstance(content, str):
            raise FileValidationError(line, f"{where}.content", "must be a string")
    if not any(m.get("role") == "assistant" for m in messages):
        raise FileValidationError(line, field, "needs at least one assistant message")


def validate_record(record: object, line: int, fmt: str | None) -> str:
    """Check one parsed line against fmt (or detect it); return the line's format."""
    if not isinstance(record, dict):
        raise FileValidationError(line, None, "each line must be a JSON object")
    found = detect_format(record)
    if found is None:
        raise FileValidationError(
            line, None, "unknown record: expected 'messages', 'prompt'/'completion' or "
                        "'prompt'/'chosen'/'rejected'")
    if fmt is not None and found != fmt:
        raise FileValidationError(line, None, f"record is {found} but the file is {fmt}")
    if found == "chat":
        _check_messages(record["messages"], line)
    else:
        for key in FORMAT_KEYS[found]:
            _check_str(record, key, line)
    return found


def validate_jsonl(lines: Iterable[bytes]) -> tuple[str, int]:
    """Validate a JSONL stream; return (format, number of records). Blank lines are skipped."""
    fmt: str | None = None
    count = 0
    for lineno, raw in enumerate(lines, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FileValidationError(lineno, None, "not valid UTF-8") from exc
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FileValidationError(lineno, None, f"invalid JSON ({exc.msg})") from exc
        fmt = validate_record(record, lineno, fmt)
        count += 1
    if fmt is None:
        raise FileValidationError(1, None, "file has no records")
    return fmt, count


def create_file(session: Session, storage: Storage, tenant: Tenant, filename: str,
                src: BinaryIO, max_bytes: int, purpose: str = "fine-tune") -> File:
    """Validate and store an uploaded JSONL file; 413 over max_bytes, 422 on a bad line."""
    src.seek(0, 2)
    size = src.tell()
    if size > max_bytes:
        raise ApiError(413, "file_too_large", f"file is {size} bytes; the limit is {max_bytes}",
                       "file")
    src.seek(0)
    digest = hashlib.sha256()

    def _lines() -> Iterable[bytes]:
        for raw in src:
            digest.update(raw)
            yield raw

    try:
        fmt, count = validate_jsonl(_lines())
    except FileValidationError as exc:
        raise ApiError(422, "invalid_file", str(exc), "file") from exc
    file_id = new_id("file")
    key = f"files/{tenant.id}/{file_id}.jsonl"
    src.seek(0)
    storage.put(key, src)
    row = File(id=file_id, tenant_id=tenant.id, filename=filename[:255] or "upload.jsonl",
               purpose=purpose, format=fmt, bytes=size, line_count=count,
               sha256=digest.hexdigest(), storage_key=key)
    session.add(row)
    session.flush()
    return row


def get_file(session: Session, tenant: Tenant, file_id: str, param: str | None = None) -> File:
    row = session.get(File, file_id)
    if row is None or row.tenant_id != tenant.id or row.deleted_at is not None:
        raise not_found("file", file_id, param)
    return row


def list_files(session: Session, tenant: Tenant, limit: int, after: str | None
               ) -> tuple[list[File], bool]:
    from service.pagination import page_query

    base = select(File).where(File.tenant_id == tenant.id, File.deleted_at.is_(None))
    return page_query(session, File, base, limit, after)


def delete_file(session: Session, storage: Storage, tenant: Tenant, file_id: str) -> File:
    """Soft-delete and drop the blob; 409 while a task that is not finished uses the file."""
    row = get_file(session, tenant, file_id)
    in_use = session.scalar(
        select(Task.id).where(
            (Task.training_file_id == row.id) | (Task.validation_file_id == row.id),
            Task.state.not_in(TASK_TERMINAL)).limit(1))
    if in_use is not None:
        raise conflict(f"file {file_id!r} is used by task {in_use!r} which has not finished",
                       code="file_in_use", param="file_id")
    row.deleted_at = utcnow()
    session.flush()
    storage.delete(row.storage_key)
    return row
