"""Integration: schemathesis fuzzes the app's own OpenAPI document against the app, in process
(ASGI), on the real Postgres and Redis of conftest.py. Every operation gets valid (positive) and
invalid (negative) requests, with random ids and with the ids of a real file, task and job:
no 5xx, every status the app answers is documented for that operation, and every response
matches its documented content type and schema (the error body included).

Bounded: LORAPLEX_SCHEMATHESIS_EXAMPLES examples per operation and mode (default 6)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
EXAMPLES = int(os.environ.get("LORAPLEX_SCHEMATHESIS_EXAMPLES", "6"))
# The dashboard serves HTML pages for a browser; its JSON is exercised by its own tests.
SKIP_PREFIXES = ("/ui",)


def _auth(path: str, tenant_headers: dict, worker: dict) -> dict:
    if path.startswith("/internal/"):
        return worker
    if path in ("/v1/cluster", "/metrics"):
        return {"Authorization": "Bearer test-admin-token"}
    return tenant_headers


def _fuzz(op: Any, strategy: Any, headers: dict, mode: GenerationMode, calls: dict,
          failures: list[str], examples: int = EXAMPLES, want: int | None = None) -> None:
    @settings(max_examples=examples, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case: Any) -> None:
        case.headers = {**(case.headers or {}), **headers}
        if want == 401:
            case.headers = {k: v for k, v in case.headers.items() if k.lower() != "authorization"}
        response = case.call()
        calls["n"] += 1
        if want is not None and response.status_code != want:
            failures.append(f"{op.label} without a key -> {response.status_code}, not {want}")
        key = f"{op.label} {response.status_code}"
        calls["by_status"][key] = calls["by_status"].get(key, 0) + 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (Exception, FailureGroup) as exc:  # noqa: BLE001 - listed by the test
            failures.append(f"{mode.value} {op.label} -> {response.status_code}: "
                            f"{str(exc)[:600]}\n  {case.as_curl_command()[:400]}")

    try:
        run()
    except Unsatisfiable:
        # nothing of the operation can be made invalid (no parameters, no body)
        assert mode is GenerationMode.NEGATIVE, op.label


def test_spec_fuzz_no_5xx_and_responses_conform(app, client, factory):  # noqa: ANN001
    t = factory.tenant()
    file = factory.file(t)
    task = factory.task(t, file["id"])
    job = client.get(f"/v1/tasks/{task['id']}/jobs", headers=t.headers).json()["data"][0]
    real = {"file_id": file["id"], "task_id": task["id"], "job_id": job["id"],
            "fine_tuning_job_id": task["id"]}

    async def no_lifespan(scope: dict, receive: Any, send: Any) -> None:
        # The client fixture already runs the app's lifespan (its background loops); refusing
        # this scope tells schemathesis the app has none, so it starts no second copy.
        if scope["type"] == "lifespan":
            raise RuntimeError("lifespan runs in the client fixture")
        await app(scope, receive, send)

    schema = schemathesis.openapi.from_asgi("/openapi.json", no_lifespan)
    failures: list[str] = []
    calls = {"n": 0, "by_status": {}}
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if not op.path.startswith(SKIP_PREFIXES)]
    assert len(operations) >= 25, [op.label for op in operations]

    for op in operations:
        headers = _auth(op.path, t.headers, factory.worker)
        fixed = {k: v for k, v in real.items() if "{" + k + "}" in op.path}
        runs = [(GenerationMode.POSITIVE, None), (GenerationMode.NEGATIVE, None)]
        if fixed:
            runs.append((GenerationMode.POSITIVE, fixed))
        for mode, path_parameters in runs:
            # a stream (server-sent events) runs for duration_s: keep it to a second
            query = {"duration_s": 1} if "duration_s" in str(op.definition.raw) else None
            strategy = op.as_strategy(generation_mode=mode, path_parameters=path_parameters,
                                      query=query)
            _fuzz(op, strategy, headers, mode, calls, failures)
    # without a key: every operation behind one answers 401, documented, in the error schema
    keyed = 0
    for op in operations:
        security = op.definition.raw.get("security") or []
        if security and {} not in security:  # {}: the key is optional (/metrics)
            _fuzz(op, op.as_strategy(path_parameters={k: v for k, v in real.items()
                                                      if "{" + k + "}" in op.path} or None),
                  {}, GenerationMode.POSITIVE, calls, failures, examples=1, want=401)
            keyed += 1
    assert keyed >= 25, keyed
    print(f"schemathesis: {len(operations)} operations, {calls['n']} calls")  # noqa: T201
    assert calls["n"] >= len(operations) * 2
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:15])


@pytest.mark.parametrize("path", ["/v1/files", "/v1/tasks/{task_id}/events"])
def test_documented_errors_carry_the_error_schema(app, path):  # noqa: ANN001
    doc = app.openapi()
    ops = doc["paths"][path]
    statuses = {s for op in ops.values() for s in op["responses"]}
    assert {"401", "422"} <= statuses
    for op in ops.values():
        for status, entry in op["responses"].items():
            if int(status) >= 400:
                ref = entry["content"]["application/json"]["schema"]["$ref"]
                assert ref == "#/components/schemas/ErrorOut", (path, status)
    detail = doc["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"code", "message", "param"}
    assert {"type", "code", "message", "param"} <= set(detail["properties"])
