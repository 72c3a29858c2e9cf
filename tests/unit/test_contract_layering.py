"""Unit: the packages' one direction of imports (DESIGN.md). The contract imports none of the
others; the service imports neither the worker nor the trainer; the worker, the trainer and the
kernels import no service module; the kernels import nothing of the project. Read from the
source (every import statement, lazy ones inside functions included), not by importing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROJECT = ("contract", "service", "worker", "trainer", "kernels")
# package -> the project packages it must never import
FORBIDDEN = {
    "contract": {"service", "worker", "trainer", "kernels"},
    "service": {"worker", "trainer", "kernels"},
    "worker": {"service"},
    "trainer": {"service", "worker"},
    "kernels": {"contract", "service", "worker", "trainer"},
}


def imported(path: Path) -> set[str]:
    """The top-level project packages a module imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names} & set(PROJECT)
    return found


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_imports_flow_one_way(package: str) -> None:
    bad = {str(p.relative_to(REPO)): sorted(imported(p) & FORBIDDEN[package])
           for p in sorted((REPO / package).rglob("*.py"))}
    assert {k: v for k, v in bad.items() if v} == {}


# ----- the service's floors: core < the domain (service/ top level and its packages) < api ------

def _floor(module: str) -> int:
    parts = module.split(".")
    return {"core": 0, "api": 2}.get(parts[1], 1) if len(parts) > 1 else 1


def service_imports(path: Path) -> set[str]:
    """The service modules (or names of them) a module imports, as dotted paths."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in found if n.startswith("service.")}


def test_service_floors_import_downwards() -> None:
    """service.core imports nothing else of the service; the domain imports nothing of
    service.api (so a domain function never depends on the HTTP layer)."""
    up = {}
    for path in sorted((REPO / "service").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        higher = sorted(n for n in service_imports(path) if _floor(n) > _floor(module))
        if higher:
            up[module] = higher
    assert up == {}
    assert _floor("service.core.db") < _floor("service.tasks") < _floor("service.api.app")
