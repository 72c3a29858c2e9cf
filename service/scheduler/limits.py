"""Per-tenant limits outside the solver: admission of new tasks against max_queued_tasks (429),
a task's own priority against its tenant's operator-set ceiling (422), and each tenant's usage
against its limits for GET /v1/cluster (max_gpus and guaranteed_gpus are in the planner)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from contract.states import TASK_WAITING, TaskState
from service.core.config import Settings
from service.core.errors import ApiError
from service.models import PLACEMENT_ACTIVE, Placement, Task, Tenant
from service.schemas import TenantUsageOut

# "Queued" for the limit: accepted but neither running nor finished (docs/architecture.md task states).


def task_priority_ceiling(tenant: Tenant, settings: Settings) -> int:
    """The highest priority a task of this tenant may ask for (operator-set, else the default)."""
    if tenant.max_task_priority is not None:
        return tenant.max_task_priority
    return settings.scheduler_default_task_priority_ceiling


def check_task_priority(tenant: Tenant, priority: int, settings: Settings) -> None:
    """422 naming ``priority`` when a task asks for more than its tenant's ceiling."""
    ceiling = task_priority_ceiling(tenant, settings)
    if priority > ceiling:
        raise ApiError(422, "priority_above_ceiling",
                       f"priority {priority} is above this tenant's ceiling of {ceiling} (set by "
                       "the operator); ask for at most that", param="priority")


def queued_count(session: Session, tenant_id: str) -> int:
    return int(session.scalar(select(func.count()).select_from(Task).where(
        Task.tenant_id == tenant_id, Task.state.in_(TASK_WAITING))) or 0)


def admit_task(session: Session, tenant: Tenant) -> None:
    """Lock the tenant's row for the rest of the transaction, then 429 if it already has
    max_queued_tasks waiting. The lock makes concurrent creates of one tenant count one after
    the other (the caller's commit releases it); FOR NO KEY UPDATE leaves inserts that only
    reference the tenant (files, keys) unblocked."""
    limit = session.scalar(select(Tenant.max_queued_tasks).where(Tenant.id == tenant.id)
                           .with_for_update(key_share=True))
    if limit is None:
        return
    count = queued_count(session, tenant.id)
    if count >= limit:
        raise ApiError(429, "queue_limit_exceeded",
                       f"tenant has {count} queued tasks and max_queued_tasks is {limit}: "
                       "retry when one starts or finishes, or cancel one",
                       param="max_queued_tasks")


def tenant_usage(session: Session, settings: Settings) -> list[TenantUsageOut]:
    """Tenants that have unfinished tasks or a limit or scheduling setting, with their usage
    (GPUs borrowed beyond the guaranteed share included), by name."""
    waiting = dict(session.execute(select(Task.tenant_id, func.count()).where(
        Task.state.in_(TASK_WAITING)).group_by(Task.tenant_id)).all())
    running = dict(session.execute(select(Task.tenant_id, func.count()).where(
        Task.state == TaskState.RUNNING).group_by(Task.tenant_id)).all())
    gpus: dict[str, int] = {}
    for tenant_id, indices in session.execute(
            select(Task.tenant_id, Placement.gpu_indices).join(Task, Task.id == Placement.task_id)
            .where(Placement.state.in_(PLACEMENT_ACTIVE))):
        gpus[tenant_id] = gpus.get(tenant_id, 0) + len(indices)
    active = set(waiting) | set(running) | set(gpus)
    tenants = session.scalars(select(Tenant).where(
        Tenant.id.in_(active) | Tenant.max_gpus.is_not(None)
        | Tenant.max_queued_tasks.is_not(None) | Tenant.guaranteed_gpus.is_not(None)
        | (Tenant.priority != 0) | Tenant.max_task_priority.is_not(None)).order_by(Tenant.name))
    return [TenantUsageOut(tenant_id=t.id, name=t.name, running_tasks=running.get(t.id, 0),
                           queued_tasks=waiting.get(t.id, 0), gpus_in_use=gpus.get(t.id, 0),
                           max_gpus=t.max_gpus, max_queued_tasks=t.max_queued_tasks,
                           priority=t.priority or 0,
                           max_task_priority=task_priority_ceiling(t, settings),
                           guaranteed_gpus=t.guaranteed_gpus,
                           borrowed_gpus=max(0, gpus.get(t.id, 0) - (t.guaranteed_gpus or 0)))
            for t in tenants]
