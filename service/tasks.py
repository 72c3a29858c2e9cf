"""Tasks and jobs: creation (grid expansion, Idempotency-Key), cancel, job state
changes and the terminal transitions. Plain functions over a session; routes stay thin."""

from __future__ import annotations

import itertools
import logging

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from contract.families import UnsupportedModel, family_of, model_type_of, resolve_targets
from contract.methods import DEFAULT_METHOD, grid_knobs, method_spec
from contract.protocol import JobStateUpdate, tenant_safe
from contract.states import (
    PLACEMENT_ACTIVE,
    PLACEMENT_CURRENT,
    JobState,
    PlacementState,
    TaskState,
)
from service import idempotency, learning_rates, lifecycle
from service.core.config import Settings
from service.core.errors import ApiError, conflict, invalid, not_found
from service.core.registry import BaseModelEntry, ModelRegistry
from service.core.storage import Storage
from service.events import add_event
from service.files import get_file
from service.idempotency import accepted_digests
from service.init_adapter import resolve_init_adapter
from service.models import (
    JOB_TERMINAL,
    TASK_TERMINAL,
    Artifact,
    IdempotencyKey,
    Job,
    Placement,
    Task,
    Tenant,
    utcnow,
)
from service.pausing import request_pause as request_pause  # re-exported: the stop moves' home
from service.pausing import retire_waiting_placements
from service.queue import publish_cancel, unqueue_placement
from service.scheduler.limits import admit_task, check_task_priority
from service.schemas import TaskCreate, finite
from service.tracking.integrations import (
    add_integrations,
    check_integrations,
)

log = logging.getLogger("loraplex.tasks")


def expand_grid(space: dict[str, list], method: str = DEFAULT_METHOD) -> list[dict]:
    """The cartesian product of the method's knobs of the search space, in a stable order (first
    knob slowest); a method's own knob a stored space lacks (stored before it existed) is its
    default."""
    knobs = grid_knobs(method)
    space = {**{k.name: [k.default] for k in method_spec(method).knobs}, **space}
    return [dict(zip(knobs, values, strict=True))
            for values in itertools.product(*(space[k] for k in knobs))]


def auto_centre(registry: ModelRegistry, model: str) -> float:
    """The centre learning rate of "auto" for a registered base model (service.learning_rates);
    the generic one of the default size for a name the registry lacks (the create 422s)."""
    entry = registry.get(model)
    if entry is None:
        return learning_rates.centre_learning_rate(None, learning_rates.DEFAULT_PARAMETERS)
    return learning_rates.model_centre(entry.path, entry.family, entry.parameters)


def resolve_auto(body: TaskCreate, registry: ModelRegistry) -> TaskCreate:
    """The task with a learning rate of "auto" replaced by the grid around its base model's
    centre (what the task stores and trains); the body itself when it names its rates."""
    if body.search_space.learning_rate != "auto":
        return body
    rates = learning_rates.auto_learning_rates(auto_centre(registry, body.base_model))
    space = body.search_space.model_copy(update={"learning_rate": rates})
    return body.model_copy(update={"search_space": space})


def resolve_adapter(session: Session, storage: Storage | None, tenant: Tenant, body: TaskCreate,
                    registry: ModelRegistry) -> TaskCreate:
    """The task with what its init_adapter_file fixes filled in (service.init_adapter)."""
    if body.init_adapter_file is None:
        return body
    if storage is None:
        raise invalid("init_adapter_file is not supported here", param="init_adapter_file")
    return resolve_init_adapter(session, storage, tenant, body, registry)


def _check_request(session: Session, tenant: Tenant, body: TaskCreate, settings: Settings,
                   registry: ModelRegistry) -> tuple[int, int]:
    """4xx for anything wrong in the request; returns (max_seq_len, number of train samples)."""
    model = registry.get(body.base_model)
    if model is None:
        names = ", ".join(m.name for m in registry.all()) or "none registered"
        raise invalid(f"unknown base_model {body.base_model!r} (available: {names})",
                      param="base_model", code="model_not_found")
    _check_targets(model, body.target_modules)
    check_integrations(body.integrations, settings)
    check_task_priority(tenant, body.priority, settings)
    max_seq_len = body.max_seq_len or min(2048, model.max_seq_len)
    if max_seq_len > model.max_seq_len:
        raise invalid(f"max_seq_len {max_seq_len} exceeds {model.name}'s {model.max_seq_len}",
                      param="max_seq_len")
    n_configs = 1
    for knob in grid_knobs(body.method):
        n_configs *= len(getattr(body.search_space, knob))
    if n_configs > settings.max_configurations:
        raise invalid(f"search space expands to {n_configs} configurations; the limit is "
                      f"{settings.max_configurations}", param="search_space",
                      code="too_many_configurations")
    allowed = method_spec(body.method).formats
    train = get_file(session, tenant, body.training_file, param="training_file")
    if train.format not in allowed:
        raise invalid(f"method {body.method} needs a {' or '.join(allowed)} file; "
                      f"{train.id} is {train.format}", param="training_file")
    samples = train.line_count
    if body.validation_file is not None:
        val = get_file(session, tenant, body.validation_file, param="validation_file")
        if val.format not in allowed:
            raise invalid(f"method {body.method} needs a {' or '.join(allowed)} file; "
                          f"{val.id} is {val.format}", param="validation_file")
    else:
        held_out = max(1, round(samples * body.validation_split))
        if samples - held_out < 1:
            raise invalid(f"training file has {samples} records: too few to hold out a "
                          "validation split; upload a validation_file", param="training_file")
        samples -= held_out
    return max_seq_len, samples


check_request = _check_request  # dry runs check as a create does (service.dry_run)


def _check_targets(model: BaseModelEntry, targets: list[str] | None) -> None:
    """422 unless the model's family is one the trainer knows and every target module exists
    in it, so a task never fails on this after it was scheduled. The family is the model's own
    config.json `model_type` where the API can read it, else the registry entry's `family` (in
    docker-compose only the workers mount the models)."""
    try:
        family = family_of(model_type_of(model.path) or model.family)
    except UnsupportedModel as exc:
        raise invalid(f"base model {model.name!r} cannot be fine-tuned here: {exc}",
                      param="base_model", code="unsupported_model") from exc
    try:
        resolve_targets(family, targets)
    except UnsupportedModel as exc:
        raise invalid(str(exc), param="target_modules") from exc


def create_task(session: Session, tenant: Tenant, body: TaskCreate, settings: Settings,
                registry: ModelRegistry, idempotency_key: str | None = None,
                storage: Storage | None = None, sent: object = None) -> tuple[Task, bool]:
    """Create a task and its jobs, committed; (task, created). With an idempotency key, the same
    key and request return the first task (created=False); another request is a 409. The key
    holds the digest of the canonical request (`canonical_request`); sent: the request's JSON as
    the client sent it, also accepted. storage: where an init_adapter_file is read (needed only
    with one)."""
    accepted = accepted_digests(body, sent)
    digest = accepted[0]
    if idempotency_key is not None:
        if not (0 < len(idempotency_key) <= 255):
            raise invalid("Idempotency-Key must be 1-255 characters", param="Idempotency-Key")
        replay = idempotency.replay(session, tenant, idempotency_key, accepted)
        if replay is not None:
            return replay, False
    body = resolve_auto(body, registry)  # after the digest: a replay hashes what was sent
    body = resolve_adapter(session, storage, tenant, body, registry)
    max_seq_len, samples = _check_request(session, tenant, body, settings, registry)
    # 429 at the tenant's max_queued_tasks; locks the tenant row until the commit, so two
    # creates at limit-1 count one after the other. A rejected create claims no key.
    admit_task(session, tenant)
    if idempotency_key is not None:
        replay = idempotency.replay(session, tenant, idempotency_key, accepted)  # a twin committed meanwhile
        if replay is not None:
            return replay, False
    try:
        task = _insert_task(session, tenant, body, max_seq_len, samples, idempotency_key, digest)
    except IntegrityError:
        # Another request with the same Idempotency-Key committed first: answer with its task.
        session.rollback()
        replay = idempotency.replay(session, tenant, idempotency_key, accepted) if idempotency_key else None
        if replay is None:
            raise
        return replay, False
    log.info("task created task=%s tenant=%s", task.id, tenant.id)
    return task, True


def _insert_task(session: Session, tenant: Tenant, body: TaskCreate, max_seq_len: int,
                 samples: int, idempotency_key: str | None, digest: str) -> Task:
    claim: IdempotencyKey | None = None
    if idempotency_key is not None:
        # Claim the key first: a concurrent twin blocks here and then fails on the primary key.
        claim = IdempotencyKey(tenant_id=tenant.id, key=idempotency_key, request_hash=digest,
                               resource_id="pending")
        session.add(claim)
        session.flush()
    task = Task(tenant_id=tenant.id, base_model=body.base_model, method=body.method,
                training_file_id=body.training_file, validation_file_id=body.validation_file,
                init_adapter_file_id=body.init_adapter_file,
                search_space=body.search_space.model_dump(mode="json"),
                settings=body.task_settings().model_copy(update={"max_seq_len": max_seq_len})
                .model_dump(mode="json"),
                priority=body.priority, num_train_samples=samples,
                state=TaskState.VALIDATING_FILES.value,
                suffix=body.suffix, meta=body.metadata)
    session.add(task)
    session.flush()
    configs = expand_grid(task.search_space, task.method)
    for index, config in enumerate(configs):
        session.add(Job(task_id=task.id, index=index, config=config))
    add_integrations(session, task.id, body.integrations)
    if claim is not None:
        claim.resource_id = task.id
    add_event(session, task.id, "task_created", f"task created with {len(configs)} jobs")
    # Files were validated line by line at upload; the references were checked above.
    lifecycle.queue_task(task)
    add_event(session, task.id, "task_queued", "files validated; waiting for GPUs")
    session.commit()
    return task


def get_task(session: Session, tenant: Tenant, task_id: str, lock: bool = False) -> Task:
    query = select(Task).where(Task.id == task_id, Task.tenant_id == tenant.id)
    task = session.scalar(query.with_for_update() if lock else query)
    if task is None:
        raise not_found("task", task_id)
    return task


def get_job(session: Session, tenant: Tenant, job_id: str) -> Job:
    job = session.scalar(select(Job).join(Task, Task.id == Job.task_id).where(
        Job.id == job_id, Task.tenant_id == tenant.id))
    if job is None:
        raise not_found("job", job_id)
    return job


def cancel_task(session: Session, task: Task, settings: Settings) -> Task:
    """Cancel a task that has not finished (a second cancel is a no-op); 409 once it ended."""
    if task.state == TaskState.CANCELLED:
        return task
    if task.state in TASK_TERMINAL:
        raise conflict(f"task {task.id!r} already {task.state}", code="task_finished")
    now = utcnow()
    lifecycle.cancel_task(task, now)
    for job in session.scalars(select(Job).where(Job.task_id == task.id,
                                                 Job.state.not_in(JOB_TERMINAL))):
        lifecycle.cancel_job(job, now)
    unqueue: list[tuple[str, str]] = []
    stop: list[str] = []  # attempts a daemon may be running: stop exactly those
    for placement in session.scalars(select(Placement).where(
            Placement.task_id == task.id,
            Placement.state.in_(PLACEMENT_CURRENT))):
        if placement.state == PlacementState.PUBLISHED:
            unqueue.append((placement.id, placement.node_id))
        if placement.state in PLACEMENT_ACTIVE:
            stop.append(placement.id)
        lifecycle.cancel_placement(placement, now)
    add_event(session, task.id, "task_cancelled", "cancelled by the user")
    session.commit()
    for pid, node_id in unqueue:
        unqueue_placement(pid, node_id, settings)
    publish_cancel(stop, settings)
    log.info("task cancelled task=%s", task.id)
    return task


def update_job_state(session: Session, task: Task, job: Job, msg: JobStateUpdate,
                     placement: Placement) -> Job:
    """Apply a job state change reported by `placement`, the task's current attempt (the caller
    fenced it: service.worker_api.fence_report). Repeating the current terminal state is a no-op
    (retry); leaving a terminal state is a 409. A job the requeue put back to pending goes to
    running again when the new attempt resumes it; the first job running moves the attempt from
    claimed to running."""
    if (msg.state == JobState.EXITED) != (msg.exit_reason is not None):
        raise invalid(f"exit_reason is required with state '{JobState.EXITED}' and only then",
                      param="exit_reason")
    if job.state in JOB_TERMINAL:
        if msg.state == job.state:
            return job
        raise conflict(f"job {job.id!r} is already {job.state}", code="job_finished")
    if task.state in TASK_TERMINAL:  # fenced before; kept so this function is safe on its own
        raise conflict(f"task {task.id!r} is {task.state}", code=f"task_{task.state}")
    now = utcnow()
    previous = job.state
    lifecycle.report_job(job, msg.state, now)  # 409 on a move JOB_TRANSITIONS does not list
    job.exit_reason = msg.exit_reason
    for field in ("best_val_loss", "best_step", "last_step"):
        value = getattr(msg, field)
        if value is not None:
            setattr(job, field, value)
    if msg.error is not None:  # shown to the tenant: no traceback, no server path
        job.error = tenant_safe(msg.error)
    if msg.state == JobState.RUNNING and placement.state == PlacementState.CLAIMED:
        lifecycle.start_placement(placement)
    if previous != msg.state:
        text = f"job {job.index} {msg.state}" + (f" ({msg.exit_reason})" if msg.exit_reason else "")
        add_event(session, task.id, f"job_{msg.state}", text, job_id=job.id,
                  data={"exit_reason": msg.exit_reason, "best_val_loss": finite(job.best_val_loss),
                        "best_step": job.best_step, "attempt": placement.attempt},
                  level="error" if msg.state == JobState.FAILED else "info")
    return job


def pick_best_job(session: Session, task: Task) -> str | None:
    """The job with an adapter and the lowest finite best validation loss (ties: lowest index)."""
    rows = session.execute(select(Job.id, Job.best_val_loss, Job.index).join(
        Artifact, (Artifact.job_id == Job.id) & (Artifact.kind == "adapter")).where(
        Job.task_id == task.id)).all()
    if not rows:
        return None
    rows.sort(key=lambda r: (finite(r[1]) is None, finite(r[1]) or 0.0, r[2]))
    return rows[0][0]


def finish_task_succeeded(session: Session, task: Task, best_job_id: str | None) -> None:
    now = utcnow()
    retire_waiting_placements(session, task)
    for job in session.scalars(select(Job).where(Job.task_id == task.id,
                                                 Job.state.not_in(JOB_TERMINAL))):
        lifecycle.fail_job(job, now, "task ended before this job finished")
    # The service's pick first: it sees every attempt's jobs, while an executor that resumed
    # saw only the jobs that ended in its own run (the same rule, so without a resume they agree)
    best_job_id = pick_best_job(session, task) or best_job_id
    if best_job_id is None:
        finish_task_failed(session, task, "no job produced an adapter")
        return
    lifecycle.succeed_task(task, best_job_id, now)
    add_event(session, task.id, "task_succeeded", f"best job {best_job_id}", job_id=best_job_id)


def finish_task_failed(session: Session, task: Task, error: str) -> None:
    """Fail the task for good; `error` is what the tenant reads (made tenant-safe here too)."""
    error = tenant_safe(error) or "training failed"
    now = utcnow()
    retire_waiting_placements(session, task)
    for job in session.scalars(select(Job).where(Job.task_id == task.id,
                                                 Job.state.not_in(JOB_TERMINAL))):
        lifecycle.fail_job(job, now)
    lifecycle.fail_task(task, error, now)
    add_event(session, task.id, "task_failed", error, level="error")


def ensure_not_terminal(task: Task) -> None:
    if task.state in TASK_TERMINAL:
        raise ApiError(409, f"task_{task.state}", f"task {task.id!r} is {task.state}")
