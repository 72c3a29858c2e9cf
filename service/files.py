"""Training files: JSONL validation line by line (chat, prompt/completion, text, DPO preference
in two shapes),
storage of the blob, and tenant-scoped list/get/delete."""

from __future__ import annotations

import codecs
import hashlib
import json
from collections.abc import Iterable
from typing import BinaryIO

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from service.adapter_archive import ADAPTER_PURPOSE, AdapterError, inspect_adapter
from service.core.errors import ApiError, conflict, invalid, not_found
from service.core.registry import ModelRegistry
from service.core.storage import Storage
from service.init_adapter import check_upload
from service.models import TASK_TERMINAL, File, Task, Tenant, new_id, utcnow

ROLES = ("system", "user", "assistant", "tool")
FORMATS = ("chat", "completion", "preference", "text")
# Which keys mark each record shape, and the file format each shape belongs to. OpenAI's,
# Together's and Fireworks' preference shape (input / preferred_output / non_preferred_output)
# and loraplex's prompt / chosen / rejected are both "preference" files.
SHAPES = {
    "chat": ({"messages"}, "chat"),
    "preference_io": ({"input", "preferred_output", "non_preferred_output"}, "preference"),
    "preference": ({"chosen", "rejected"}, "preference"),
    "completion": ({"completion"}, "completion"),
    "text": ({"text"}, "text"),
}
FORMAT_KEYS = {
    "preference": ("prompt", "chosen", "rejected"),
    "completion": ("prompt", "completion"),
    "text": ("text",),
}
KNOWN_RECORDS = ("'messages', 'prompt'/'completion', 'text', 'prompt'/'chosen'/'rejected' or "
                 "'input'/'preferred_output'/'non_preferred_output'")


class FileValidationError(ValueError):
    """A bad line: says which line (1-based) and which field."""

    def __init__(self, line: int, field: str | None, reason: str) -> None:
        self.line, self.field, self.reason = line, field, reason
        where = f"line {line}" + (f", field '{field}'" if field else "")
        super().__init__(f"{where}: {reason}")


def detect_shape(record: dict, line: int = 0) -> str | None:
    """The record shape its keys mark (None: none); a line with keys of two shapes is an error."""
    found = [shape for shape, (keys, _) in SHAPES.items() if keys & record.keys()]
    if len(found) > 1:
        raise FileValidationError(line, None, "record mixes the keys of several formats: "
                                  + ", ".join(sorted(set().union(
                                      *(SHAPES[s][0] & record.keys() for s in found)))))
    if found:
        return found[0]
    return "completion" if "prompt" in record else None


def detect_format(record: dict) -> str | None:
    try:
        shape = detect_shape(record)
    except FileValidationError:
        return None
    return None if shape is None else SHAPES[shape][1]


def _check_str(record: dict, key: str, line: int) -> None:
    if key not in record:
        raise FileValidationError(line, key, "missing required field")
    value = record[key]
    if not isinstance(value, str):
        raise FileValidationError(line, key, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise FileValidationError(line, key, "must not be empty")


def _content_text(content: object, line: int, where: str) -> str:
    """A message's text: a string, or a list of text parts ``{"type": "text", "text": ...}``
    (joined, as the hosted APIs do)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FileValidationError(line, where, "must be a string or a list of text parts")
    out = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise FileValidationError(line, f"{where}[{k}]", 'must be {"type": "text", "text": '
                                      '"..."} (only text parts are supported)')
        if not isinstance(part.get("text"), str):
            raise FileValidationError(line, f"{where}[{k}].text", "must be a string")
        out.append(part["text"])
    return "".join(out)


def _check_messages(messages: object, line: int, field: str = "messages",
                    need_trained: bool = True) -> None:
    """Roles, text content (a string or text parts), and ``weight`` (0 or 1, assistant messages
    only). A ``tool`` message, or an assistant message that only calls tools, is context the
    trainer leaves out (tools are ignored); a chat example needs an assistant message with
    text and weight 1."""
    if not isinstance(messages, list) or not messages:
        raise FileValidationError(line, field, "must be a non-empty list of messages")
    trained = False
    for i, msg in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(msg, dict):
            raise FileValidationError(line, where, "must be an object with role and content")
        role = msg.get("role")
        if role not in ROLES:
            raise FileValidationError(line, f"{where}.role", f"must be one of {', '.join(ROLES)}")
        content = msg.get("content")
        if content is None and role == "assistant" and msg.get("tool_calls"):
            continue  # a tool call only: ignored, as tools are
        _content_text(content, line, f"{where}.content")
        if "weight" in msg:
            weight = msg["weight"]
            if role != "assistant":
                raise FileValidationError(line, f"{where}.weight",
                                          "only assistant messages take a weight")
            if isinstance(weight, bool) or weight not in (0, 1):
                raise FileValidationError(line, f"{where}.weight", "must be 0 or 1")
        if role == "assistant" and msg.get("weight", 1) == 1:
            trained = True
    if need_trained and not trained:
        raise FileValidationError(line, field, "needs at least one assistant message with text "
                                               "and weight 1")


def _check_output(record: dict, key: str, line: int) -> None:
    value = record.get(key)
    if key not in record:
        raise FileValidationError(line, key, "missing required field")
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], dict):
        raise FileValidationError(line, key, "must be a list of one assistant message")
    if value[0].get("role") != "assistant":
        raise FileValidationError(line, f"{key}[0].role", "must be assistant")
    text = _content_text(value[0].get("content"), line, f"{key}[0].content")
    if not text.strip():
        raise FileValidationError(line, f"{key}[0].content", "must not be empty")


def validate_record(record: object, line: int, fmt: str | None) -> str:
    """Check one parsed line against fmt (or detect it); return the line's format."""
    if not isinstance(record, dict):
        raise FileValidationError(line, None, "each line must be a JSON object")
    shape = detect_shape(record, line)
    if shape is None:
        raise FileValidationError(line, None, f"unknown record: expected {KNOWN_RECORDS}")
    found = SHAPES[shape][1]
    if fmt is not None and found != fmt:
        raise FileValidationError(line, None, f"record is {found} but the file is {fmt} (a file "
                                              "holds one format)")
    if shape == "chat":
        _check_messages(record["messages"], line)
    elif shape == "preference_io":
        inp = record.get("input")
        if not isinstance(inp, dict):
            raise FileValidationError(line, "input", "must be an object with 'messages'")
        _check_messages(inp.get("messages"), line, "input.messages", need_trained=False)
        _check_output(record, "preferred_output", line)
        _check_output(record, "non_preferred_output", line)
    else:
        for key in FORMAT_KEYS[found]:
            _check_str(record, key, line)
    return found


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def parse_line(text: str, lineno: int) -> object:
    """One JSONL line as JSON; every way it can fail (syntax, NaN, a number past Python's
    4,300-digit limit, nesting deeper than the parser's recursion) names the line."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise FileValidationError(lineno, None, f"invalid JSON ({exc.msg})") from exc
    except RecursionError as exc:
        raise FileValidationError(lineno, None, "invalid JSON (nested too deeply)") from exc
    except ValueError as exc:  # int() digit limit, NaN / Infinity
        reason = "a number is too long" if "digits" in str(exc) else str(exc)
        raise FileValidationError(lineno, None, f"invalid JSON ({reason})") from exc


def validate_jsonl(lines: Iterable[bytes]) -> tuple[str, int]:
    """Validate a JSONL stream; return (format, number of records). Blank lines are skipped; a
    UTF-8 byte order mark at the start is accepted."""
    fmt: str | None = None
    count = 0
    for lineno, raw in enumerate(lines, start=1):
        if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8):]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FileValidationError(lineno, None, "not valid UTF-8") from exc
        if not text.strip():
            continue
        fmt = validate_record(parse_line(text, lineno), lineno, fmt)
        count += 1
    if fmt is None:
        raise FileValidationError(1, None, "file has no records")
    return fmt, count


def create_file(session: Session, storage: Storage, tenant: Tenant, filename: str,
                src: BinaryIO, max_bytes: int, purpose: str = "fine-tune",
                registry: ModelRegistry | None = None, base_model: str | None = None
                ) -> tuple[File, bool]:
    """Validate and store an uploaded file: (the file, whether this upload created it). 413 over
    max_bytes, 422 on a bad line. An adapter (purpose "adapter") is checked against `base_model`
    (a registered model's name) where given, else against the registered models its config
    names (check_upload). Deduplicated by content per tenant: the same bytes with the same
    purpose, validated again, answer the tenant's file that holds them (created False)."""
    src.seek(0, 2)
    size = src.tell()
    if size > max_bytes:
        raise ApiError(413, "file_too_large", f"file is {size} bytes; the limit is {max_bytes}",
                       "file")
    src.seek(0)
    if purpose == ADAPTER_PURPOSE:
        fmt, count, digest = _check_adapter(src, registry, base_model)
    elif base_model is not None:
        raise invalid(f"base_model applies to purpose {ADAPTER_PURPOSE!r} only, not {purpose!r}",
                      param="base_model")
    else:
        fmt, count, digest = _check_jsonl(src)
    # one upload of these bytes at a time per tenant, so two at once make one file
    session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:k))"),
                    {"k": f"files:{tenant.id}:{digest}"})
    same = session.scalar(select(File).where(
        File.tenant_id == tenant.id, File.sha256 == digest, File.purpose == purpose,
        File.bytes == size, File.deleted_at.is_(None)).order_by(File.created_at).limit(1))
    if same is not None:
        return same, False
    file_id = new_id("file")
    key = f"files/{tenant.id}/{file_id}.{'adapter' if fmt == 'adapter' else 'jsonl'}"
    src.seek(0)
    storage.put(key, src)
    default = "adapter.tar.gz" if fmt == "adapter" else "upload.jsonl"
    row = File(id=file_id, tenant_id=tenant.id, filename=filename[:255] or default,
               purpose=purpose, format=fmt, bytes=size, line_count=count, sha256=digest,
               storage_key=key)
    session.add(row)
    session.flush()
    return row, True


def _check_jsonl(src: BinaryIO) -> tuple[str, int, str]:
    """(format, records, sha256) of a JSONL upload; 422 naming the first bad line."""
    digest = hashlib.sha256()

    def _lines() -> Iterable[bytes]:
        for raw in src:
            digest.update(raw)
            yield raw

    try:
        fmt, count = validate_jsonl(_lines())
    except FileValidationError as exc:
        raise ApiError(422, "invalid_file", str(exc), "file") from exc
    return fmt, count, digest.hexdigest()


def _check_adapter(src: BinaryIO, registry: ModelRegistry | None, base_model: str | None
                   ) -> tuple[str, int, str]:
    """A PEFT adapter archive (purpose "adapter"), checked by inspect_adapter and check_upload:
    ("adapter", its number of LoRA modules, sha256)."""
    try:
        info = inspect_adapter(src)
    except AdapterError as exc:
        raise ApiError(422, "invalid_file", f"adapter: {exc}", "file") from exc
    check_upload(info, registry, base_model)
    src.seek(0)
    digest = hashlib.sha256()
    for chunk in iter(lambda: src.read(1 << 20), b""):
        digest.update(chunk)
    return "adapter", len(info.modules), digest.hexdigest()


def get_file(session: Session, tenant: Tenant, file_id: str, param: str | None = None) -> File:
    row = session.get(File, file_id)
    if row is None or row.tenant_id != tenant.id or row.deleted_at is not None:
        raise not_found("file", file_id, param)
    return row


def list_files(session: Session, tenant: Tenant, limit: int, after: str | None
               ) -> tuple[list[File], bool]:
    from service.core.pagination import page_query

    base = select(File).where(File.tenant_id == tenant.id, File.deleted_at.is_(None))
    return page_query(session, File, base, limit, after)


def delete_file(session: Session, storage: Storage, tenant: Tenant, file_id: str) -> File:
    """Soft-delete and drop the blob; 409 while a task that is not finished uses the file."""
    row = get_file(session, tenant, file_id)
    in_use = session.scalar(
        select(Task.id).where(
            (Task.training_file_id == row.id) | (Task.validation_file_id == row.id)
            | (Task.init_adapter_file_id == row.id),
            Task.state.not_in(TASK_TERMINAL)).limit(1))
    if in_use is not None:
        raise conflict(f"file {file_id!r} is used by task {in_use!r} which has not finished",
                       code="file_in_use", param="file_id")
    row.deleted_at = utcnow()
    session.flush()
    storage.delete(row.storage_key)
    return row
