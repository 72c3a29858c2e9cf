"""What a test run changed under the repository's docs/ (tests/conftest.py fails the run on it):
the tracked or new files `git status` lists there, with their contents' hashes, before and after."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def docs_state(repo: Path = REPO, folder: str = "docs") -> dict[str, str] | None:
    """{path: hash} of the files under `folder` that differ from git's index or are new; None
    where there is no git checkout to ask."""
    try:
        done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--",
                               folder], cwd=repo, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    state = {}
    for line in done.stdout.splitlines():
        path = line[3:].split(" -> ")[-1].strip('"')
        file = repo / path
        state[path] = hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else "gone"
    return state


def changed(before: dict[str, str] | None, after: dict[str, str] | None) -> list[str]:
    """The paths whose state differs between two docs_state() answers."""
    if before is None or after is None:
        return []
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
