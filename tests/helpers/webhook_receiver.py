"""A real HTTP receiver for webhook tests: a threaded http.server on 127.0.0.1 that records every
POST (headers and body) and answers `status`; `hold()` makes it keep requests waiting until
`release()`, `stop()`/`start()` take it down and bring it back on the same port."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from service.core.localstack import free_port


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    at: float

    @property
    def id(self) -> str:
        return self.headers["webhook-id"]


class Receiver:
    def __init__(self, status: int = 200) -> None:
        self.port = free_port()
        self.status = status
        self.received: list[Received] = []
        self._lock = threading.Lock()
        self._go = threading.Event()
        self._go.set()
        self._server: ThreadingHTTPServer | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver._lock:
                    receiver.received.append(Received(
                        {k.lower(): v for k, v in self.headers.items()}, body, time.time()))
                receiver._go.wait(60)
                self.send_response(receiver.status)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def hold(self) -> None:
        self._go.clear()

    def release(self) -> None:
        self._go.set()

    def ids(self) -> list[str]:
        with self._lock:
            return [r.id for r in self.received]

    def of_type(self, type: str) -> list[Received]:
        import json

        with self._lock:
            return [r for r in self.received if json.loads(r.body)["type"] == type]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
