"""What a tenant may do to a running task, the same through /v1/tasks and /v1/fine_tuning/jobs:
cancel, pause, resume. Each locks the task, changes it, tells the scheduler when the cluster's
state changed, and returns the task as it now is."""

from __future__ import annotations

from typing import Literal

from sqlalchemy.orm import Session

from contract.states import TaskState
from service import pausing, tasks
from service.cluster import cluster_changed
from service.core.config import Settings
from service.models import Task, Tenant

Action = Literal["cancel", "pause", "resume"]


def act(session: Session, tenant: Tenant, settings: Settings, task_id: str,
        action: Action) -> Task:
    task = tasks.get_task(session, tenant, task_id, lock=True)
    was = task.state
    if action == "cancel":
        tasks.cancel_task(session, task, settings)
        changed = was != TaskState.CANCELLED
    elif action == "pause":  # checkpoint at the next step boundary, free the GPUs
        pausing.request_pause(session, task, requeue=False, reason="paused by the user",
                            settings=settings)
        session.commit()
        changed = task.state != was
    else:  # paused -> queued: placed again, it continues from the pause's checkpoint
        pausing.resume_task(session, task)
        session.commit()
        changed = True
    if changed:
        reason = {"cancel": "task_cancelled", "pause": "task_paused", "resume": "task_resumed"}
        cluster_changed(session, reason[action], settings)
    return tasks.get_task(session, tenant, task_id)
