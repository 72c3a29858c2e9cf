"""The event types an endpoint can subscribe to, and which of them each task event (the
``type`` of service.events.add_event) becomes, with the body receivers get.

OpenAI's fine-tuning webhook events (a fine-tuning job is a task: same id), whose body is
OpenAI's: ``{"object": "event", "id", "type", "created_at", "data": {"id": <job id>}}``;
loraplex's own, whose ``data`` is the task or the job as it is at that moment."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from contract.states import TaskState

OPENAI_TYPES = ("fine_tuning.job.succeeded", "fine_tuning.job.failed",
                "fine_tuning.job.cancelled")
TASK_TYPES = ("task.running", "task.paused", "task.succeeded", "task.failed", "task.cancelled")
# job.failed: a job its executor reported failed (the jobs a task's end stops are told by the
# task's event, not one by one).
JOB_TYPES = ("job.exited", "job.completed", "job.failed")
# task.samples: the completions a task ended with are stored (GET /v1/tasks/{id}/samples)
SAMPLES_TYPE = "task.samples"
TEST_TYPE = "webhook.test"  # POST /v1/webhooks/{id}/test only; nothing subscribes to it
EVENT_TYPES = (*OPENAI_TYPES, *TASK_TYPES, SAMPLES_TYPE, *JOB_TYPES)

# add_event's type -> the webhook event types it is.
FROM_TASK_EVENT: dict[str, tuple[str, ...]] = {
    "task_running": ("task.running",),
    "task_paused": ("task.paused",),
    "task_succeeded": ("task.succeeded", "fine_tuning.job.succeeded"),
    "task_failed": ("task.failed", "fine_tuning.job.failed"),
    "task_cancelled": ("task.cancelled", "fine_tuning.job.cancelled"),
    "job_exited": ("job.exited",),
    "job_completed": ("job.completed",),
    "job_failed": ("job.failed",),
    "samples": (SAMPLES_TYPE,),
}


def event_body(event_id: str, type: str, created_at: datetime, data: dict[str, Any]) -> dict:
    """What a receiver gets, in the shape of OpenAI's webhook events."""
    return {"object": "event", "id": event_id, "type": type,
            "created_at": int(created_at.timestamp()), "data": data}


def event_data(type: str, task_id: str, meta: dict | None, message: str, job_id: str | None,
               data: dict | None) -> dict[str, Any]:
    """The ``data`` of a webhook event made from a task event (add_event's arguments)."""
    data = data or {}
    if type.startswith("fine_tuning.job."):
        return {"id": task_id}
    if type == SAMPLES_TYPE:
        return {"id": task_id, "object": "task.samples", "file_id": data.get("file_id"),
                "prompts": data.get("prompts"), "configurations": data.get("configurations"),
                "metadata": meta}
    if type.startswith("job."):
        return {"id": job_id, "object": "job", "task_id": task_id, "state": type[4:],
                "exit_reason": data.get("exit_reason"), "best_val_loss": data.get("best_val_loss"),
                "best_step": data.get("best_step"), "attempt": data.get("attempt")}
    state = type[5:]
    out: dict[str, Any] = {"id": task_id, "object": "task", "state": state, "message": message,
                           "metadata": meta}
    if state == TaskState.SUCCEEDED:
        out["best_job_id"] = job_id
    if state == TaskState.RUNNING:
        out["attempt"] = data.get("attempt")
    return out
