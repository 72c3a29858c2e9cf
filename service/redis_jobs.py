"""Deleting RQ jobs where the service and the node daemons race to do it (redis and rq only: the
daemon imports this too). A placement's job may be deleted by the service (unqueued: cancelled or
superseded) while a daemon forgets the same placement after its claim is refused; rq's own delete
then finds the job's hash half gone (no status: InvalidJobOperation) or gone (NoSuchJobError)."""

from __future__ import annotations

import redis
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job


def delete_job(conn: redis.Redis, job_id: str, remove_from_queue: bool = True) -> None:
    """Delete the job if it is there; one deleted meanwhile by another process is not an error
    (what is left of its hash is dropped). Redis errors propagate."""
    if not Job.exists(job_id, connection=conn):
        return
    try:
        Job.fetch(job_id, connection=conn).delete(remove_from_queue=remove_from_queue)
    except NoSuchJobError:
        return
    except InvalidJobOperation:  # its hash lost its status mid-delete elsewhere
        conn.delete(Job.key_for(job_id))
