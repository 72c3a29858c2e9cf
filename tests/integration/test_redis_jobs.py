"""Deleting a placement's RQ job while another process deletes it too (contract.redis_jobs)."""

from __future__ import annotations

import redis
from rq import Queue
from rq.job import Job

from contract.redis_jobs import delete_job


def test_a_job_deleted_meanwhile_elsewhere_is_not_an_error(redis_server) -> None:
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    queue = Queue("node-a", connection=conn)
    queue.enqueue_call("worker.daemon.run_placement", args=("pl_1",), job_id="placement-pl_1")
    queue.enqueue_call("worker.daemon.run_placement", args=("pl_2",), job_id="placement-pl_2")
    # Another process is half way through deleting pl_1: its hash has lost its status, which
    # makes rq's own delete raise InvalidJobOperation (seen in CI: a daemon crashed on it).
    conn.hdel(Job.key_for("placement-pl_1"), "status")
    delete_job(conn, "placement-pl_1")
    assert not conn.exists(Job.key_for("placement-pl_1"))
    delete_job(conn, "placement-pl_1")  # gone: nothing to do
    delete_job(conn, "placement-pl_9")  # never there
    # An intact job is deleted with rq's own bookkeeping, out of its queue when asked.
    assert "placement-pl_2" in queue.get_job_ids()
    delete_job(conn, "placement-pl_2")
    assert not Job.exists("placement-pl_2", connection=conn)
    assert "placement-pl_2" not in queue.get_job_ids()
