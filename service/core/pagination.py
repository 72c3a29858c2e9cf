"""Cursor pagination for list endpoints: newest first, ``after`` is the id of the last item
of the previous page (stable under inserts, unlike offsets)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import Session

from service.core.errors import invalid


def page_query(session: Session, model: Any, base: Select, limit: int, after: str | None,
               scope: Select | None = None) -> tuple[list[Any], bool]:
    """Rows of base ordered by (created_at, id) descending after the cursor; (rows, has_more).
    The cursor must be a row of scope (default base): pass the unfiltered tenant query when
    base filters on something that can change, such as a state."""
    query = base
    if after is not None:
        cursor = session.execute(
            (scope if scope is not None else base).with_only_columns(model.created_at, model.id)
            .where(model.id == after)).first()
        if cursor is None:
            raise invalid(f"unknown cursor {after!r}", param="after")
        created_at, cid = cursor
        query = query.where(or_(model.created_at < created_at,
                                and_(model.created_at == created_at, model.id < cid)))
    rows = session.scalars(
        query.order_by(model.created_at.desc(), model.id.desc()).limit(limit + 1)).all()
    return list(rows[:limit]), len(rows) > limit

