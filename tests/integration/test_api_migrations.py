"""Integration: the Alembic migrations build exactly the schema of service/models.py, and
downgrade to nothing and back up cleanly."""

from __future__ import annotations

import uuid

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from service.admin import migrate
from service.models import Base


def _alembic_config(url: str):  # noqa: ANN202
    from alembic.config import Config

    from service.admin import ROOT

    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def test_models_match_migrations(db_url: str) -> None:
    engine = create_engine(db_url)
    mine = set(Base.metadata.tables)

    def include(obj, name, type_, reflected, compare_to) -> bool:  # noqa: ANN001
        # Tables added by other parts' migrations (e.g. the scheduler's) are not ours to check.
        table = obj if type_ == "table" else getattr(obj, "table", None)
        return table is None or getattr(table, "name", name) in mine or name in mine

    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"include_object": include})
            diffs = compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()
    assert diffs == [], f"service/models.py and migrations/ differ: {diffs}"


def test_downgrade_and_upgrade(pg) -> None:  # noqa: ANN001
    from alembic import command

    name = f"m_{uuid.uuid4().hex[:12]}"
    pg.create_database(name)
    url = pg.url(name)
    migrate(url)
    cfg = _alembic_config(url)
    command.downgrade(cfg, "base")
    engine = create_engine(url)
    try:
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        migrate(url)
        assert set(Base.metadata.tables) <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
