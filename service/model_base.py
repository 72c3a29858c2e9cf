"""The ORM's ground: the declarative base, timestamps, ids and the partial-index condition that
service.models (tasks, jobs, files, nodes...) and service.models_outbox (webhooks, merged
models, tracking integrations) share."""

from __future__ import annotations

import secrets
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import DateTime, text
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.sql.elements import TextClause


def state_in(*states: str) -> TextClause:
    """The SQL condition of a partial index on the row's state (the words of its state enum),
    as the migration that made the index wrote it."""
    if len(states) == 1:
        return text(f"state = '{states[0]}'")
    return text("state IN (" + ", ".join(f"'{s}'" for s in states) + ")")


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (all timestamp columns are timestamptz)."""
    return datetime.now(timezone.utc)


def new_id(prefix: str) -> str:
    """A fresh random id such as ``task_3f9c0a...`` (prefix says what the thing is)."""
    return f"{prefix}_{secrets.token_hex(12)}"


def id_default(prefix: str) -> Any:
    """A column default that makes a fresh id of this prefix."""
    return lambda: new_id(prefix)


TS = DateTime(timezone=True)


class Base(DeclarativeBase):
    pass
