"""End-to-end fixtures: the real service (uvicorn subprocess) on the private Postgres + Redis of
tests/integration/conftest.py, real worker daemon subprocesses, and HTTP-only helpers.

``stack`` gives a running service with one tenant; ``stack.daemon(name, ...)`` starts a daemon
(stopped at teardown). The service's scheduler is off unless the test is marked
``@pytest.mark.with_scheduler``; without it ``stack.place(task_id, node)`` publishes a placement
the way the scheduler would, so a test decides which node runs what; with it, the service's
background replanner (CP-SAT) places them, with a periodic pass every second. The service's
maintenance loop (stale nodes down, republish) runs every second; a node is down after 10 s of
silence. ``stack.tenant(name, max_gpus=...)`` adds a tenant (its API key); ``stack.sql(...)``
reads the service's Postgres for assertions HTTP cannot make.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("psycopg")

from service.core.localstack import free_port  # noqa: E402
from tests.integration.conftest import db_url, pg, redis_server, stack_dir  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[2]
WORKER_TOKEN = "e2e-worker-token"


NODE_TIMEOUT_S = 10


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "with_scheduler: the service's scheduler places tasks (off by default)")


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Stack:
    url: str
    env: dict[str, str]
    root: Path
    db_url: str
    redis_url: str
    api_key: str = ""
    scheduler: bool = False
    service: subprocess.Popen | None = None
    daemons: list[subprocess.Popen] = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=30)

    def start_service(self) -> None:
        log = open(self.root / "service.log", "ab")
        self.service = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "service.api.app:app", "--host", "127.0.0.1",
             "--port", self.url.rsplit(":", 1)[1], "--log-level", "warning"],
            env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._healthy, 60, "the service to answer /healthz")

    def stop_service(self) -> None:
        if self.service is not None and self.service.poll() is None:
            self.service.terminate()
            self.service.wait(timeout=30)

    def _healthy(self) -> bool:
        assert self.service is not None and self.service.poll() is None, self.service_log()
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def service_log(self) -> str:
        path = self.root / "service.log"
        return path.read_text(errors="replace")[-6000:] if path.exists() else ""

    def daemon(self, name: str, *args: str, env: dict[str, str] | None = None
               ) -> subprocess.Popen:
        work = self.root / f"worker-{name}"
        log = open(self.root / f"daemon-{name}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.daemon", "--service-url", self.url,
             "--worker-token", WORKER_TOKEN, "--redis-url", self.redis_url,
             "--node-name", name, "--work-dir", str(work), "--poll-interval-s", "0.2",
             "--heartbeat-interval-s", "1", "--cancel-grace-s", "3", *args],
            env=self.env | (env or {}), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        self.daemons.append(proc)
        return proc

    def daemon_log(self, name: str) -> str:
        path = self.root / f"daemon-{name}.log"
        return path.read_text(errors="replace")[-8000:] if path.exists() else ""

    def node_id(self, name: str) -> str:
        def find() -> str | None:
            r = httpx.get(f"{self.url}/v1/cluster", timeout=10,
                          headers={"Authorization": f"Bearer {WORKER_TOKEN}"})
            for node in r.json()["nodes"]:
                if node["name"] == name and node["state"] == "up":
                    return node["id"]
            return None
        return wait_for(find, 30, f"node {name} to register")

    def place(self, task_id: str, node_name: str, gpus: tuple[int, ...] = (0,)) -> None:
        """Stand in for the scheduler (when it is off): publish one placement of the task."""
        if self.scheduler:
            return
        from sqlalchemy import create_engine
        from sqlalchemy.orm import Session

        from service.cluster import next_attempt
        from service.core.config import Settings
        from service.models import Placement, utcnow
        from service.queue import publish_placement

        node_id = self.node_id(node_name)
        engine = create_engine(self.db_url.replace("postgresql://", "postgresql+psycopg://"))
        try:
            with Session(engine) as session:
                now = utcnow()
                p = Placement(task_id=task_id, node_id=node_id, gpu_indices=list(gpus),
                              planned_start=now, planned_end=now, attempt=next_attempt(
                                  session, task_id))
                session.add(p)
                session.flush()
                publish_placement(session, p, Settings(redis_url=self.redis_url,
                                                       database_url=self.db_url))
                session.commit()
        finally:
            engine.dispose()

    def tenant(self, name: str, max_gpus: int | None = None) -> str:
        """Another tenant of the running service; returns its API key."""
        return make_tenant(self.db_url, name, max_gpus)

    def client(self, api_key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30,
                            headers={"Authorization": f"Bearer {api_key}"})

    def operator(self) -> httpx.Client:
        """A client with the operator token (GET /v1/cluster)."""
        return self.client(WORKER_TOKEN)

    def sql(self, query: str, **params: Any) -> list[Any]:
        """Rows of a read-only query on the service's database."""
        from sqlalchemy import create_engine, text

        engine = create_engine(self.db_url.replace("postgresql://", "postgresql+psycopg://"))
        try:
            with engine.connect() as conn:
                return list(conn.execute(text(query), params))
        finally:
            engine.dispose()

    def stop_daemons(self) -> None:
        for proc in self.daemons:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self.daemons:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def upload_jsonl(http: httpx.Client, name: str, rows: list[dict]) -> str:
    """POST rows as a JSONL file; its id."""
    import io
    import json

    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    r = http.post("/v1/files", files={"file": (name, io.BytesIO(body))})
    assert r.status_code in (200, 201), r.text  # 200: the tenant's file of the same bytes
    return r.json()["id"]


def make_tenant(db: str, name: str, max_gpus: int | None = None) -> str:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from service.tenants import create_tenant

    engine = create_engine(db.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with Session(engine) as session:
            _, key = create_tenant(session, name, max_gpus)
            session.commit()
    finally:
        engine.dispose()
    return key


@pytest.fixture
def models_yaml(tmp_path: Path) -> Path:
    """Override in a test module to register a real model directory."""
    path = tmp_path / "models.yaml"
    model_dir = tmp_path / "fake-model"
    model_dir.mkdir()
    path.write_text(f"models:\n  - name: tiny\n    path: {model_dir}\n    parameters: 1000000\n"
                    "    gpus: 1\n    max_seq_len: 256\n    family: llama\n")
    return path


def tiny_llama_models(tmp_path: Path) -> Path:
    """A models file registering one real tiny Llama ('tiny', 1 GPU, max_seq_len 128), for a
    test module's own `models_yaml` fixture when its jobs really train."""
    from trainer.tiny import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "tiny-llama", seed=0)
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n  - name: tiny\n    path: {model_dir}\n    parameters: 100000\n"
                    "    gpus: 1\n    max_seq_len: 128\n    family: llama\n")
    return path


def stack_env(database_url: str, redis_url: str, root: Path, models_yaml: Path,
              scheduler: bool) -> dict[str, str]:
    """The environment of a test stack's service and daemons: this process's, plus the stack's
    databases, storage under root, the models file, short timeouts and intervals."""
    return dict(os.environ) | {
        "LORAPLEX_DATABASE_URL": database_url if "+psycopg" in database_url
        else database_url.replace("postgresql://", "postgresql+psycopg://"),
        "LORAPLEX_REDIS_URL": redis_url,
        "LORAPLEX_STORAGE_DIR": str(root / "storage"),
        "LORAPLEX_MODELS_FILE": str(models_yaml),
        "LORAPLEX_WORKER_TOKEN": WORKER_TOKEN,
        "LORAPLEX_NODE_TIMEOUT_S": str(NODE_TIMEOUT_S),
        "LORAPLEX_MAINTENANCE_INTERVAL_S": "1",
        "LORAPLEX_SCHEDULER_ENABLED": str(scheduler).lower(),
        "LORAPLEX_SCHEDULER_INTERVAL_S": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture
def stack(request: pytest.FixtureRequest, db_url: str, redis_server,  # noqa: ANN001,F811
          tmp_path: Path, models_yaml: Path) -> Iterator[Stack]:
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    port = free_port()
    scheduler = request.node.get_closest_marker("with_scheduler") is not None
    env = stack_env(db_url, redis_server.url, tmp_path, models_yaml, scheduler)
    s = Stack(url=f"http://127.0.0.1:{port}", env=env, root=tmp_path, db_url=db_url,
              redis_url=redis_server.url, scheduler=scheduler)
    s.api_key = make_tenant(db_url, "e2e-tenant")
    s.start_service()
    try:
        yield s
    finally:
        s.stop_daemons()
        s.stop_service()
