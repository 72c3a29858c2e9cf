"""Unit: the lifecycle states are declared once (contract.states) and every state word the
service, worker and trainer write or compare is one of them; the transition tables are whole;
service.lifecycle applies them and refuses (writing nothing) a move they do not list."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest

from contract import states
from contract.states import (
    JOB_TERMINAL,
    JOB_TRANSITIONS,
    PLACEMENT_TERMINAL,
    PLACEMENT_TRANSITIONS,
    TASK_TERMINAL,
    TASK_TRANSITIONS,
    JobState,
    PlacementState,
    TaskState,
)

REPO = Path(__file__).resolve().parents[2]
LIFECYCLE_WORDS = {s.value for e in (TaskState, JobState, PlacementState, states.NodeState)
                   for s in e}
# Other objects' own states, with their own declarations: merged models, webhook deliveries and
# tracking syncs (service/{merged,webhooks,tracking}/states.py, which import the contract alone),
# and the executor host the worker drives (worker/host.py).
merged_states = pytest.importorskip("service.merged.states")
webhook_states = pytest.importorskip("service.webhooks.states")
tracking_states = pytest.importorskip("service.tracking.states")
STATE_MODULES = (states, merged_states, webhook_states, tracking_states)
OTHER_WORDS = {s.value for e in (merged_states.MergeState, webhook_states.DeliveryState,
                                 tracking_states.SyncState) for s in e}
OTHER_WORDS |= {"loading", "serving", "stopping", "closed"}
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _words(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        for element in node.elts:
            yield from _words(element)


def _is_state(node: ast.AST) -> bool:
    """`x.state`, `x["state"]` or `x.get("state")`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "state"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "state"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and bool(node.args)
            and isinstance(node.args[0], ast.Constant) and node.args[0].value == "state")


def _state_literals(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every string constant compared with, assigned to or passed as a state."""
    for n in ast.walk(tree):
        found: list[ast.AST] = []
        if isinstance(n, ast.Compare) and any(map(_is_state, [n.left, *n.comparators])):
            found = [n.left, *n.comparators]
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and n.func.attr in ("in_", "not_in") and _is_state(n.func.value)):
            found = list(n.args)
        elif isinstance(n, ast.Assign):
            for target in n.targets:
                if _is_state(target):
                    found.append(n.value)
                elif isinstance(target, ast.Tuple) and isinstance(n.value, ast.Tuple):
                    found += [v for t, v in zip(target.elts, n.value.elts, strict=False) if _is_state(t)]
        elif isinstance(n, ast.keyword) and n.arg == "state":
            found = [n.value]
        elif isinstance(n, ast.AnnAssign) and n.value is not None and (
                _is_state(n.target) or isinstance(n.target, ast.Name) and n.target.id == "state"):
            # a field's default: `state: str = "queued"`, `state = mapped_column(default=...)`
            found = [n.value] if not isinstance(n.value, ast.Call) else [
                k.value for k in n.value.keywords if k.arg in ("default", "server_default")]
        elif isinstance(n, ast.Dict):
            found = [v for k, v in zip(n.keys, n.values, strict=True)
                     if isinstance(k, ast.Constant) and k.value == "state"]
        for node in found:
            yield from ((getattr(n, "lineno", 0), w) for w in _words(node))


def _sources() -> list[Path]:
    return [p for root in ("service", "worker", "trainer") for p in sorted((REPO / root).rglob("*.py"))]


def test_every_state_literal_is_a_member() -> None:
    unknown, sources = [], _sources()
    for path in sources:
        for line, word in _state_literals(ast.parse(path.read_text(), str(path))):
            if word not in LIFECYCLE_WORDS | OTHER_WORDS:
                unknown.append(f"{path.relative_to(REPO)}:{line}: {word!r}")
    assert not unknown, "state words that are no state of contract.states:\n" + "\n".join(unknown)
    # the scan reads the code it is meant to read (with no literal left for it to find)
    assert {"service/lifecycle.py", "worker/placements.py", "trainer/executor.py"} <= {
        str(p.relative_to(REPO)) for p in sources}


def test_the_scan_catches_a_stray_word() -> None:
    tree = ast.parse('task.state = "runnin"\nif job.state in ("pending", "exitted"): pass\n'
                     'p.state, p.error = "superseeded", None\nst["state"] == "done"\n'
                     'class A:\n    state: str = "queud"\n'
                     '    state: Mapped[str] = mapped_column(String(8), default="pendin")\n')
    assert {w for _, w in _state_literals(tree)} - LIFECYCLE_WORDS == {
        "runnin", "exitted", "superseeded", "done", "queud", "pendin"}


def test_the_service_spells_no_state() -> None:
    """The service names every state it writes or compares by its enum member, never a string."""
    spelled = [f"{path.relative_to(REPO)}:{line}: {word!r}"
               for path in sorted((REPO / "service").rglob("*.py"))
               for line, word in _state_literals(ast.parse(path.read_text(), str(path)))]
    assert not spelled, "state words spelled as strings:\n" + "\n".join(spelled)


def _module_level_sets(path: Path) -> Iterator[tuple[str, frozenset[str]]]:
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple | ast.List | ast.Set):
            words = frozenset(_words(node.value))
            if len(words) > 1 and len(words) == len(node.value.elts):
                yield ast.unparse(node.targets[0]), words


def test_state_sets_are_declared_once() -> None:
    """No module outside the states modules declares its own copy of one of their state sets."""
    declared = {frozenset(v.value for v in value): f"{module.__name__}.{name}"
                for module in STATE_MODULES for name, value in vars(module).items()
                if name.isupper() and isinstance(value, tuple) and len(value) > 1}
    copies = [f"{path.relative_to(REPO)}: {name} (= {declared[words]})"
              for path in _sources() for name, words in _module_level_sets(path)
              if words in declared]
    assert not copies, "\n".join(copies)


def _state_literal_types(tree: ast.AST) -> Iterator[tuple[int, frozenset[str]]]:
    """Every `Literal[...]` that spells out two or more state words and nothing else."""
    for n in ast.walk(tree):
        if (isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name | ast.Attribute)
                and (getattr(n.value, "id", None) or getattr(n.value, "attr", None)) == "Literal"):
            words = frozenset(_words(n.slice))
            if len(words) > 1 and words <= LIFECYCLE_WORDS | OTHER_WORDS:
                yield n.lineno, words


def test_no_literal_type_spells_out_states() -> None:
    """An API field or parameter that takes a state is typed from its enum's values (e.g.
    service.merged.states.MergeStateName), not from a Literal that repeats the words."""
    spelled = [f"{path.relative_to(REPO)}:{line}: Literal{sorted(words)}"
               for path in _sources()
               for line, words in _state_literal_types(ast.parse(path.read_text(), str(path)))]
    assert not spelled, "\n".join(spelled)
    tree = ast.parse('state: Literal["queued", "running"]\nobject: Literal["list"] = "list"\n')
    assert [w for _, w in _state_literal_types(tree)] == [frozenset({"queued", "running"})]


@pytest.mark.parametrize("table,enum,terminal", [
    (TASK_TRANSITIONS, TaskState, TASK_TERMINAL),
    (JOB_TRANSITIONS, JobState, JOB_TERMINAL),
    (PLACEMENT_TRANSITIONS, PlacementState, PLACEMENT_TERMINAL),
])
def test_tables_are_whole(table: dict, enum: type, terminal: tuple) -> None:
    assert set(table) == set(enum)
    assert all(isinstance(t, enum) for targets in table.values() for t in targets)
    assert {s for s, targets in table.items() if not targets} == set(terminal)


def test_members_are_their_strings() -> None:
    assert TaskState.QUEUED == "queued" and str(JobState.EXITED) == "exited"
    assert f"{PlacementState.SUPERSEDED}" == "superseded"
    assert "running" in states.PLACEMENT_ACTIVE and "exited" in JOB_TERMINAL
    assert states.values(states.EXIT_REASONS) == ("diverging", "overfitting", "underperforming")


# ----- service.lifecycle ------------------------------------------------------------------------

lifecycle = pytest.importorskip("service.lifecycle")
models = pytest.importorskip("service.models")


def test_a_legal_move_writes_the_state_and_its_fields() -> None:
    placement = models.Placement(id="pl_1", state="published")
    lifecycle.claim_placement(placement, NOW)
    assert (placement.state, placement.claimed_at) == ("claimed", NOW)
    lifecycle.start_placement(placement)
    lifecycle.fail_placement(placement, "node lost", NOW)
    assert (placement.state, placement.error, placement.finished_at) == ("failed", "node lost", NOW)
    task = models.Task(id="task_1", state="queued")
    lifecycle.start_task(task, NOW)
    lifecycle.begin_pause(task)
    lifecycle.pause_task(task)
    lifecycle.resume_task(task)
    assert task.state == "queued" and task.started_at == NOW
    job = models.Job(id="job_1", state="pending")
    lifecycle.report_job(job, "running", NOW)
    lifecycle.report_job(job, "exited", NOW)
    assert (job.state, job.started_at, job.finished_at) == ("exited", NOW, NOW)


def test_a_new_placement_starts_planned() -> None:
    placement = models.Placement(id="pl_new")  # not flushed: no state yet
    lifecycle.publish_placement(placement, NOW)
    assert placement.state == "published"


@pytest.mark.parametrize("make,move", [
    (lambda: models.Task(id="t", state="succeeded"), lambda o: lifecycle.cancel_task(o, NOW)),
    (lambda: models.Task(id="t", state="paused"), lambda o: lifecycle.start_task(o, NOW)),
    (lambda: models.Task(id="t", state="queued"), lambda o: lifecycle.begin_pause(o)),
    (lambda: models.Task(id="t", state="failed"), lambda o: lifecycle.fail_task(o, "x", NOW)),
    (lambda: models.Job(id="j", state="completed"), lambda o: lifecycle.report_job(o, "running", NOW)),
    (lambda: models.Job(id="j", state="cancelled"), lambda o: lifecycle.fail_job(o, NOW, "x")),
    (lambda: models.Placement(id="p", state="planned"), lambda o: lifecycle.claim_placement(o, NOW)),
    (lambda: models.Placement(id="p", state="finished"), lambda o: lifecycle.supersede_placement(o)),
    (lambda: models.Placement(id="p", state="superseded"),
     lambda o: lifecycle.fail_placement(o, "x", NOW)),
    (lambda: models.Placement(id="p", state="published"),
     lambda o: lifecycle.stop_placement(o, "x", NOW)),
])
def test_an_illegal_move_raises_and_writes_nothing(make, move) -> None:
    obj = make()
    before = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    with pytest.raises(lifecycle.IllegalTransition, match="cannot go from") as raised:
        move(obj)
    assert raised.value.status == 409 and raised.value.current == before["state"]
    assert {k: v for k, v in vars(obj).items() if not k.startswith("_")} == before
