"""Deleting a placement's RQ job where the service and the node daemons race to do it. A
placement's job may be deleted by the service (unqueued: cancelled or superseded) while a daemon
forgets the same placement after its claim is refused; rq's own delete then finds the job's hash
half gone (no status: InvalidJobOperation) or gone (NoSuchJobError).

The one function of the contract that needs rq: both of its callers (service.queue and the
daemon) hold a Redis connection and have rq; it is imported on call, so the contract itself loads
with the stdlib and pydantic alone and the trainer never pulls rq in."""

from __future__ import annotations

from typing import Any


def delete_job(conn: Any, job_id: str, remove_from_queue: bool = True) -> None:
    """Delete the job if it is there; one deleted meanwhile by another process is not an error
    (what is left of its hash is dropped). Redis errors propagate. conn: a redis.Redis."""
    from rq.exceptions import InvalidJobOperation, NoSuchJobError
    from rq.job import Job

    if not Job.exists(job_id, connection=conn):
        return
    try:
        Job.fetch(job_id, connection=conn).delete(remove_from_queue=remove_from_queue)
    except NoSuchJobError:
        return
    except InvalidJobOperation:  # its hash lost its status mid-delete elsewhere
        conn.delete(Job.key_for(job_id))
