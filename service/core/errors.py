"""API errors and the exception handlers that render every failure as
``{"error": {"type", "code", "message", "param"}}`` with the right status (never a 500 for bad
input). ``type`` is the class of error as OpenAI's API names it (invalid_request_error,
authentication_error, permission_error, rate_limit_error, server_error; every other 4xx is an
invalid_request_error, 404 and 409 included, as there); ``code`` is loraplex's precise reason."""

from __future__ import annotations

import logging
import re
from functools import lru_cache

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("loraplex.api")

# PostgreSQL's deadlock_detected and serialization_failure: the transaction was rolled back.
TRANSIENT_SQLSTATES = ("40P01", "40001")


class ApiError(Exception):
    """An error the client caused (or can act on); raised by service functions."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param


def not_found(what: str, ident: str, param: str | None = None) -> ApiError:
    return ApiError(404, "not_found", f"{what} {ident!r} not found", param)


def invalid(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(422, code, message, param)


def conflict(message: str, code: str = "conflict", param: str | None = None) -> ApiError:
    return ApiError(409, code, message, param)


ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def error_type(status: int) -> str:
    """The OpenAI-style class of an error of this HTTP status."""
    if status >= 500:
        return "server_error"
    return ERROR_TYPES.get(status, "invalid_request_error")


def error_body(code: str, message: str, param: str | None = None, status: int = 400) -> dict:
    return {"error": {"type": error_type(status), "code": code, "message": message,
                      "param": param}}


_SOURCES = ("body", "query", "path", "header", "form")
# pydantic names the member of a union that failed (`batch_size.int`, `lr.list[float]`): not a
# field, so never part of the param.
_UNION_TAG = re.compile(r"[a-z-]+\[.*\]|int|float|str|bool|none|dict|list")


def _field_parts(loc: tuple | list) -> list:
    return [p for p in loc if p not in _SOURCES
            and not (isinstance(p, str) and _UNION_TAG.fullmatch(p))]


def _loc_to_param(loc: tuple | list) -> str | None:
    """The field a validation error is about, as the hosted APIs name it: dotted names without
    list positions (``search_space.learning_rate``, not ``search_space.learning_rate.0``)."""
    parts = [str(p) for p in _field_parts(loc) if not isinstance(p, int)]
    return ".".join(parts) or None


loc_to_param = _loc_to_param  # the OpenAI surface names its params alike (service.api.openai_compat)


def _loc_to_text(loc: tuple | list) -> str | None:
    """The exact place of a validation error, list positions included (``lora_rank[1]``)."""
    text = ""
    for p in _field_parts(loc):
        if isinstance(p, int):
            text += f"[{p}]"
        else:
            text += f".{p}" if text else str(p)
    return text or None


def allowed_methods(request: Request, named: str) -> str:
    """The `Allow` of a 405: every method the API's schema lists for the request's path.
    Starlette names only the first route whose path matched (`named`), and a path's methods are
    often separate routes (GET and DELETE /v1/files/{id}). A path the schema leaves out (the
    dashboard's pages) keeps `named`."""
    methods: set[str] = set()
    for template, ops in request.app.openapi().get("paths", {}).items():
        if _path_regex(template).fullmatch(request.url.path):
            methods |= {m.upper() for m in ops if m in _HTTP_METHODS}
    return ", ".join(sorted(methods)) if methods else named


_HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


@lru_cache(maxsize=512)
def _path_regex(template: str) -> re.Pattern[str]:
    return re.compile(re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)))


def install_error_handlers(app: FastAPI) -> None:
    """Route ApiError, HTTPException, validation errors and crashes to the JSON error shape."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.code, exc.message, exc.param, exc.status),
                            status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = first.get("loc", ())
        param = _loc_to_param(loc)
        msg = str(first.get("msg", "invalid request"))
        if len(errors) > 1:
            msg += f" (and {len(errors) - 1} more)"
        return JSONResponse(error_body("invalid_request", f"{_loc_to_text(loc) or 'request'}: "
                                       f"{msg}", param, 422), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                 405: "method_not_allowed", 409: "conflict", 413: "too_large"}
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            headers = {**(headers or {}),
                       "Allow": allowed_methods(request, (headers or {}).get("Allow", ""))}
        return JSONResponse(error_body(codes.get(exc.status_code, "error"), str(exc.detail),
                                       status=exc.status_code),
                            status_code=exc.status_code, headers=headers)

    @app.exception_handler(DataError)
    async def _data(request: Request, exc: DataError) -> JSONResponse:
        # The database refused a value the schemas let through (a NUL byte, an out-of-range
        # number): the client's input, so a 422 rather than a crash.
        log.info("rejected value path=%s error=%s", request.url.path, exc.orig)
        return JSONResponse(error_body("invalid_value", "a value is not storable (out of range "
                                       "or containing NUL bytes)", status=422), status_code=422)

    @app.exception_handler(IntegrityError)
    async def _integrity(request: Request, exc: IntegrityError) -> JSONResponse:
        # Only reachable through a race the functions did not resolve themselves: transient,
        # and every endpoint is retry-safe, so ask the client to retry.
        log.warning("integrity conflict path=%s error=%s", request.url.path, exc.orig)
        return JSONResponse(error_body("concurrent_change", "the request raced a concurrent "
                                       "change; retry", status=503), status_code=503,
                            headers={"Retry-After": "1"})

    @app.exception_handler(OperationalError)
    async def _db_down(request: Request, exc: OperationalError) -> JSONResponse:
        if getattr(exc.orig, "sqlstate", None) in TRANSIENT_SQLSTATES:
            # A deadlock or serialization failure rolled the request back: nothing changed and
            # the database is fine, so say so and let the client retry at once.
            log.warning("transaction rolled back path=%s error=%s", request.url.path, exc.orig)
            return JSONResponse(error_body("concurrent_change", "the request raced a "
                                           "concurrent change and changed nothing; retry",
                                           status=503), status_code=503,
                                headers={"Retry-After": "1"})
        log.error("database unavailable path=%s error=%s", request.url.path, exc.orig)
        return JSONResponse(error_body("unavailable", "the database is unavailable; retry",
                                       status=503), status_code=503, headers={"Retry-After": "5"})

    @app.exception_handler(RedisError)
    async def _redis_down(request: Request, exc: RedisError) -> JSONResponse:
        log.error("redis unavailable path=%s error=%s", request.url.path, exc)
        return JSONResponse(error_body("unavailable", "the queue is unavailable; retry",
                                       status=503), status_code=503, headers={"Retry-After": "5"})

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error path=%s", request.url.path)
        return JSONResponse(error_body("internal_error", "internal server error", status=500),
                            status_code=500)
