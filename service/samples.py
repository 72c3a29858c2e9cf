"""A task's samples (issue 44): the completions its executor made at the end of the search for a
few held-out prompts, from the leading adapters and the base model side by side (the TaskSamples
report). Kept as a JSONL result file of the tenant (purpose fine-tune-results, one row per
completion: prompt, job_id, completion, tokens; the base model's rows have job_id null),
announced by a `samples` event (and the webhook event task.samples), read back by GET /v1/tasks/{id}/samples. The file's id is
derived from the task's, so a repeated report stores one file; deleting the task's files deletes it.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging

from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from contract.protocol import TaskSamples
from service.core.storage import Storage
from service.events import add_event
from service.models import File, Job, Task
from service.result_files import PURPOSE

log = logging.getLogger("loraplex.samples")


def samples_file_id(task_id: str) -> str:
    """The one id a task's samples file can have (derived, the shape of every file id)."""
    return "file_" + hashlib.sha256(f"samples:{task_id}".encode()).hexdigest()[:24]


# samples_file_id in SQL ({task}: the tasks row's alias), for the task views' result_files
SAMPLES_FILE_SQL = "'file_' || substr(encode(sha256(convert_to('samples:' || {task}.id, 'UTF8')), 'hex'), 1, 24)"


def store_samples(session: Session, storage: Storage, task: Task, msg: TaskSamples) -> int:
    """Keep the report as the task's samples file and announce it (1 stored, 0 for a repeat).
    Rows naming a job the task does not have are refused (ValueError); flushes, the caller commits."""
    file_id = samples_file_id(task.id)
    if session.get(File, file_id) is not None:
        return 0
    jobs = {j.id for j in session.query(Job.id).filter(Job.task_id == task.id)}
    unknown = sorted({s.job_id for s in msg.samples if s.job_id is not None} - jobs)
    if unknown:
        raise ValueError(f"samples name jobs the task does not have: {unknown[:3]}")
    body = "".join(json.dumps(s.model_dump(mode="json")) + "\n" for s in msg.samples).encode()
    key = f"files/{task.tenant_id}/{file_id}.jsonl"
    storage.put(key, io.BytesIO(body))
    session.execute(insert(File).values(
        id=file_id, tenant_id=task.tenant_id, filename=f"{task.id}_samples.jsonl", purpose=PURPOSE,
        format="jsonl", bytes=len(body), line_count=len(msg.samples),
        sha256=hashlib.sha256(body).hexdigest(), storage_key=key).on_conflict_do_nothing(index_elements=["id"]))
    prompts = len({s.prompt for s in msg.samples})
    configs = len({s.job_id for s in msg.samples})
    # a service event (once: the file's id is derived), so the webhook outbox announces it too
    add_event(session, task.id, "samples",
              f"samples: {prompts} prompts x {configs} configurations (base model included)",
              data={"file_id": file_id, "prompts": prompts, "configurations": configs})
    session.flush()
    log.info("samples stored task=%s file=%s rows=%d", task.id, file_id, len(msg.samples))
    return 1


def read_samples(session: Session, storage: Storage, task: Task) -> tuple[str | None, list[dict]]:
    """The task's samples file id and rows ((None, []) before any, or after the tenant deleted it)."""
    row = session.get(File, samples_file_id(task.id))
    if row is None or row.deleted_at is not None:
        return None, []
    with storage.open(row.storage_key) as fh:
        return row.id, [json.loads(line) for line in fh.read().decode().splitlines() if line.strip()]
