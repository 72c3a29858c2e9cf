"""Unit: the house rules that keep the code in rooms (issue 34), read from the source with `ast`
(test_contract_layering keeps the packages' and the service floors' import directions): no
module imports itself through others (no import circle, lazy imports and TYPE_CHECKING ones
counted); no file outside the kernels and the tests is over 500 lines; no module docstring is
over 40; no private name imported from another module; no executor handed to a task as `Any`."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("contract", "service", "worker", "trainer", "kernels", "bench")
MAX_LINES = 500


def modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = modules()


def imports_of(name: str, path: Path) -> set[str]:
    """The project modules `name` imports anywhere in its file (resolved to the longest module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def top(name: str) -> str:
    return name.split(".")[0]


def test_the_graph_is_read_from_real_imports() -> None:
    assert "contract.protocol" in GRAPH["worker.runner"]
    assert "trainer.executor" in GRAPH["trainer.launch"]


def test_no_import_circle() -> None:
    # Tarjan's strongly connected components: a component of two or more modules is a circle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert circles == []


def test_no_room_over_500_lines() -> None:
    long = sorted(f"{p.relative_to(REPO)}: {n}" for name, p in MODULES.items()
                  if top(name) != "kernels" and (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert long == []


def test_module_docstrings_are_short_enough_to_read() -> None:
    # a module that needs more than 40 lines to introduce itself is several modules; the detail
    # belongs with the functions it describes
    long = sorted(f"{p.relative_to(REPO)}: {n}" for p in MODULES.values()
                  if (doc := ast.get_docstring(ast.parse(p.read_text()), clean=False))
                  and (n := doc.count("\n") + 1) > 40)
    assert long == []


PRODUCT = ("contract", "service", "worker", "trainer")


def test_no_private_name_imported_across_modules() -> None:
    # a name another module needs is part of its module's interface: public, so a reader (and a
    # refactoring tool) sees the dependency
    found = []
    for name, path in MODULES.items():
        if top(name) not in PRODUCT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and top(node.module) in PACKAGES:
                found += [f"{path.relative_to(REPO)}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


def test_no_host_typed_any() -> None:
    # what a task uses of its executor is a Protocol (trainer.task_parts.TaskHost), not Any
    found = []
    for name, path in MODULES.items():
        if top(name) not in PRODUCT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            pairs = []
            if isinstance(node, ast.arg):
                pairs = [(node.arg, node.annotation)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                pairs = [(node.target.id, node.annotation)]
            found += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n, ann in pairs
                      if n == "host" and isinstance(ann, ast.Name) and ann.id == "Any"]
    assert found == []
