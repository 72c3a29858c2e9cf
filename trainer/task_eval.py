"""A task's evaluations at their points (`evaluate_due`, for trainer.colocate.TaskRun): each job on
the leading subset of the task's validation set its training earned (`TaskRun.eval_size`), the
jobs due together sharing forwards, in lockstep as many forwards on every rank.

The warmup ranking's evaluation is staged (docs/architecture.md, "Loss-aware early exit"). A job
ending its warmup is evaluated first on the lead quarter of the ranking's subset (`lead_size`).
One that at least as many jobs as the ranking can keep beat there by LEAD_MARGIN
(`WarmupRanking.clearly_out`: the same samples for all) cannot be kept whatever the rest would
say: it is evicted now, on its lead loss (event `evicted_on_lead`: the numbers, on how many
samples). The others are evaluated on the rest of the subset, and the two parts merge exactly
(each mean weighted by what it averages over, `Evaluation.last_weights`): the number one pass over
the whole subset gives.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from contract.states import ExitReason
from trainer import graph_ahead
from trainer.config import Callbacks
from trainer.data import Example
from trainer.early_exit import LEAD_MARGIN, ExitDecision, WarmupRanking
from trainer.evaluation import eval_forwards
from trainer.pairs import PairExample
from trainer.task_parts import JobSlot, TaskExecutor

LEAD_DIVISOR = 4  # the lead part: a quarter of the ranking's subset
LEAD_MIN_SUBSET = 32  # a smaller ranking subset is evaluated in one stage
_WEIGHT = "_weight"  # a job's denominator, beside its numbers until the parts merge

Part = tuple[int, int]  # [lo, hi) of the task's validation order


class EvaluatedTask(Protocol):
    """What the evaluations use of a task (trainer.colocate.TaskRun)."""

    executor: TaskExecutor
    cb: Callbacks
    ranking: WarmupRanking | None
    placed: dict[str, JobSlot]
    queue: Any  # configurations waiting for a slot (they join as the ranking's evicted leave)
    last_eval: dict[str, int]
    val: list[Example | PairExample]

    def warmup_len(self, s: JobSlot) -> int: ...
    def in_warmup(self, job_id: str) -> bool: ...
    def cadence_due(self, s: JobSlot) -> bool: ...
    def eval_size(self, job_id: str, s: JobSlot) -> int: ...
    def eval_shape(self, n_jobs: int, n_examples: int | None = None,
                   lengths: Sequence[int] | None = None) -> tuple[int, int]: ...
    def observe_eval(self, job_id: str, m: dict[str, float]) -> None: ...
    def exit(self, job_id: str, decision: ExitDecision) -> None: ...


def lead_size(n: int) -> int:
    """Samples of the lead part of a ranking's subset of `n` (0: not staged)."""
    return n // LEAD_DIVISOR if n >= LEAD_MIN_SUBSET else 0


def eval_subset_size(earned: float, minimum: int, full: int) -> int:
    """An evaluation's validation samples: `earned` rounded up to `minimum` times a power of two
    (few distinct sizes, so jobs due together share forwards), within [minimum, full]."""
    if full <= minimum:
        return full
    n = max(1, minimum)
    while n < earned and n < full:
        n *= 2
    return min(n, full)


def evaluate_due(task: EvaluatedTask) -> None:
    """Evaluate the task's jobs at their evaluation points (see the module docstring)."""
    due: dict[str, int] = {}
    staged: dict[str, int] = {}  # the warmup ranking's evaluations: their lead part's samples
    for job_id, s in task.placed.items():
        warm_end = task.warmup_len(s) if task.in_warmup(job_id) else -1
        if task.cadence_due(s) or s.done or s.step == warm_end:
            if task.last_eval.get(job_id) != s.step:
                due[job_id] = task.eval_size(job_id, s)
                if s.step == warm_end and (lead := lead_size(due[job_id])):
                    staged[job_id] = lead
    if not due:
        return
    ranking = task.ranking
    first: dict[Part, list[str]] = {}
    for job_id, n in due.items():
        first.setdefault((0, staged.get(job_id, n)), []).append(job_id)
    ahead(task, list(staged))
    numbers = _parts(task, first)
    early: dict[str, dict[str, Any]] = {}
    if staged:
        for job_id in staged:
            ranking.lead(job_id, numbers[job_id]["loss"])
        rest: dict[Part, list[str]] = {}
        for job_id, lead in staged.items():
            why = ranking.clearly_out(job_id, LEAD_MARGIN)
            if why is None:
                rest.setdefault((lead, due[job_id]), []).append(job_id)
            else:
                early[job_id] = {**why, "samples": lead, "of_samples": due[job_id]}
        ahead(task, [j for ids in rest.values() for j in ids], out=list(early))
        more = _parts(task, rest) if rest else {}
        for job_id, m in more.items():
            numbers[job_id] = merged(numbers[job_id], m)
    for job_id in due:
        numbers[job_id].pop(_WEIGHT, None)
        task.observe_eval(job_id, numbers[job_id])
    for job_id, why in early.items():  # unless a detector ended it already
        if task.in_warmup(job_id) and job_id in task.placed:
            ranking.report(job_id, numbers[job_id]["loss"], early=True)
            task.cb.on_event(job_id, "evicted_on_lead", {"step": task.placed[job_id].step, **why})
            task.exit(job_id, ExitDecision(ExitReason.UNDERPERFORMING, {"early": True, **why}))


def ahead(task: EvaluatedTask, ranked: list[str], out: Sequence[str] = ()) -> None:
    """Under LORAPLEX_CAPTURE_AHEAD=1, where this evaluation decides the warmup ranking (every job it waits
    for is among `ranked`, this stage's, or `out`, evicted on its lead count after it) and no configuration
    is queued to join after it: the next evaluation forwards' device time captures the step graphs of the
    sets the ranking may keep (trainer.graph_ahead). The hook goes with the evaluation, used or not (`_parts`)."""
    eng, ranking = task.executor.engine, task.ranking
    graphs = getattr(eng, "step_graphs", None)
    if not graph_ahead.ON or graphs is None or ranking is None or task.queue or not ranked \
            or getattr(task.executor, "world", 1) > 1 or not set(ranking.waiting) <= {*ranked, *out}:
        return
    reported = [j for j in task.placed if ranking.awaits(j) and j not in ranked]
    order = sorted(ranked, key=ranking.lead_loss)  # stage 2: the lowest lead losses first
    sets = graph_ahead.ranking_sets(eng, order, reported, ranking.ranked_count, ranking.keep_fraction, out)
    memory = getattr(task.executor, "memory", None)

    def run(busy: Callable[[], bool]) -> int:
        cuda = eng.device.type == "cuda"
        peak = torch.cuda.max_memory_allocated(eng.device) if cuda else 0
        try:
            t0 = time.perf_counter()
            keys = graph_ahead.coming_keys(graphs, sets, busy=busy)
            graphs.ahead["keys_ms"] += round(1e3 * (time.perf_counter() - t0))
            return graph_ahead.capture_ahead(graphs, keys, busy)
        finally:  # the evaluation's own peak, for the memory plan (MemoryPlan.evaluation): not the captures'
            if cuda:
                torch.cuda.reset_peak_memory_stats(eng.device)
                if memory is not None:
                    memory.peak_floor = max(getattr(memory, "peak_floor", 0), peak)

    eng.evaluation.ahead = run


def _parts(task: EvaluatedTask, parts: dict[Part, list[str]]) -> dict[str, dict[str, float]]:
    """evaluate_parts, then no `ahead` left behind for another evaluation (a co-located task's)."""
    try:
        return evaluate_parts(task, parts)
    finally:
        evaluation = getattr(task.executor.engine, "evaluation", None)
        if evaluation is not None:
            evaluation.ahead = None


def merged(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Two parts' numbers of one job as one evaluation over both (each weighted by its denominator)."""
    wa, wb = a.pop(_WEIGHT), b.pop(_WEIGHT)
    total = wa + wb
    if total <= 0:
        return b
    return {k: (a[k] * wa + b[k] * wb) / total for k in b}


def evaluate_parts(task: EvaluatedTask, parts: dict[Part, list[str]]) -> dict[str, dict[str, float]]:
    """Each part's jobs on that part of the task's validation order (sorted longest first: a
    forward packs sequences of like length), every rank's numbers gathered, with each job's
    denominator under _WEIGHT. In lockstep every rank makes as many forwards as the rank that
    needs the most."""
    executor = task.executor
    subsets = {p: sorted(task.val[p[0] : p[1]], key=_length, reverse=True) for p in parts}
    lengths = {p: [_length(e) for e in subset] for p, subset in subsets.items()}
    executor.eval_room(sum(len(ids) * sum(lengths[p]) for p, ids in parts.items()))  # before any plan

    def plan(ids: list[str], p: Part, r: int) -> tuple[list[str], int, int]:
        mine = [j for j in ids if task.placed[j].owner == r]
        return (mine, *task.eval_shape(len(mine), len(subsets[p]), lengths[p]))

    def run(ids: list[str], p: Part) -> tuple[tuple[dict, int], int]:
        mine, bs, cap = plan(ids, p, executor.rank)  # planned now: the room as it is
        largest = min(len(mine), max(1, cap // bs)) * sum(lengths[p][:bs])
        metrics = executor.engine.evaluate_metrics(subsets[p], bs, mine, cap)
        weights = executor.engine.evaluation.last_weights
        for job_id, m in metrics.items():
            m[_WEIGHT] = weights[job_id]
        return (metrics, eval_forwards(len(mine), len(subsets[p]), bs, cap)), largest

    forwards = max(sum(eval_forwards(len(m), len(subsets[p]), bs, cap) for p, ids in parts.items()
                       for m, bs, cap in [plan(ids, p, r)]) for r in range(executor.world))
    local: dict[str, dict[str, float]] = {}
    own = 0
    for p, ids in sorted(parts.items()):
        metrics, made = executor.evaluation(lambda ids=ids, p=p: run(ids, p))
        local.update(metrics)
        own += made
    for _ in range(forwards - own):
        executor.engine.idle_forward()
    return {j: v for part in executor.strategy.gather(local) for j, v in part.items()}


def _length(example: Example | PairExample) -> int:
    if isinstance(example, PairExample):
        return len(example.chosen.input_ids) + len(example.rejected.input_ids)
    return len(example.input_ids)
