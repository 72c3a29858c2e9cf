"""Every tier: a test run leaves docs/ as it found it (issue 43: the browser tests rewrote the
README's screenshots). Screenshots go to a temp folder unless LORAPLEX_UPDATE_SCREENSHOTS=1 asks
for docs/ (tests.helpers.screenshots); a run that changed docs/ otherwise fails, naming the files."""

from __future__ import annotations

import pytest

from tests.helpers.screenshots import updating_docs
from tests.helpers.tree_guard import changed, docs_state

_BEFORE = pytest.StashKey[dict]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[_BEFORE] = {"state": docs_state()}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if updating_docs() or _BEFORE not in session.stash:
        return
    dirty = changed(session.stash[_BEFORE]["state"], docs_state())
    if dirty:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (f"the tests changed docs/: {', '.join(dirty)} (screenshots belong in a temp "
                   "folder; LORAPLEX_UPDATE_SCREENSHOTS=1 refreshes docs/ on purpose)")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(f"ERROR: {message}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
