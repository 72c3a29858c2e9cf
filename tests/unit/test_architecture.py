"""Unit: the house rules that keep the code in rooms (issue 34), read from the source with `ast`
(test_contract_layering keeps the packages' and the service floors' import directions): no
module imports itself through others (no import circle, lazy imports and TYPE_CHECKING ones
counted); no product file is over 450 lines (a bench 500, the kernels apart); no module docstring is
over 40; no private name imported from another module; no executor handed to a task as `Any`; no
thread built outside contract.background; no trainer class built on a mixin (a base that reads
through `self` what only a subclass sets)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("contract", "service", "worker", "trainer", "kernels", "bench")
MAX_LINES = 450


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


def test_no_room_over_450_lines() -> None:
    # product files at most 450 lines (issue 42), the benches at most 500; the kernels apart
    limit = {"bench": 500}
    long = sorted(f"{p.relative_to(REPO)}: {n}" for name, p in MODULES.items()
                  if top(name) != "kernels"
                  and (n := len(p.read_text().splitlines())) > limit.get(top(name), MAX_LINES))
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


def test_no_executor_typed_any() -> None:
    # what a task uses of its executor is a Protocol (trainer.task_parts.TaskExecutor), not Any
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
                      if n in ("host", "executor") and isinstance(ann, ast.Name) and ann.id == "Any"]
    assert found == []


def test_one_background_thread_primitive() -> None:
    # a thread of the product's own is a contract.background.BackgroundWorker (start, stop,
    # crash-restart with backoff, health; issue 42): threading.Thread is built there alone,
    # neither called (threading.Thread, Thread imported from threading) nor subclassed elsewhere
    found = []
    for name, path in MODULES.items():
        if top(name) not in (*PRODUCT, "kernels") or name == "contract.background":
            continue
        tree = ast.parse(path.read_text())
        aliases = {"threading.Thread"} | {
            a.asname or a.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "threading"
            for a in node.names if a.name == "Thread"}
        for node in ast.walk(tree):
            used = [node.func] if isinstance(node, ast.Call) else (
                node.bases if isinstance(node, ast.ClassDef) else [])
            found += [f"{path.relative_to(REPO)}:{node.lineno}" for u in used if ast.unparse(u) in aliases]
    assert found == []


def test_a_graph_capture_leaves_other_threads_free() -> None:
    # every CUDA-graph capture of the product names a capture mode that checks its own thread
    # alone ("thread_local" or "relaxed"): under the default ("global") the task's writer thread,
    # waiting on a snapshot's event while the samples' decode captured its token step, failed
    # with "operation not permitted when stream is capturing" and the task with it (H100, session 30)
    # (trainer.graph_parts.capturing: the product's capture, named `mode` there, its third argument);
    # a capture begun anywhere else is found too
    found, captures = [], 0
    for name, path in MODULES.items():
        if top(name) not in (*PRODUCT, "kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            called = ast.unparse(node.func)
            if called.endswith(".capture_begin") and not (
                    name == "trainer.graph_parts" and called == "g.cuda_graph.capture_begin"):
                # (capturing's entry without a sync begins torch.cuda.graph's own capture, in its mode)
                found.append(f"{path.relative_to(REPO)}:{node.lineno} begins a capture of its own")
            if name == "trainer.graph_parts" and called == "torch.cuda.graph":
                continue  # capturing's own (its callers are checked)
            if called in ("torch.cuda.graph", "torch.cuda.graphs.graph", "capturing", "_capturing"):
                captures += 1
                mode = next((k.value for k in node.keywords if k.arg in ("capture_error_mode", "mode")),
                            node.args[2] if "capturing" in called and len(node.args) > 2 else None)
                if not (isinstance(mode, ast.Constant) and mode.value in ("thread_local", "relaxed")):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert captures >= 2 and found == []


def _declared_states() -> dict[str, set[str]]:
    """Every value of a StrEnum declared in contract/states.py and worker/host.py (HostState),
    with the file that declares it."""
    out: dict[str, set[str]] = {}
    for rel in ("contract/states.py", "worker/host.py"):
        for node in ast.walk(ast.parse((REPO / rel).read_text())):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "") == "StrEnum" for b in node.bases):
                out.setdefault(rel, set()).update(
                    s.value.value for s in node.body if isinstance(s, ast.Assign)
                    and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str))
    return out


def test_no_state_or_exit_reason_string_outside_its_declaration() -> None:
    # a state or an exit reason is written by its enum member: compared, assigned, passed as
    # state= / exit_reason=, or put in a dict under "state" / "exit_reason"
    declared = _declared_states()
    values = set().union(*declared.values())
    stateful = ("state", "reason")

    def about_state(node: ast.AST) -> bool:
        return any(w in ast.unparse(node).lower() for w in stateful)

    found = []
    for name, path in MODULES.items():
        rel = str(path.relative_to(REPO))
        if top(name) not in PRODUCT:
            continue
        tree = ast.parse(path.read_text())
        tree.body = [n for n in tree.body if not (isinstance(n, ast.ClassDef) and any(
            getattr(b, "id", "") == "StrEnum" for b in n.bases))]  # the declarations themselves
        for node in ast.walk(tree):
            literals: list[ast.AST] = []
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                for k, side in enumerate(sides):
                    others = sides[:k] + sides[k + 1:]
                    elts = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
                    if any(about_state(o) for o in others):
                        literals += elts
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "ExitDecision" and node.args:
                literals.append(node.args[0])  # its reason
            elif isinstance(node, ast.keyword) and node.arg in ("state", "exit_reason"):
                literals.append(node.value)
            elif isinstance(node, ast.Assign) and about_state(node.targets[0]):
                literals.append(node.value)
            elif isinstance(node, ast.Dict):
                literals += [v for k, v in zip(node.keys, node.values, strict=True)
                             if isinstance(k, ast.Constant) and k.value in ("state", "exit_reason")]
            found += [f"{rel}:{lit.lineno} {lit.value!r}" for lit in literals
                      if isinstance(lit, ast.Constant) and lit.value in values]
    assert found == []


TRAINER_CLASSES = {f"{name}.{node.name}": node for name, path in MODULES.items() if top(name) == "trainer"
                   for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}
INTERFACE_BASES = {"Protocol", "ABC", "Exception", "Enum", "StrEnum", "IntEnum", "NamedTuple", "Generic"}
# mixins still in the trainer, each with why it stays: none (issue 42: the executor's, TaskRun's
# and the engine's are components now); the check below fails on any other, and on an entry here
# that is no mixin any more
KNOWN_MIXINS: dict[str, str] = {}


def _base_names(node: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]


def _trainer_class(name: str, module: str) -> str | None:
    """The trainer class a base name of `module` refers to (its own module first)."""
    if f"{module}.{name}" in TRAINER_CLASSES:
        return f"{module}.{name}"
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and top(node.module) == "trainer":
            if any((a.asname or a.name) == name for a in node.names):
                return f"{node.module}.{name}" if f"{node.module}.{name}" in TRAINER_CLASSES else None
    return None


def _own_names(qual: str) -> set[str]:
    """What a class gives itself: its methods, class attributes, `self.x =` assignments, and
    those of its trainer bases."""
    node, module = TRAINER_CLASSES[qual], qual.rpartition(".")[0]
    own: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            own.add(item.name)
        elif isinstance(item, ast.Assign):
            own |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and item.value is not None and isinstance(item.target, ast.Name):
            own.add(item.target.id)
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
            sub, ast.AnnAssign | ast.AugAssign) else []
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    own.add(el.attr)
    for base in _base_names(node):
        if (found := _trainer_class(base, module)) is not None:
            own |= _own_names(found)
    return own


def mixins() -> dict[str, set[str]]:
    """Trainer classes that reach through `self` into what a subclass gives them (attributes
    they read and never set, a subclass's state): a half of a class, not a class. Interfaces
    (Protocol, ABC), exceptions, enums and dataclasses are not; nor is a base class that is
    whole (an objective's base, the engine a DPO engine extends)."""
    out = {}
    for qual, node in TRAINER_CLASSES.items():
        names = set(_base_names(node))
        decorators = {ast.unparse(d).split("(")[0].rpartition(".")[2] for d in node.decorator_list}
        if names & INTERFACE_BASES or "dataclass" in decorators:
            continue
        own = _own_names(qual)
        read = {sub.attr for sub in ast.walk(node) if isinstance(sub, ast.Attribute)
                and isinstance(sub.value, ast.Name) and sub.value.id == "self"}
        if foreign := {n for n in read - own if not n.startswith("__")}:
            out[qual] = foreign
    return out


def test_no_trainer_class_is_made_of_mixins() -> None:
    # one class per meaning, each whole in its module; a collaborator gets a Protocol of what it
    # uses (issue 42: the executor's TaskHosting / MemoryPlanning became components)
    found = mixins()
    used = []
    for qual, node in TRAINER_CLASSES.items():
        module = qual.rpartition(".")[0]
        for base in _base_names(node):
            target = _trainer_class(base, module)
            if target in found and target not in KNOWN_MIXINS:
                used.append(f"{qual}({base}): {base} reads {sorted(found[target])[:5]} through self")
    assert used == []
    assert sorted(set(KNOWN_MIXINS) - set(found)) == []  # no longer a mixin: take it off the list
