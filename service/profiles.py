"""Throughput profiles learnt from real runs: an executor's ThroughputReport becomes the row of
throughput_profiles that the scheduler's Estimator reads for the next task on the same model.

The key is what the estimator looks up: the task's base model, the GPU type of the placement's
node (not the worker's word), the sequence length, batch_key(batch_sizes) and the GPU count the
rate was measured on. A report replaces the row's numbers with its own (the latest window is the
measurement), so a retried report changes nothing. Only the live placement of a task that is not
over may report: service.worker_api.fence_report, the one fence of every report."""

from __future__ import annotations

import logging

from sqlalchemy import literal_column
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from contract.protocol import ThroughputReport
from service.core.errors import invalid
from service.models import Node, ThroughputProfile, utcnow
from service.scheduler.estimator import batch_key
from service.worker_api import fence_report

log = logging.getLogger("loraplex.profiles")

_BATCH_KEY_MAX = ThroughputProfile.__table__.c.batch_key.type.length


def store_throughput(session: Session, task_id: str, msg: ThroughputReport) -> bool:
    """Upsert the profile a report measured; True when the key is new. 404: unknown task or a
    placement of another task; 409: the task is over or the placement is not live (a superseded
    or finished attempt); 422: more GPUs than the placement holds, a batch size below 1 or a
    batch mix too long to key. Flushes; the caller commits."""
    task, placement = fence_report(session, task_id, msg.placement_id)
    if msg.gpus > len(placement.gpu_indices):
        raise invalid(f"gpus={msg.gpus} but placement {placement.id!r} holds "
                      f"{len(placement.gpu_indices)} GPUs", param="gpus")
    if min(msg.batch_sizes) < 1:  # the contract leaves the items unbounded
        raise invalid("batch sizes must be >= 1", param="batch_sizes")
    key = batch_key(msg.batch_sizes)
    if len(key) > _BATCH_KEY_MAX:
        raise invalid("too many distinct batch sizes to keep as one profile", param="batch_sizes")
    node = session.get(Node, placement.node_id)
    assert node is not None  # placements.node_id is a foreign key
    numbers = {"tokens_per_s": msg.tokens_per_s, "samples_per_s": msg.samples_per_s,
               "memory_k0": msg.memory_k0, "memory_k1": msg.memory_k1, "updated_at": utcnow()}
    stmt = insert(ThroughputProfile).values(
        base_model=task.base_model, gpu_type=node.gpu_type, seq_len=msg.seq_len,
        batch_key=key, gpus=msg.gpus, **numbers)
    stmt = stmt.on_conflict_do_update(constraint="uq_throughput_profiles_key", set_=numbers)
    # xmax is 0 on a row this statement inserted, the locker's id on one it updated
    inserted = bool(session.execute(stmt.returning(literal_column("xmax = 0"))).scalar_one())
    session.flush()
    log.info("throughput profile %s task=%s placement=%s model=%s gpu_type=%s seq_len=%d "
             "batch_key=%s gpus=%d tokens_per_s=%.1f", "stored" if inserted else "updated",
             task.id, placement.id, task.base_model, node.gpu_type, msg.seq_len, key, msg.gpus,
             msg.tokens_per_s)
    return inserted
