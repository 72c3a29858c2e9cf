"""Downloads of stored archives (adapters, merged models): one response for a seekable file of
known size that honours a single-range `Range: bytes=...` (206 with Content-Range; 416 past the
end) and `If-Range`, so a client resumes a large download where it broke off."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import BinaryIO

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from service.core.errors import error_body
from service.core.storage import CHUNK

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def byte_range(header: str | None, size: int) -> tuple[int, int] | None | bool:
    """The inclusive (start, end) a Range header asks of `size` bytes; None to send it all (no
    header, another unit, several ranges or bad syntax: RFC 9110 lets a server ignore those);
    False when it asks only past the end (416)."""
    if not header:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None or match.group(1) == match.group(2) == "":
        return None
    first, last = match.group(1), match.group(2)
    if first == "":  # the last N bytes
        n = int(last)
        return (max(size - n, 0), size - 1) if n > 0 and size > 0 else False
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if last and int(last) < start:
        return None
    return (start, end) if start < size else False


def file_response(request: Request, src: BinaryIO, size: int, media_type: str, filename: str,
                  etag: str) -> Response:
    """Stream `src` (seekable, closed when the response ends) as an attachment; the whole of it
    (200) or the one range the request asks for (206). `etag` must change with the bytes."""
    headers = {"Accept-Ranges": "bytes", "ETag": etag,
               "Content-Disposition": f'attachment; filename="{filename}"'}
    wanted = byte_range(request.headers.get("range"), size)
    if_range = request.headers.get("if-range")
    if wanted is not None and if_range is not None and if_range != etag:
        wanted = None  # the client holds other bytes: send them all again
    if wanted is False:
        src.close()
        return JSONResponse(error_body("range_not_satisfiable", f"the archive has {size} bytes",
                                       "Range", 416), status_code=416,
                            headers={**headers, "Content-Range": f"bytes */{size}"})
    start, end = wanted if wanted else (0, size - 1)
    headers["Content-Length"] = str(end - start + 1)
    status = 200
    if wanted:
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    return StreamingResponse(_read(src, start, end - start + 1), status_code=status,
                             media_type=media_type, headers=headers)


def _read(src: BinaryIO, start: int, length: int) -> Iterator[bytes]:
    with src:
        src.seek(start)
        while length > 0:
            block = src.read(min(CHUNK, length))
            if not block:
                return
            length -= len(block)
            yield block
