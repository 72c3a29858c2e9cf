"""Unit: openapi.yaml matches the app, and contract/protocol.py imports nothing beyond pydantic
and the stdlib (the GPU worker imports it without the service's dependencies)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("fastapi")


def test_openapi_yaml_is_up_to_date() -> None:
    from service.api.openapi import OPENAPI_PATH, render

    assert OPENAPI_PATH.read_text() == render(), "run: python -m service.api.openapi"


def test_contract_imports_only_pydantic() -> None:
    code = ("import sys, pkgutil, importlib, contract; "
            "[importlib.import_module('contract.' + m.name) "
            "for m in pkgutil.iter_modules(contract.__path__)]; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('fastapi', 'sqlalchemy', "
            "'redis', 'rq', 'starlette', 'torch', 'service', 'worker', 'trainer', 'kernels')]; "
            "print(sorted(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_every_route_is_documented() -> None:
    from service.api.openapi import render

    doc = render()
    for path in ("/v1/files", "/v1/tasks/{task_id}/events", "/v1/jobs/{job_id}/adapter",
                 "/internal/v1/placements/{placement_id}/claim", "/readyz", "/v1/cluster"):
        assert f"  {path}:" in doc
