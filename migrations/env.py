"""Alembic environment: migrates the database named by service settings (or sqlalchemy.url).
Online mode only; the ORM metadata in service.models is the autogenerate target."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from service.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from service.core.config import get_settings

    return get_settings().database_url


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        context.configure(connection=connectable, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()


run_migrations_online()
