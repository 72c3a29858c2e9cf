"""What the planner is given and what it answers: the cluster's nodes and unfinished tasks with
the tenants' quotas (Instance), and the plan (Plan: one Assignment per placed task). Pure
dataclasses; times in seconds from now (service.scheduler.planner says how they are planned)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from contract.states import TaskState


@dataclass(frozen=True)
class NodeSpec:
    id: str
    gpu_type: str
    gpu_count: int
    up: bool = True


@dataclass(frozen=True)
class Pinned:
    """Where a running task runs: its node, GPUs and start (seconds, <= 0: before now)."""

    node_id: str
    gpu_indices: tuple[int, ...]
    start_s: int = 0


@dataclass(frozen=True)
class Hint:
    """The task's placement in the previous plan (start in seconds from now)."""

    node_id: str
    start_s: int
    gpu_indices: tuple[int, ...] = ()


@dataclass(frozen=True)
class TaskSpec:
    """An unfinished task. ``duration_s`` is the (remaining, for running tasks) estimate;
    ``by_gpu_type`` overrides (gpus_needed, duration_s) per GPU type. ``arrival_s`` is when it
    was submitted (seconds from now, <= 0; None: now, or its pinned start if running);
    ``max_start_s`` the end of its waiting allowance (arrival + bound, seconds from now, may be
    negative when already overdue): a soft deadline on its start. ``priority`` is the task's own
    (already clamped to its tenant's ceiling), ``tenant_priority`` the operator's for its tenant."""

    id: str
    tenant: str
    gpus_needed: int
    duration_s: int
    priority: int = 0
    state: str = TaskState.QUEUED.value  # queued | running
    pinned: Pinned | None = None
    hint: Hint | None = None
    earliest_start_s: int = 0
    max_start_s: int | None = None
    by_gpu_type: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    arrival_s: int | None = None
    tenant_priority: int = 0
    preemptible: bool = True  # running: False when it is already being stopped

    def need(self, gpu_type: str) -> tuple[int, int]:
        return self.by_gpu_type.get(gpu_type, (self.gpus_needed, self.duration_s))


@dataclass(frozen=True)
class Instance:
    nodes: Sequence[NodeSpec]
    tasks: Sequence[TaskSpec]
    tenant_max_gpus: Mapping[str, int] = field(default_factory=dict)  # hard cap (borrow limit)
    tenant_guaranteed_gpus: Mapping[str, int] = field(default_factory=dict)  # reclaimable share
    # Per tenant, (sum, count) of the slowdowns of its recently finished tasks (tenant_history).
    tenant_history: Mapping[str, tuple[float, int]] = field(default_factory=dict)
    # Per tenant, GPUs it holds outside its tasks' own: (seconds from now until released, GPUs,
    # fractional), e.g. its tasks' shares of shared executors (whose GPUs an occupant task
    # holds). They count against its hard cap only, never against a node.
    tenant_held_gpus: Mapping[str, Sequence[tuple[float, float]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Assignment:
    task_id: str
    node_id: str
    gpu_indices: tuple[int, ...]
    start_s: int
    end_s: int
    pinned: bool = False


@dataclass
class Plan:
    assignments: dict[str, Assignment]
    unschedulable: dict[str, str]  # task id -> why it cannot be placed
    status: str  # OPTIMAL | FEASIBLE | HEURISTIC (warm start kept) | EMPTY
    makespan_s: int
    makespan_bound_s: int
    weighted_completion_s: int  # the objective value of the plan (see the module docstring)
    solve_time_s: float
    late: dict[str, int] = field(default_factory=dict)  # task -> seconds planned past its bound
    preempt: list[str] = field(default_factory=list)  # running tasks to pause and requeue
    objective_bound: int = 0
    makespan_time_s: float = 0.0  # wall time to the warm start (model build included)

    def starts_now(self) -> dict[str, int]:
        """The queued tasks this plan starts now (at 0, on GPUs), with their GPU counts."""
        return {t: len(a.gpu_indices) for t, a in self.assignments.items()
                if not a.pinned and a.start_s == 0}

    @property
    def relaxed_waiting(self) -> bool:
        """Some task is planned to start after its waiting bound (only the late ones are)."""
        return bool(self.late)

    @property
    def gap(self) -> float:
        """Relative gap of the objective to CP-SAT's bound (0.0 = proven optimal)."""
        if self.weighted_completion_s <= 0:
            return 0.0
        return max(0.0, (self.weighted_completion_s - self.objective_bound)
                   / self.weighted_completion_s)
