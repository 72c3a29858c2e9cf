"""The Redis side: placements go to one RQ queue per node, cancels of placements (attempts, never a
bare task) to a key + pub/sub channel. Postgres stays the source of truth; republish_all() rebuilds
the queues after a Redis wipe, and heartbeat replies carry every cancel again."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import lru_cache

import redis
from rq import Queue
from rq.job import Job
from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.protocol import (
    CANCEL_CHANNEL,
    PLACEMENT_FUNC,
    cancel_key,
    node_queue_name,
    placement_job_id,
)
from contract.redis_jobs import delete_job
from contract.states import PlacementState
from service import lifecycle
from service.core.config import Settings, get_settings
from service.core.db import after_commit
from service.models import Placement, utcnow

log = logging.getLogger("loraplex.queue")

CANCEL_TTL_S = 7 * 24 * 3600
_configured_url: str | None = None


def configure(redis_url: str) -> None:
    """Set the Redis URL used when callers (e.g. the scheduler) pass no settings."""
    global _configured_url
    _configured_url = redis_url


@lru_cache(maxsize=8)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def get_redis(settings: Settings | None = None) -> redis.Redis:
    url = settings.redis_url if settings else (_configured_url or get_settings().redis_url)
    return _client(url)


def enqueue_placement(conn: redis.Redis, placement_id: str, node_id: str) -> bool:
    """Put the placement id on its node's queue unless it already waits there. True if pushed."""
    queue = Queue(node_queue_name(node_id), connection=conn)
    job_id = placement_job_id(placement_id)
    if Job.exists(job_id, connection=conn):
        if job_id in queue.get_job_ids():
            return False
        delete_job(conn, job_id)
    queue.enqueue_call(PLACEMENT_FUNC, args=(placement_id,), job_id=job_id, timeout=-1,
                       result_ttl=3600, failure_ttl=24 * 3600)
    return True


def publish_placement(session: Session, placement: Placement,
                      settings: Settings | None = None) -> None:
    """Mark the placement published and, once the transaction commits, queue it for its node.
    A Redis failure is logged, not raised: republish_all() repairs the queue later."""
    lifecycle.publish_placement(placement, utcnow())
    session.flush()
    conn = get_redis(settings)
    pid, node_id = placement.id, placement.node_id

    def _push() -> None:
        try:
            enqueue_placement(conn, pid, node_id)
            log.info("placement published placement=%s node=%s", pid, node_id)
        except redis.RedisError as exc:
            log.warning("placement publish failed placement=%s node=%s error=%s", pid, node_id, exc)

    after_commit(session, _push)


def publish_cancel(placement_ids: str | Iterable[str], settings: Settings | None = None) -> None:
    """Tell the workers now that these placements must stop: for each one a key
    ``cancel_key(placement_id)`` (with a TTL) and a message on CANCEL_CHANNEL. A daemon stops
    exactly the placements named, so a new attempt of the same task runs on. Heartbeat replies
    carry the same news if this is lost (Redis down or wiped). A str is one placement id."""
    ids = [placement_ids] if isinstance(placement_ids, str) else list(placement_ids)
    if not ids:
        return
    try:
        conn = get_redis(settings)
        pipe = conn.pipeline(transaction=False)
        for placement_id in ids:
            pipe.set(cancel_key(placement_id), "1", ex=CANCEL_TTL_S)
            pipe.publish(CANCEL_CHANNEL, placement_id)
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("cancel publish failed placements=%s error=%s", ",".join(ids), exc)


def unqueue_placement(placement_id: str, node_id: str, settings: Settings | None = None) -> None:
    """Drop a published placement from its queue (superseded/cancelled before any claim)."""
    try:
        conn = get_redis(settings)
        Queue(node_queue_name(node_id), connection=conn).remove(placement_job_id(placement_id))
        delete_job(conn, placement_job_id(placement_id))
    except redis.RedisError as exc:
        log.warning("unqueue failed placement=%s error=%s", placement_id, exc)


def empty_node_queue(node_id: str, settings: Settings | None = None) -> int:
    """Drop every placement waiting in a node's queue (the node left); returns how many. A
    Redis failure is logged: the placements are superseded in Postgres, so a daemon that pops a
    leftover later has its claim refused."""
    try:
        return int(Queue(node_queue_name(node_id), connection=get_redis(settings)).empty() or 0)
    except redis.RedisError as exc:
        log.warning("queue empty failed node=%s error=%s", node_id, exc)
        return 0


def republish_all(session: Session, settings: Settings | None = None) -> int:
    """Re-queue every published-but-unclaimed placement from Postgres; returns how many were
    pushed (those already waiting in their queue are left alone)."""
    conn = get_redis(settings)
    rows = session.scalars(select(Placement).where(
        Placement.state == PlacementState.PUBLISHED)).all()
    pushed = sum(enqueue_placement(conn, p.id, p.node_id) for p in rows)
    if pushed:
        log.info("republished placements count=%d", pushed)
    return pushed
