"""Unit: what the `loraplex` CLI prints (issue 43): the live jobs table ends before the closing
line, ids are never cut whatever the terminal's width, and Ctrl-C exits with code 130 and one
line (no traceback, no leaked-semaphore warning)."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from service.cli import main
from tests.unit.test_cli import FakeApi

REPO = Path(__file__).resolve().parents[2]
FILE_ID = "file_0123456789abcdef01234567"
TASK_ID = "task_89abcdef0123456789abcdef"
JOB_ID = "job_fedcba9876543210fedcba98"


def test_the_jobs_table_ends_before_the_closing_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("service.cli.time.sleep", lambda s: None)
    out = io.StringIO()  # a pipe or a file: not a terminal
    console = Console(file=out, width=120, color_system=None)
    assert main(["--api-key", "k", "tasks", "follow", "task_1"], httpx.MockTransport(FakeApi()),
                console) == 0
    lines = out.getvalue().splitlines()
    assert lines[-1] == "task task_1 succeeded; best job j0", lines[-3:]
    assert lines[-2].startswith("└") and lines[-2].endswith("┘")


def listing(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/v1/files":
        return httpx.Response(200, json={"object": "list", "has_more": False, "data": [{
            "id": FILE_ID, "object": "file", "bytes": 1234567, "created_at": 1_767_225_600,
            "filename": "customer-support-conversations-2026.jsonl", "purpose": "fine-tune",
            "status": "processed", "format": "chat", "line_count": 17000}]})
    return httpx.Response(200, json={"object": "list", "has_more": False, "data": [{
        "id": TASK_ID, "state": "succeeded", "base_model": "llama-3.1-8b-instruct",
        "num_jobs": 12, "job_counts": {"completed": 3, "exited": 9}, "best_job_id": JOB_ID,
        "created_at": 1_767_225_600}]})


@pytest.mark.parametrize("width", [60, 80, 100, 200])
@pytest.mark.parametrize("terminal", [True, False])
def test_ids_are_never_cut(width: int, terminal: bool) -> None:
    for group, ids in (("files", [FILE_ID]), ("tasks", [TASK_ID])):
        out = io.StringIO()
        console = Console(file=out, width=width, force_terminal=terminal, color_system=None)
        assert main(["--api-key", "k", group, "list"], httpx.MockTransport(listing), console) == 0
        text = out.getvalue()
        assert "…" not in text
        for id_ in ids:
            assert any(id_ in line for line in text.splitlines()), (group, width, text)
        if terminal:
            assert max(len(line) for line in text.splitlines()) <= width, text
            if width < 100:
                assert "left out to fit the terminal" in text
        else:  # a pipe or a file gets every column whole
            assert "2026-01-01 00:00:00" in text and "left out" not in text
            if group == "tasks":
                assert JOB_ID in text


# ----- Ctrl-C ------------------------------------------------------------------------------
@pytest.fixture
def running_task_api() -> Iterator[tuple[str, threading.Event]]:
    """An API whose task runs forever; the event is set once the CLI polled its events."""
    polled = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?")[0]
            body: dict = {"data": [], "last_id": None, "jobs": []}
            if path == "/v1/tasks/task_1":
                body = {"id": "task_1", "state": "running", "num_jobs": 1, "best_job_id": None}
            elif path.endswith("/events"):
                polled.set()
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", polled
    server.shutdown()
    server.server_close()


def test_ctrl_c_exits_130_with_one_line(running_task_api) -> None:  # noqa: ANN001
    url, polled = running_task_api
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "--api-url", url, "--api-key",
                             "k", "tasks", "follow", "task_1", "--interval", "0.2"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert polled.wait(60), "the CLI never polled"
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert err.splitlines() == ["loraplex: interrupted (Ctrl-C)"], err
