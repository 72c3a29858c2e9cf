"""Integration: Schemathesis's full engine (what `schemathesis run` does) over the app's own
OpenAPI document, in process (ASGI), on the real Postgres and Redis of conftest.py. Every phase
it runs offline (probing, schema analysis, examples, coverage, fuzzing, and stateful sequences
over the links it infers from the schema and from Location headers: the schema declares none)
and every check, in three runs: the tenant's routes with a tenant key (its file, task and jobs
exist, so real ids are drawn too), /internal/v1 with the worker token, the admin routes with
the admin token. Together they cover every operation of the schema; zero findings.

A schema-valid request may get an error status only where the schema documents why for that
operation (service.api.error_docs.REASONS, or the route's own description): ALLOWED says which,
and a test checks that the document carries the reason.

LORAPLEX_SCHEMATHESIS_EXAMPLES: examples per operation and phase (default 25);
LORAPLEX_SCHEMATHESIS_SEED: the run's seed (default fixed, so CI is repeatable)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, events, from_schema

from service.api.error_docs import ERROR_DESCRIPTIONS, REASONS

EXAMPLES = int(os.environ.get("LORAPLEX_SCHEMATHESIS_EXAMPLES", "25"))
SEED = int(os.environ.get("LORAPLEX_SCHEMATHESIS_SEED", "43"))
ADMIN_TOKEN = "test-admin-token"  # conftest's settings
ADMIN_PATHS = ("/v1/cluster", "/metrics")

# positive_data_acceptance's own defaults (a 5xx is not_a_server_error's to report)
ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]
# (method, path) -> (the statuses a schema-valid request may get beyond the defaults, why).
ALLOWED: dict[tuple[str, str], tuple[set[int], str]] = {
    ("POST", "/v1/files"): ({422}, "the upload's bytes must be JSONL records of one format or a "
                                   "PEFT archive; base_model only with purpose adapter"),
    ("POST", "/v1/tasks"): ({422}, "the registered models, the operator's limits and the named "
                                   "files' formats are not in the schema (an unknown file: 404)"),
    ("POST", "/v1/fine_tuning/jobs"): ({422}, "as POST /v1/tasks"),
    ("POST", "/v1/webhooks"): ({422}, "the url must resolve to public addresses (DNS, policy)"),
    ("PATCH", "/v1/webhooks/{webhook_id}"): ({422}, "as POST /v1/webhooks"),
    ("GET", "/v1/usage"): ({422}, "start after end"),
}
# Real ids beside random ones: the engine also reuses the ids it reads in answers, but a
# fine-tuning job's id is its task's, which it cannot guess.
REAL_ID_SHARE = 0.25
# Streams run for duration_s (up to 600 s): a second is enough to check one.
STREAM_PARAMETERS = {"/ui/v1/tasks/{task_id}/live": {"query.duration_s": 1}}


def _operations_config() -> list[dict]:
    ops = []
    for (method, path), (statuses, _why) in ALLOWED.items():
        expected = [*ACCEPTED, *map(str, sorted(statuses))]
        ops.append({"include-path": path, "include-method": method,
                    "checks": {"positive_data_acceptance": {"expected-statuses": expected}}})
    for path, parameters in STREAM_PARAMETERS.items():
        ops.append({"include-path": path, "parameters": parameters})
    return ops


@dataclass
class Run:
    """What one engine run saw."""

    findings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    calls: int = 0
    labels: set[str] = field(default_factory=set)  # operations that got a response
    ok: set[str] = field(default_factory=set)  # operations that got a 2xx
    checks: Counter = field(default_factory=Counter)  # check name -> times run
    phases: dict[str, str] = field(default_factory=dict)  # phase -> "ran" or why skipped
    transitions: int = 0
    by_phase: Counter = field(default_factory=Counter)  # phase -> calls


def _record(run: Run, event: events.ScenarioFinished) -> None:
    rec = event.recorder
    for case_id, node in rec.cases.items():
        interaction = rec.interactions.get(case_id)
        if interaction is None or interaction.response is None:
            continue
        run.calls += 1
        run.by_phase[event.phase.value] += 1
        label = node.value.operation.label
        run.labels.add(label)
        if 200 <= interaction.response.status_code < 300:
            run.ok.add(label)
    for case_id, checks in rec.checks.items():
        for check in checks:
            run.checks[check.name] += 1
            if check.status != Status.FAILURE:
                continue
            case = rec.cases[case_id].value
            response = rec.interactions[case_id].response if case_id in rec.interactions else None
            failure = check.failure_info.failure if check.failure_info else None
            run.findings.append(
                f"[{event.phase.value}] {case.operation.label} {check.name} -> "
                f"{response.status_code if response else None}: "
                f"{failure.title if failure else ''} {str(failure.message if failure else '')[:300]}"
                f"\n  {case.method} {case.formatted_path} query={case.query} "
                f"body={str(case.body)[:300]}\n  answer: "
                f"{(response.content or b'')[:300] if response else None!r}")


def _engine(app: Any, headers: dict, exclude: str, real: dict[str, list[str]]) -> Run:
    """One run of the engine over the operations whose path `exclude` does not match (an
    `include` filter would be OR-ed with the operations config's include-path entries); a
    path parameter named in `real` takes one of its ids now and then (REAL_ID_SHARE)."""
    async def no_lifespan(scope: dict, receive: Any, send: Any) -> None:
        # The client fixture already runs the app's lifespan (its background loops); refusing
        # this scope tells schemathesis the app has none, so it starts no second copy.
        if scope["type"] == "lifespan":
            raise RuntimeError("lifespan runs in the client fixture")
        await app(scope, receive, send)

    config = SchemathesisConfig.from_dict({
        "seed": SEED, "headers": headers, "workers": 1,
        "dictionaries": {name: {"values": ids} for name, ids in real.items()},
        "parameters": {f"path.{name}": {"dictionary": name, "probability": REAL_ID_SHARE}
                       for name in real},
        "generation": {"max-examples": EXAMPLES},
        "checks": {"enabled": True},
        "phases": {"stateful": {"inference": {
            "algorithms": ["location-headers", "dependency-analysis"]}}},
        "operations": _operations_config(),
    })
    schema = schemathesis.openapi.from_asgi("/openapi.json", no_lifespan, config=config)
    schema = schema.exclude(path_regex=exclude)
    run = Run()
    for event in from_schema(schema).execute():
        if isinstance(event, events.PhaseStarted):
            run.phases[event.phase.name.value] = (
                "ran" if event.phase.is_enabled else str(event.phase.skip_reason))
            if event.payload is not None:
                run.transitions = event.payload.transitions_selected
        elif isinstance(event, events.ScenarioFinished):
            _record(run, event)
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            run.errors.append(repr(event)[:1000])
    return run


def _documented(doc: dict) -> set[str]:
    return {f"{method.upper()} {path}" for path, ops in doc["paths"].items() for method in ops}


def _report(name: str, run: Run) -> str:
    return (f"{name}: {len(run.labels)} operations, {run.calls} calls, stateful transitions "
            f"{run.transitions}, calls by phase {dict(run.by_phase)}, phases {run.phases}, checks {dict(run.checks)}")


def test_full_engine_every_operation_zero_findings(app, client, factory):  # noqa: ANN001
    tenant = factory.tenant()
    file = factory.file(tenant)
    task = factory.task(tenant, file["id"])
    # an endpoint on this host (no DNS here): allowed for its create only
    app.state.settings.webhook_allow_private = True
    webhook = client.post("/v1/webhooks", headers=tenant.headers, json={
        "url": "http://127.0.0.1:9/hook", "event_types": ["task.succeeded"]}).json()
    app.state.settings.webhook_allow_private = False
    job = client.get(f"/v1/tasks/{task['id']}/jobs", headers=tenant.headers).json()["data"][0]
    # a fine-tuning job's id is its task's
    real = {"file_id": [file["id"]], "task_id": [task["id"]], "job_id": [job["id"], task["id"]],
            "webhook_id": [webhook["id"]]}
    admin = "(" + "|".join(ADMIN_PATHS) + ")$"
    runs = {
        "tenant": _engine(app, tenant.headers, f"^/internal/|^{admin}", real),
        "worker": _engine(app, factory.worker, "^(?!/internal/)", real),
        "admin": _engine(app, {"Authorization": f"Bearer {ADMIN_TOKEN}"}, f"^(?!{admin})", {}),
    }
    for name, run in runs.items():
        print(_report(name, run), sorted(run.ok))  # noqa: T201

    for name, run in runs.items():
        assert not run.errors, (name, run.errors)
        assert not run.findings, f"{name}: {len(run.findings)} findings:\n" + "\n".join(
            run.findings[:20])
    # every operation of the document answered; no route left out
    seen = set().union(*(run.labels for run in runs.values()))
    assert _documented(app.openapi()) <= seen, sorted(_documented(app.openapi()) - seen)
    tenant_run, worker_run = runs["tenant"], runs["worker"]
    for phase in ("examples", "coverage", "fuzzing", "stateful"):
        assert tenant_run.phases.get(phase) == "ran", tenant_run.phases
    assert tenant_run.transitions >= 50 and worker_run.transitions >= 1
    for check in ("not_a_server_error", "status_code_conformance", "content_type_conformance",
                  "response_schema_conformance", "response_headers_conformance",
                  "positive_data_acceptance", "negative_data_rejection", "ignored_auth",
                  "unsupported_method", "missing_required_header"):
        assert tenant_run.checks[check] > 0, (check, dict(tenant_run.checks))
    # the tenant's own resources were read with their real ids, not only 404s
    for name, labels in (
            ("tenant", ("GET /v1/files/{file_id}", "GET /v1/tasks/{task_id}",
                        "GET /v1/tasks/{task_id}/jobs", "GET /v1/jobs/{job_id}",
                        "GET /v1/fine_tuning/jobs/{job_id}", "GET /v1/webhooks/{webhook_id}")),
            ("worker", ("POST /internal/v1/nodes", "POST /internal/v1/nodes/{node_id}/heartbeat",
                        "GET /internal/v1/files/{file_id}/content"))):
        missing = set(labels) - runs[name].ok
        assert not missing, (name, missing, sorted(runs[name].ok))


@pytest.mark.parametrize(("method", "path"), sorted(ALLOWED))
def test_allowed_refusals_are_documented_with_their_reason(app, method, path):  # noqa: ANN001
    """What the engine lets a schema-valid request get, the schema documents with the why (not
    the generic line), from error_docs.REASONS or the route's own responses=."""
    op = app.openapi()["paths"][path][method.lower()]
    statuses, _why = ALLOWED[(method, path)]
    for status in statuses:
        described = op["responses"][str(status)]["description"]
        assert described != ERROR_DESCRIPTIONS[status], (method, path, status)
        assert described == REASONS.get((method.lower(), path), {}).get(status, described)


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



def test_no_response_schema_mixes_a_ref_with_other_keywords(app):  # noqa: ANN001
    """A route's response_model beside a responses= model of the same status documents both at
    once ({$ref, anyOf}: what the route answers fits neither)."""
    mixed = [(method, path, status) for path, ops in app.openapi()["paths"].items()
             for method, op in ops.items() for status, entry in op["responses"].items()
             for body in entry.get("content", {}).values()
             if "$ref" in body.get("schema", {}) and len(body["schema"]) > 1]
    assert not mixed
