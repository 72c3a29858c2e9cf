"""Shared executors as the plan sees them (service.scheduler.colocation): what nodes' heartbeats
report (contract.protocol.ExecutorReport), kept only while fresh (``fresh_executors``) and as the
database confirms them (``usable_executors``), and the live placements' shares of their GPUs
(``task_shares``, ``tenant_usage``). Pure: no database, no clock."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TypeVar

from contract.protocol import ExecutorReport

T = TypeVar("T")


@dataclass
class WarmExecutor:
    """A shared executor as reported (``free_rows`` is decremented as tasks join it)."""

    node_id: str
    gpu_type: str
    key: str
    gpus: tuple[int, ...]
    placement_ids: tuple[str, ...]
    free_rows: int
    total_rows: int
    queued_jobs: int = 0
    hold_end_s: int = 0  # when its GPUs are free again as planned (0: idle, free now)

    @property
    def idle(self) -> bool:
        return not self.placement_ids

    @property
    def ref(self) -> str:
        return f"{self.node_id}:{','.join(map(str, self.gpus))}"


@dataclass(frozen=True)
class NodeReports:
    """What loop.py reads of a node row for co-location."""

    id: str
    gpu_type: str
    gpu_count: int
    up: bool
    executors: list | None
    executors_at: datetime | None


def fresh_executors(nodes: Iterable[NodeReports], now: datetime, timeout_s: float
                    ) -> list[WarmExecutor]:
    """The executors of up nodes whose report is younger than timeout_s; malformed entries (and
    GPUs the node does not have) are skipped. Sorted by node and GPUs: deterministic."""
    out = []
    for node in nodes:
        if not node.up or node.executors_at is None or not node.executors:
            continue
        if (now - node.executors_at).total_seconds() > timeout_s:
            continue
        for raw in node.executors:
            try:
                r = ExecutorReport.model_validate(raw)
            except ValueError:
                continue
            gpus = tuple(sorted(set(r.gpu_indices)))
            if not gpus or gpus[0] < 0 or gpus[-1] >= node.gpu_count:
                continue
            out.append(WarmExecutor(node.id, node.gpu_type, r.key, gpus,
                                    tuple(sorted(set(r.placement_ids))), r.free_rows,
                                    r.total_rows, r.queued_jobs))
    return sorted(out, key=lambda e: (e.node_id, e.gpus, e.key))


@dataclass(frozen=True)
class LivePlacement:
    """A published|claimed|running placement, with its task's key, tenant and rows."""

    id: str
    task_id: str
    tenant: str
    key: str
    node_id: str
    gpus: tuple[int, ...]
    rows: int
    stopping: bool = False  # the service asked it to stop (pause, quota reclaim)


def usable_executors(executors: Sequence[WarmExecutor], live: Sequence[LivePlacement],
                     ends: Mapping[str, int]) -> list[WarmExecutor]:
    """Executors the database agrees with (module docstring). A busy executor's free rows lose
    the rows of live placements on it that its report does not list yet (published joins); its
    hold end is its hosted tasks' latest planned end (``ends``: task id -> seconds from now)."""
    out = []
    for ex in executors:
        on = [p for p in live if p.node_id == ex.node_id and set(p.gpus) & set(ex.gpus)]
        if not on:  # idle, or every task it reported has ended: they detach, it is warm
            out.append(replace(ex, placement_ids=(), hold_end_s=0,
                               free_rows=ex.free_rows if ex.idle else ex.total_rows))
            continue
        if any(p.gpus != ex.gpus or p.key != ex.key or p.stopping for p in on):
            continue  # its GPUs were given to something else since the report, or are reclaimed
        unreported = sum(p.rows for p in on if p.id not in ex.placement_ids)
        out.append(replace(ex, placement_ids=tuple(sorted(p.id for p in on)),
                           free_rows=max(0, ex.free_rows - unreported),
                           hold_end_s=max(ends.get(p.task_id, 0) for p in on)))
    return out


def task_shares(live: Sequence[LivePlacement]) -> dict[str, float]:
    """GPUs each live task uses: a placement alone on its GPUs counts them all; placements
    sharing GPUs (one shared executor) split them by rows (module docstring)."""
    shares: dict[str, float] = {}
    for group in shared_groups(live):
        total = sum(max(1, p.rows) for p in group)
        gpus = len({(p.node_id, g) for p in group for g in p.gpus})
        for p in group:
            shares[p.task_id] = shares.get(p.task_id, 0.0) + gpus * max(1, p.rows) / total
    return shares


def tenant_usage(live: Sequence[LivePlacement]) -> dict[str, float]:
    """GPUs each tenant uses: the sum of its live tasks' task_shares."""
    shares = task_shares(live)
    usage: dict[str, float] = {}
    for task_id, tenant in {p.task_id: p.tenant for p in live}.items():
        usage[tenant] = usage.get(tenant, 0.0) + shares[task_id]
    return usage


def shared_groups(live: Sequence[LivePlacement]) -> list[list[LivePlacement]]:
    """Live placements grouped by shared GPUs (same node, overlapping GPU sets), in a stable
    order (by node, lowest GPU, placement id)."""
    out = [sorted(g, key=lambda p: p.id) for g in by_shared_gpus(live, lambda p: (p.node_id,
                                                                                   p.gpus))]
    return sorted(out, key=lambda g: (g[0].node_id, min(x for p in g for x in p.gpus), g[0].id))


def by_shared_gpus(items: Sequence[T], spot: Callable[[T], tuple[str, Sequence[int]]]
                    ) -> list[list[T]]:
    """Items whose (node, GPUs) overlap, transitively, in one group (union-find)."""
    parent = list(range(len(items)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[tuple[str, int], int] = {}
    for i, item in enumerate(items):
        node, gpus = spot(item)
        for g in gpus:
            j = owner.setdefault((node, g), i)
            parent[find(i)] = find(j)
    groups: dict[int, list[T]] = {}
    for i, item in enumerate(items):
        groups.setdefault(find(i), []).append(item)
    return list(groups.values())
