"""The most-read routes on the event loop: GET /v1/tasks (a page of tasks) and
GET /v1/tasks/{id}/metrics (loss curves), each one statement on the app's ReadPool whose tenant
is the one of the request's API key if that key is live (checked in the statement itself, so a
revoked key reads nothing from the moment it is revoked), answered as JSON bytes built from
plain rows, without the ORM, a session or a model object per item. The JSON is the one
TaskOut / MetricsOut give (same fields, order and encoding: tests/integration/
test_api_read_path.py compares the bytes with the models' output). A statement that finds
nothing asks whether the key is still live (a 401) before answering an empty page or a 404."""

from __future__ import annotations

from functools import cache

from pydantic_core import to_json
from sqlalchemy import bindparam, select
from sqlalchemy.dialects import postgresql

from contract.states import PlacementState
from service.api.auth import ReadKey, read_key_live
from service.core.db import ReadPool
from service.core.errors import not_found
from service.core.pagination import unknown_cursor
from service.events import metrics_body, metrics_params, metrics_statement
from service.models import ApiKey
from service.samples import SAMPLES_FILE_SQL
from service.task_views import TASK_COLUMNS, task_view
from service.tracking.integrations import VIEW_SQL

_DIALECT = postgresql.psycopg.dialect()
# The tenant of the live API key of a prefix and hash (parameters prefix and key_hash).
_KEY_TENANT = (select(ApiKey.tenant_id)
               .where(ApiKey.prefix == bindparam("prefix"),
                      ApiKey.key_hash == bindparam("key_hash"), ApiKey.revoked_at.is_(None))
               .scalar_subquery())

# A page of tasks (newest first, after the cursor) with what task_outs adds to each: the job
# states, the failed attempts and the placement that says most about "when" (the live one,
# else the latest that ran). {filters}: the optional state and cursor conditions; {failed},
# {superseded}, {cancelled}: those placement states.
_LIST_SQL = """
WITH me AS ({key_tenant})
SELECT {columns},
       (SELECT array_agg(j.state) FROM jobs j WHERE j.task_id = t.id),
       (SELECT count(*) FROM placements p WHERE p.task_id = t.id AND p.state = '{failed}'),
       latest.attempt, latest.planned_start, latest.planned_end, latest.estimated_s,
       latest.gpus,
       (SELECT sum(m.tokens) FROM metric_points m WHERE m.task_id = t.id AND m.split = 'train'),
       (SELECT sum(m.gpu_seconds) FROM metric_points m
        WHERE m.task_id = t.id AND m.split = 'train'),
       (SELECT f.bytes FROM files f WHERE f.id = t.training_file_id),
       (SELECT f.line_count FROM files f WHERE f.id = t.training_file_id),
       (SELECT array_agg(f.id ORDER BY f.format = 'csv' DESC) FROM files f
        WHERE f.id IN ('file_' || split_part(t.id, '_', 2), {samples_file}) AND f.deleted_at IS NULL),
       {integrations}
FROM (SELECT * FROM tasks WHERE tenant_id = (SELECT tenant_id FROM me){filters}
      ORDER BY created_at DESC, id DESC LIMIT %(limit)s) t
LEFT JOIN LATERAL (SELECT p.attempt, p.planned_start, p.planned_end, p.estimated_s,
                          cardinality(p.gpu_indices) AS gpus FROM placements p
                   WHERE p.task_id = t.id AND p.state NOT IN ('{superseded}', '{cancelled}')
                   ORDER BY p.created_at DESC LIMIT 1) latest ON true
ORDER BY t.created_at DESC, t.id DESC
"""
_STATE = " AND state = %(state)s"
_AFTER = (" AND (created_at, id) < (SELECT c.created_at, c.id FROM tasks c"
          " WHERE c.id = %(after)s AND c.tenant_id = (SELECT tenant_id FROM me))")
_CURSOR_SQL = "SELECT 1 FROM tasks WHERE id = %(after)s AND tenant_id = %(tenant_id)s"


@cache
def _list_sql(state: bool, after: bool) -> str:
    return _LIST_SQL.format(key_tenant=_KEY_TENANT.element.compile(dialect=_DIALECT),
                            columns=", ".join(f"t.{c}" for c in TASK_COLUMNS),
                            filters=(_STATE if state else "") + (_AFTER if after else ""),
                            integrations=VIEW_SQL.format(task="t"), samples_file=SAMPLES_FILE_SQL.format(task="t"),
                            failed=PlacementState.FAILED, superseded=PlacementState.SUPERSEDED,
                            cancelled=PlacementState.CANCELLED)


async def list_tasks_json(pool: ReadPool, key: ReadKey, limit: int, after: str | None,
                          state: str | None, price: float | None = None) -> bytes:
    """Page[TaskOut]'s JSON: the key's tenant's tasks newest first, ``limit`` of them after the
    task ``after`` (a 422 when it is not one of the tenant's tasks), only those in ``state``."""
    params = {"prefix": key.prefix, "key_hash": key.key_hash, "tenant_id": key.tenant_id,
              "limit": limit + 1, "state": state, "after": after}
    rows = await pool.fetch(_list_sql(state is not None, after is not None), params)
    if not rows:
        await read_key_live(pool, key)
        if after is not None and not await pool.fetch(_CURSOR_SQL, params):
            raise unknown_cursor(after)
    data = [_task(row, price) for row in rows[:limit]]
    return to_json({"object": "list", "data": data, "has_more": len(rows) > limit,
                    "last_id": data[-1]["id"] if data else None})


def _task(row: tuple, price: float | None) -> dict:
    """TaskOut's fields, in its order, from a row of _LIST_SQL (the one view, tasks.task_view)."""
    n = len(TASK_COLUMNS)
    return task_view(dict(zip(TASK_COLUMNS, row[:n], strict=True)), *row[n:], price=price)


@cache
def _metrics_sql(one_job: bool, after: bool) -> str:
    # service.events' statement with the key's tenant, compiled once for psycopg's %(name)s
    # parameters.
    return str(metrics_statement(one_job, after, _KEY_TENANT).compile(dialect=_DIALECT))


async def task_metrics_json(pool: ReadPool, key: ReadKey, task_id: str, job_id: str | None,
                            after_step: int | None, max_points: int | None) -> bytes:
    """MetricsOut's JSON for the key's tenant's task (404 for another's or an unknown one), as
    service.events.task_metrics_json gives it."""
    params = metrics_params(None, task_id, job_id, after_step)
    params.update(prefix=key.prefix, key_hash=key.key_hash)
    rows = await pool.fetch(_metrics_sql(job_id is not None, after_step is not None), params)
    if not rows:
        await read_key_live(pool, key)
        raise not_found("task", task_id)
    return metrics_body(task_id, rows, job_id, max_points)
