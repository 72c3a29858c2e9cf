"""Integration fixtures: ONE private PostgreSQL and ONE redis-server per test session, a fresh
database per test (CREATE DATABASE ... TEMPLATE of a migrated template), and the app's client.

Fixtures other suites can use: ``pg`` (service.core.localstack.Postgres), ``redis_server``,
``db_url`` (a clean migrated database for this test), ``settings``, ``session`` (a SQLAlchemy
session on it), ``app``, ``client`` (TestClient), ``factory`` (tests/integration/factories.py).

The API's calls into the scheduler (service.scheduler.replan) are off by default here, so these
tests place tasks by hand with ``factory.placement``; mark a test ``@pytest.mark.with_scheduler``
to have the app replan on task arrival, cancel, completion and node changes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("psycopg")

from fastapi.testclient import TestClient  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

from service.core.config import Settings  # noqa: E402
from service.core.localstack import Postgres, Redis, free_port  # noqa: E402

TEMPLATE_DB = "loraplex_template"
WORKER_TOKEN = "test-worker-token"
MODELS_YAML = """\
models:
  - name: tiny-llama
    path: /models/tiny-llama
    parameters: 1000000
    gpus: 1
    max_seq_len: 512
    family: llama
  - name: big-model
    path: /models/big
    parameters: 70000000000
    gpus: 4
    max_seq_len: 8192
    family: llama
"""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "with_scheduler: the app calls service.scheduler.replan (off by default)")


@pytest.fixture(scope="session")
def stack_dir() -> Iterator[Path]:
    # Not under pytest's tmp_path: that is 0700 and the postgres user must enter it.
    root = Path(tempfile.mkdtemp(prefix="loraplex-it-"))
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg(stack_dir: Path) -> Iterator[Postgres]:
    from service.admin import migrate

    server = Postgres(stack_dir / "postgres", free_port())
    server.start()
    server.create_database(TEMPLATE_DB)
    migrate(server.url(TEMPLATE_DB))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(stack_dir: Path) -> Iterator[Redis]:
    server = Redis(stack_dir / "redis", free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def db_url(pg: Postgres) -> Iterator[str]:
    import psycopg

    name = f"t_{uuid.uuid4().hex[:16]}"
    pg.create_database(name, template=TEMPLATE_DB)
    yield pg.url(name)
    with psycopg.connect(f"host=127.0.0.1 port={pg.port} user=loraplex dbname=postgres",
                         autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def settings(db_url: str, redis_server: Redis, tmp_path: Path,
             request: pytest.FixtureRequest) -> Settings:
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    models = tmp_path / "models.yaml"
    models.write_text(MODELS_YAML)
    return Settings(database_url=db_url, redis_url=redis_server.url,
                    storage_dir=tmp_path / "storage", models_file=models,
                    worker_token=WORKER_TOKEN, admin_token="test-admin-token",
                    max_upload_bytes=64 * 1024, max_configurations=16, node_timeout_s=30,
                    maintenance_interval_s=0,
                    scheduler_enabled=request.node.get_closest_marker("with_scheduler") is not None)


@pytest.fixture
def app(settings: Settings):  # noqa: ANN201 - FastAPI
    from service.api.app import create_app

    return create_app(settings)


@pytest.fixture
def client(app) -> Iterator[TestClient]:  # noqa: ANN001
    with TestClient(app) as c:
        yield c


@pytest.fixture
def session(app) -> Iterator[Session]:  # noqa: ANN001
    s = app.state.sessionmaker()
    yield s
    s.close()


@pytest.fixture
def factory(session: Session, client: TestClient, settings: Settings):  # noqa: ANN201
    from tests.integration.factories import Factory

    return Factory(session=session, client=client, settings=settings)
