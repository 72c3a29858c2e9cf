"""Unit: the tests leave docs/ as they found it (issue 43: tests/e2e/test_dashboard.py rewrote 5
tracked docs/*.png). Screenshots go to a temp folder unless LORAPLEX_UPDATE_SCREENSHOTS=1; no
test saves one elsewhere than that helper or its tmp_path; and the guard tests/conftest.py runs
at the end of every session sees a changed or new file under docs/."""

from __future__ import annotations

import ast
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.helpers import screenshots
from tests.helpers.tree_guard import changed, docs_state

REPO = Path(__file__).resolve().parents[2]


class FakeBrowser:
    def __init__(self) -> None:
        self.saved: list[str] = []

    def save_screenshot(self, filename: str) -> bool:
        self.saved.append(filename)
        Path(filename).write_bytes(b"png")
        return True


def test_screenshots_go_to_a_temp_folder_unless_asked(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(screenshots.UPDATE, raising=False)
    browser = FakeBrowser()
    written = screenshots.screenshot(browser, "dashboard-tasks.png")
    assert written.is_relative_to(Path(tempfile.gettempdir()))
    assert not written.is_relative_to(REPO)
    monkeypatch.setattr(screenshots, "DOCS", tmp_path / "docs")  # not the real docs/
    monkeypatch.setenv(screenshots.UPDATE, "1")
    assert screenshots.screenshot(browser, "x.png") == tmp_path / "docs" / "x.png"


def test_no_test_saves_a_screenshot_anywhere_else() -> None:
    """Every save_screenshot call in tests/ is the helper's, or writes under the test's tmp_path."""
    helper = REPO / "tests" / "helpers" / "screenshots.py"
    found = []
    for path in (REPO / "tests").rglob("*.py"):
        if path == helper:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "save_screenshot"):
                target = ast.unparse(node.args[0]) if node.args else ""
                if "tmp_path" not in target:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {target}")
    assert found == []


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo,
                   check=True, capture_output=True)


def test_the_guard_sees_changed_and_new_files_under_docs(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    for name in ("a.png", "b.png"):
        (tmp_path / "docs" / name).write_bytes(name.encode())
    (tmp_path / "README.md").write_text("x")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "init")
    (tmp_path / "docs" / "b.png").write_bytes(b"dirty before the run")  # left alone: not flagged
    before = docs_state(tmp_path)
    assert before is not None and list(before) == ["docs/b.png"]
    assert changed(before, docs_state(tmp_path)) == []
    (tmp_path / "docs" / "a.png").write_bytes(b"rewritten by a test")
    (tmp_path / "docs" / "new.png").write_bytes(b"new")
    (tmp_path / "README.md").write_text("outside docs/: not this guard's")
    assert changed(before, docs_state(tmp_path)) == ["docs/a.png", "docs/new.png"]
    assert docs_state(tmp_path / "docs" / "nowhere") is None  # no checkout there: no verdict
