"""Cursor pagination for list endpoints: newest first, ``after`` is the id of the last item
of the previous page (stable under inserts, unlike offsets). The cursor's format is in the
schema (cursor_query): a malformed one is a 422, a well-formed one that names none of the
caller's items a 404 naming `after`."""

from __future__ import annotations

from typing import Any

from fastapi import Query
from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import Session

from service.core.errors import not_found

ID_HEX = 24  # service.models.new_id: <prefix>_ and 24 hex digits


def id_pattern(prefix: str) -> str:
    return f"^{prefix}_[0-9a-f]{{{ID_HEX}}}$"


def cursor_query(prefix: str, what: str) -> Any:
    """The `after` query parameter of a list of `what` whose ids start with `prefix`_."""
    return Query(pattern=id_pattern(prefix), description=(
        f"The `id` of the last {what} of the previous page (`{prefix}_` and {ID_HEX} hex "
        f"digits): the page starts after it. A malformed cursor is a 422, one that names none "
        f"of your {what}s a 404, both naming `after`."))


def unknown_cursor(after: str) -> Exception:
    return not_found("cursor", after, param="after")


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
            raise unknown_cursor(after)
        created_at, cid = cursor
        query = query.where(or_(model.created_at < created_at,
                                and_(model.created_at == created_at, model.id < cid)))
    rows = session.scalars(
        query.order_by(model.created_at.desc(), model.id.desc()).limit(limit + 1)).all()
    return list(rows[:limit]), len(rows) > limit

