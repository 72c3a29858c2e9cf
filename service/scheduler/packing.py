"""Cumulative-level helpers of the planner: serial list scheduling (hint, horizon, fallback) and the
sweep that turns a per-node cumulative schedule into concrete GPU indices.

Why the cumulative model is exact (the planner relies on this): on one node, tasks are intervals
on a line holding g_i GPUs each. Sweep start times in order, freeing the GPUs of tasks that ended
at or before t before starting those that begin at t. When task i starts at t the tasks still
holding GPUs are exactly those with s <= t < e, whose total demand including i is at most the
node's GPU count (the cumulative constraint at time t), so at least g_i GPUs are free: the sweep
never fails. Running (pinned) tasks hold their fixed GPUs from time 0, which the sweep takes first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class Option:
    """One way to run a task: on node ``node`` with ``gpus`` GPUs for ``duration`` time units."""

    node: int
    gpus: int
    duration: int


@dataclass
class UJob:
    """A task in time units relative to now (the planner's internal, solver-facing form)."""

    index: int
    task_id: str
    tenant: str
    weight: int
    release: int
    max_start: int | None
    options: list[Option]
    pinned_gpus: tuple[int, ...] | None = None  # set for running tasks (one option, start <= 0)
    pinned_start: int = 0
    hint_node: int | None = None
    hint_start: int | None = None
    hint_gpus: tuple[int, ...] = ()
    preemptible: bool = True  # a running task that quota reclaim may pause


@dataclass
class Placed:
    job: UJob
    option: Option
    start: int

    @property
    def end(self) -> int:
        return self.start + self.option.duration


@dataclass
class Timeline:
    """Usage of one capacity (a node's GPUs or a tenant's GPU limit) over time."""

    capacity: int
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, demand)

    def usage_ok(self, start: int, end: int, demand: int) -> bool:
        """Room for ``demand`` over [start, end): the spans meeting it are checked at ``start``
        and at their own starts (usage only rises there)."""
        room = self.capacity - demand
        meet = [(s, e, d) for s, e, d in self.spans if s < end and e > start]
        if sum(d for _, _, d in meet) <= room:
            return True
        for t in [start, *(s for s, _, _ in meet if s > start)]:
            if sum(d for s, e, d in meet if s <= t < e) > room:
                return False
        return True


def earliest_fit(node: Timeline, tenant: Timeline | None, release: int, duration: int,
                 gpus: int, latest: int | None = None) -> int | None:
    """Earliest t >= release where the node (and the tenant's limit) can hold ``gpus`` for
    ``duration``. Only release and span ends can be the earliest such time. With ``latest``,
    None when no such t <= latest exists."""
    ends = {release, *(e for _, e, _ in node.spans if e > release)}
    if tenant is not None:
        ends.update(e for _, e, _ in tenant.spans if e > release)
    for t in sorted(ends):
        if latest is not None and t > latest:
            return None
        if node.usage_ok(t, t + duration, gpus) and (
                tenant is None or tenant.usage_ok(t, t + duration, gpus)):
            return t
    # Unreachable while every capacity >= every demand: after the last end everything is free.
    raise ValueError("no fit: demand exceeds capacity")


def timelines(node_caps: Sequence[int], tenant_caps: dict[str, int],
              pinned: Iterable[Placed], held: Mapping[str, Sequence[tuple[int, int]]] | None = None
              ) -> tuple[list[Timeline], dict[str, Timeline]]:
    """The nodes' and capped tenants' timelines with the running tasks and ``held``: per
    tenant, (end, GPUs) spans from 0 that count against its cap only (encode.held_spans)."""
    nodes = [Timeline(c) for c in node_caps]
    tenants = {t: Timeline(c) for t, c in tenant_caps.items()}
    for p in pinned:
        span = (0, p.end, p.option.gpus)
        nodes[p.option.node].spans.append(span)
        if p.job.tenant in tenants:
            tenants[p.job.tenant].spans.append(span)
    for tenant, spans in (held or {}).items():
        if tenant in tenants:
            tenants[tenant].spans.extend((0, end, g) for end, g in spans)
    return nodes, tenants


def list_schedule(order: Sequence[UJob], node_caps: Sequence[int], tenant_caps: dict[str, int],
                  pinned: Sequence[Placed], follow_hints: bool = False,
                  held: Mapping[str, Sequence[tuple[int, int]]] | None = None) -> list[Placed]:
    """Serial schedule generation: each task in ``order`` goes to the (node, time) where it ends
    first (ties: the fuller node). With follow_hints, a hinted task tries its hinted node first
    and keeps it unless that would start it later than its hinted start."""
    nodes, tenants = timelines(node_caps, tenant_caps, pinned, held)
    placed: list[Placed] = []
    for job in order:
        tenant = tenants.get(job.tenant)
        best: tuple[int, int, Option] | None = None
        seen: set[tuple] = set()
        for opt in job.options:
            hinted = follow_hints and opt.node == job.hint_node
            node = nodes[opt.node]
            # Nodes in the same state (capacity and spans) give the same fit and load, and the
            # first of them wins the tie: the others need no second look.
            state = (node.capacity, opt.gpus, opt.duration, *sorted(node.spans))
            if not hinted and state in seen:
                continue
            seen.add(state)
            # A start after best end - duration cannot win (ties go to the fuller node).
            latest = None if best is None or hinted else best[0] - opt.duration
            t = earliest_fit(node, tenant, job.release, opt.duration, opt.gpus, latest)
            if t is None:
                continue
            if hinted and (job.hint_start is None or t <= max(job.hint_start, job.release)):
                best = (t + opt.duration, -10**9, opt)
                break
            if best is not None and t + opt.duration > best[0]:
                continue
            load = -sum(e - max(s, 0) for s, e, _ in node.spans)
            key = (t + opt.duration, load, opt)
            if best is None or key[:2] < best[:2]:
                best = key
        assert best is not None
        opt = best[2]
        start = best[0] - opt.duration
        nodes[opt.node].spans.append((start, start + opt.duration, opt.gpus))
        if tenant is not None:
            tenant.spans.append((start, start + opt.duration, opt.gpus))
        placed.append(Placed(job, opt, start))
    return placed


def assign_gpus(placed: Sequence[Placed], node_caps: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Concrete GPU indices for a cumulative-feasible schedule (see the module docstring).
    Pinned tasks keep theirs; others prefer their hinted GPUs, else the lowest free ones."""
    out: dict[str, tuple[int, ...]] = {}
    by_node: dict[int, list[Placed]] = {}
    for p in placed:
        by_node.setdefault(p.option.node, []).append(p)
    for node, items in by_node.items():
        active: list[tuple[int, tuple[int, ...]]] = []  # (end, gpus)
        pinned = [p for p in items if p.job.pinned_gpus is not None]
        for p in pinned:
            active.append((p.end, p.job.pinned_gpus or ()))
            out[p.job.task_id] = tuple(p.job.pinned_gpus or ())
        rest = sorted((p for p in items if p.job.pinned_gpus is None),
                      key=lambda p: (p.start, p.job.index))
        for p in rest:
            active = [(e, g) for e, g in active if e > p.start]
            busy = {i for _, gs in active for i in gs}
            free = [i for i in range(node_caps[node]) if i not in busy]
            need = p.option.gpus
            if len(free) < need:
                raise AssertionError(f"cumulative violated on node {node} at t={p.start}")
            hint = p.job.hint_gpus
            if p.job.hint_node == node and len(hint) == need and set(hint) <= set(free):
                gpus = tuple(sorted(hint))
            else:
                gpus = tuple(free[:need])
            active.append((p.end, gpus))
            out[p.job.task_id] = gpus
    return out
