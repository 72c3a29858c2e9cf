"""Where the browser tests' screenshots go: a folder under the system's temp directory, so a test
run leaves the tree as it found it; with LORAPLEX_UPDATE_SCREENSHOTS=1, docs/ (the README's
pictures), to refresh them on purpose. tests/conftest.py checks that docs/ stays unchanged
otherwise."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Protocol

DOCS = Path(__file__).resolve().parents[2] / "docs"
UPDATE = "LORAPLEX_UPDATE_SCREENSHOTS"


class Browser(Protocol):
    def save_screenshot(self, filename: str) -> bool: ...


def updating_docs() -> bool:
    return os.environ.get(UPDATE, "").lower() in ("1", "true", "yes")


def screenshot_dir() -> Path:
    return DOCS if updating_docs() else Path(tempfile.gettempdir()) / "loraplex-screenshots"


def screenshot(browser: Browser, name: str) -> Path:
    """Save the page as `name` (docs/ only when asked); the file written."""
    folder = screenshot_dir()
    folder.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(folder / name))
    return folder / name
