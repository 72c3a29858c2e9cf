"""Unit: the README's two commands install what each needs (issue 43): serving (loraplex-up.sh)
pulls in no browser and no test tooling; the tests (run-tests.sh, which CI's .ci/run calls)
install Chromium, its driver and the dev extra. Read from scripts/install.sh's plan mode, which
installs nothing."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def plan(use: str) -> tuple[set[str], set[str]]:
    done = subprocess.run(["bash", "scripts/install.sh", use], cwd=REPO, capture_output=True,
                          text=True, timeout=30, env={**os.environ, "LORAPLEX_INSTALL_PLAN": "1"})
    assert done.returncode == 0, done.stderr
    found = re.fullmatch(rf"install plan \({use}\): apt (.*); pip -e \.\[(.*)\]\n", done.stdout)
    assert found, done.stdout
    return set(found[1].split()), set(found[2].split(","))


def test_serving_installs_no_browser_and_no_test_tooling() -> None:
    apt, extras = plan("serve")
    assert apt == {"postgresql", "redis-server"}
    assert extras == {"train", "tracking"}


def test_the_tests_install_the_browser_and_the_dev_extra() -> None:
    apt, extras = plan("test")
    assert {"chromium", "chromium-driver", "postgresql", "redis-server"} <= apt
    assert {"train", "tracking", "dev"} <= extras


def test_each_command_asks_for_its_own_use() -> None:
    up = (REPO / "scripts" / "loraplex-up.sh").read_text()
    tests = (REPO / "scripts" / "run-tests.sh").read_text()
    assert re.search(r"^\[.*\] \|\| bash scripts/install\.sh serve$", up, re.M)
    assert re.search(r"^bash scripts/install\.sh test$", tests, re.M)
    assert "scripts/run-tests.sh" in (REPO / ".ci" / "run").read_text()


def test_an_unknown_use_is_refused() -> None:
    done = subprocess.run(["bash", "scripts/install.sh", "everything"], cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "serve|test" in done.stderr
