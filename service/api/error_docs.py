"""The error responses of the API's documentation: every operation's error statuses, inferred
from its parameters, body and security, each with the error body schema (ErrorOut); `errors`
for a route's own `responses=`, `document_errors` for the app."""

from __future__ import annotations

from typing import Any

ERROR_DESCRIPTIONS = {
    400: "Malformed request",
    401: "Missing or invalid API key / token",
    404: "Not found (or another tenant's)",
    409: "Conflicts with the resource's state",
    413: "Body over the size limit",
    422: "Invalid request: `param` names the field",
    429: "Over the tenant's limit",
    503: "Database or queue unavailable; retry (Retry-After)",
}

# Statuses the rules of add_error_responses do not infer: (method, path) -> statuses.
EXTRA_ERRORS: dict[tuple[str, str], set[int]] = {
    ("post", "/v1/tasks"): {429},  # the tenant's queued-task limit
    ("post", "/internal/v1/tasks/{task_id}/artifacts"): {413},
    ("get", "/v1/tasks/{task_id}/adapter"): {409},  # not succeeded (yet)
    ("get", "/v1/tasks/{task_id}/merged/content"): {409},  # not merged (yet), or failed
}

# What a schema cannot state: the error statuses a schema-valid request can still get, and why
# (each description replaces the status's generic one; a route may also give its own, as
# POST /v1/files does). The schemathesis test allows a schema-valid request only such statuses
# (tests/integration/test_api_schemathesis.py).
_TASK_422 = ("Invalid request: `param` names the field. Also for a body the schema cannot "
             "judge: a {model} the operator has not registered (GET /v1/models), target_modules "
             "the model lacks, a search space over the operator's configuration limit, "
             "max_seq_len over the model's, a priority over the tenant's ceiling, an integration "
             "missing its settings, a file of the wrong format for the method or with too few "
             "records to hold out a validation split, an init_adapter_file that is not a usable "
             "adapter of the tenant's for the model.")
_FILE_404 = ("training_file or validation_file names no file of the tenant's (`param` names "
             "it)")
_URL_422 = ("Invalid request: `param` names the field. Also a url the delivery policy refuses: "
            "not http(s), with credentials, or a host that does not resolve or resolves to a "
            "loopback, private or reserved address (unless the operator allows them).")
REASONS: dict[tuple[str, str], dict[int, str]] = {
    ("post", "/v1/tasks"): {404: _FILE_404, 422: _TASK_422.format(model="base_model")},
    ("post", "/v1/fine_tuning/jobs"): {404: _FILE_404, 422: _TASK_422.format(model="model")},
    ("post", "/v1/webhooks"): {422: _URL_422},
    ("patch", "/v1/webhooks/{webhook_id}"): {422: _URL_422},
    ("get", "/v1/usage"): {422: "Invalid request: `param` names the field; also `start` after "
                                "`end` (`param` start)."},
    ("post", "/internal/v1/tasks/{task_id}/artifacts"): {422: (
        "Invalid request: `param` names the field. Also, once the report is fenced: a job_id "
        "that is not the task's, an adapter without job_id or without adapter_config.json and "
        "a valid adapter_model.safetensors, a checkpoint without step or key, file names that "
        "are not plain or not unique.")},
}

# Operations whose token is optional (without it they answer less).
OPTIONAL_SECURITY = {("get", "/metrics")}


def errors(*statuses: int, descriptions: dict[int, str] | None = None) -> dict[int | str, dict]:
    """`responses=` entries for error statuses, each with the error body schema."""
    from service.schemas import ErrorOut

    descriptions = descriptions or {}
    return {s: {"model": ErrorOut, "description": descriptions.get(s, ERROR_DESCRIPTIONS[s])}
            for s in statuses}


def _error_statuses(method: str, path: str, op: dict) -> set[int]:
    """The error statuses an operation can answer, from its parameters, body and security."""
    params = op.get("parameters", [])
    statuses: set[int] = set()
    if op.get("security"):
        statuses.add(401)
    if any(p.get("in") == "path" for p in params) or any(
            p.get("in") == "query" and p.get("name") == "after"
            and p.get("schema", {}).get("anyOf", [{}])[0].get("type") == "string"
            for p in params):
        statuses |= {404, 422}  # an id that names nothing of the caller's (a cursor too)
        if method in ("post", "delete"):
            statuses.add(409)
    if params or "requestBody" in op:
        statuses.add(422)
    if "requestBody" in op:
        statuses.add(400)  # a body that is not parseable (not UTF-8 JSON / multipart)
    if "multipart/form-data" in op.get("requestBody", {}).get("content", {}):
        statuses.add(413)
    return statuses | EXTRA_ERRORS.get((method, path), set()) | set(REASONS.get((method, path), {}))


def add_error_responses(doc: dict) -> dict:
    """Give every operation of an OpenAPI document the error statuses it can answer, each with
    the error body schema: 400 with a body (unparseable), 401 behind a key or token, 404 with a
    path parameter or a cursor (`after`, an id), 422 with any
    parameter or body, 413 with an upload (the server's limit), 409 for a POST or DELETE on a
    resource, EXTRA_ERRORS and REASONS. What a route declares itself (`responses=`) is kept, but
    for REASONS' descriptions; an error status it declares without a body gets the error
    schema."""
    from service.schemas import ErrorOut

    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in ErrorOut.model_json_schema(
            ref_template="#/components/schemas/{model}").pop("$defs", {}).items():
        schemas.setdefault(name, schema)
    schemas.setdefault("ErrorOut", ErrorOut.model_json_schema(
        ref_template="#/components/schemas/{model}"))
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}}
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            statuses = _error_statuses(method, path, op)
            if (method, path) in OPTIONAL_SECURITY and {} not in op.get("security", [{}]):
                op["security"].append({})
            responses = op.setdefault("responses", {})
            for status in sorted(statuses):
                responses.setdefault(str(status), {"description": ERROR_DESCRIPTIONS[status]})
            for status, entry in list(responses.items()):
                if status.isdigit() and int(status) >= 400:
                    if "HTTPValidationError" in str(entry.get("content")):
                        # FastAPI's default 422 ({"detail": [...]}) is not what the app answers
                        entry.update(description=ERROR_DESCRIPTIONS[422], content=content)
                    entry.setdefault("content", content)
            for status, why in REASONS.get((method, path), {}).items():
                responses[str(status)]["description"] = why
            op["responses"] = dict(sorted(responses.items()))
    if "HTTPValidationError" not in str(doc.get("paths")):
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
    return doc


def document_errors(app: Any) -> None:
    """Serve the app's OpenAPI document with add_error_responses applied."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = add_error_responses(default())
        return app.openapi_schema

    app.openapi = openapi
