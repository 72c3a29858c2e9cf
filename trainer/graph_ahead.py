"""Step graphs captured ahead of the steps that need them, while the device runs an evaluation's
forwards and the host would only wait for their numbers (issue 40; off unless LORAPLEX_CAPTURE_AHEAD=1).
Session 55 (bench/results/session55_h200.md): it captures, but no gain. Each ranking stage's first capture
loaded a LoRA kernel variant (the new set's rank tile or token bucket), and a module's first load waits for the
queued forwards (0.5-0.9 s). To gain, those variants must load while the device is idle, before the evaluation.

A capture costs its step ~0.3 s of host time over a replay at 32 layers of the 8B shape (the whole
step's Python, captured), and the device idles through it. The captures fall right after a ranking
evaluation changes the job set (bench/results/session53_h200.md: the 60-step task's 5 at steps 4-7,
after step 3's ranking; 3 of the 200-step task's 7 at steps 11-20; search (a)'s at steps 15-19 and
37-41), and during that evaluation's forwards the host sat idle for 1-4 s. The next set's keys need
no guess: each job's data order is a seeded permutation (trainer.data.JobDataStream), so copies of
the candidates' streams give the examples of their next steps, keyed as a step keys them
(graph_parts.lengths_key, step_key's key without the packing), for every set the ranking may keep
(`ranking_sets`).

- `coming_keys(graphs, sets)`: per set, the keys of its next STEPS steps that no capture serves yet
  (its own or a cover), counted over the sets.
- `capture_ahead(graphs, keys, busy)`: captures them, the most used first, while `busy()` says the
  device still has queued work: no device sync before a capture and no caches emptied, and only
  where the device has room for the pool's estimated need (graph_parts.has_room).
A key captured ahead and never run stays in the graphs' pool until a stale pool goes
(StepGraphs.stale_pool). An arena packed after the ranking drops every capture, these included.

`capture_next` (on unless LORAPLEX_CAPTURE_NEXT=0): a step's new key captured during the step before it, once
that step's work is queued. Session 56 (bench/results/session56_h200.md): the 200-step task's capture steps
0.36-0.74 s less in three calls. Unless LORAPLEX_CAPTURE_THREAD=0 it hands over to trainer.graph_thread (a key
of the next steps, captured on a thread while the steps before it replay).
"""
from __future__ import annotations

import copy
import itertools
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from trainer import graph_thread
from trainer.admission import predicting
from trainer.data import sequence_tokens
from trainer.early_exit import keep_count
from trainer.graph_parts import GraphKey, has_room, lengths_key, unmade

ON = os.environ.get("LORAPLEX_CAPTURE_AHEAD", "0") == "1"
log = logging.getLogger(__name__)
NEXT = os.environ.get("LORAPLEX_CAPTURE_NEXT", "1") == "1"  # capture_next (on: session 56 measured its gain)
STEPS = 24  # each set's next steps whose keys are counted
WIDEN = os.environ.get("LORAPLEX_WIDEN_START", "1") == "1"  # `widen` (session 68)
WIDEN_RATIO = 2.0  # `widen`: the next step's key at most this many times this one's tokens
MAX_SETS = 32  # the sets beyond this many are not listed (in the candidates' order)


def _peek(stream: Any) -> Any:  # noqa: ANN401 - a JobDataStream, or a co-located task's TaskStream around one
    """A copy of the stream at its position: its batches are the job's next ones, the job's stream stays. A
    shallow copy (each wrapped stream's too): `next_indices` replaces a stream's order list, never changes it,
    so the copy shares the job's. capture_next peeks every job at every replayed step; a deep copy of a
    100k-example order took ~21 ms."""
    peek = copy.copy(stream)
    if getattr(stream, "inner", None) is not None:
        peek.inner = _peek(stream.inner)
    return peek


def coming_keys(graphs: Any, sets: Iterable[Sequence[Any]], steps: int = STEPS,  # noqa: ANN401
                busy: Callable[[], bool] = lambda: True) -> Counter[GraphKey]:
    """The keys of each set's next `steps` steps (at most its jobs' steps left) that its graphed steps
    would capture: not a key captured already, nor one a capture covers; counted over the sets, while
    `busy()` (the device's forwards done, captures ahead are no longer free). Each job's next batches
    come from one copy of its stream; a step's key from its sequences' lengths (graph_parts.lengths_key)."""
    eng = graphs.engine
    counts: Counter[GraphKey] = Counter()
    coming: dict[str, list[list[Any]]] = {}  # job -> its next steps' examples

    def batches(s: Any) -> list[list[Any]]:  # noqa: ANN401
        if s.job_id not in coming:
            stream = _peek(s.stream)
            coming[s.job_id] = [[eng.train_examples[i] for i in stream.next_indices(s.spec.batch_size)]
                                for _ in range(min(steps, s.total_steps - s.step))]
        return coming[s.job_id]

    for n, states in enumerate(itertools.islice(sets, MAX_SETS)):
        if not busy():
            graphs.ahead["idle" if n == 0 else "sets_left"] += 1  # idle: the forwards were done at the hook
            break
        if not graphs.serves(states):
            continue
        per_set = [batches(s) for s in states]
        ints, cap = eng.slots.layout_offsets(states), eng.seq_cap
        for per_job in zip(*per_set, strict=False):  # the set's steps: as many as its shortest job has left
            step = _step_key(graphs, states, ints, per_job, cap)
            if step is None:  # passes run eagerly
                continue
            key, real, n_seqs = step
            cap = key.max_len  # grown as the engine's would be by this step
            known = graphs.entries.get(key)
            if (known is not None and known.graph is not None) or graphs._cover(key, real, n_seqs):
                continue
            counts[key] += 1
    return counts


def _step_key(graphs: Any, states: Sequence[Any], ints: Sequence[int], per_job: Sequence[Sequence[Any]],  # noqa: ANN401
              cap: int) -> tuple[GraphKey, int, int] | None:
    """The training key a step of `states` over `per_job` runs, with its recompute decision, its real tokens and
    sequences; None where the step runs in passes (eagerly). A prediction: the memory plan's hooks release no parked
    state meanwhile (trainer.admission.predicting)."""
    eng = graphs.engine
    tokens = [sum(sequence_tokens(e) for e in items) for items in per_job]
    with predicting():
        passes = eng.split_for(tokens) if eng.split_for is not None else None
        if passes is not None and len(passes) > 1:
            return None
        lengths = [len(e.input_ids) for items in per_job for e in items]
        key, real = lengths_key(eng, graphs.per_octave, states, ints, lengths, True, cap), sum(lengths)
        on = graphs.recompute_on(key, real, len(lengths)) if eng.recompute_for is not None else None
    return (key if on is None else replace(key, recompute=on)), real, len(lengths)


def _set_runs_on(graphs: Any, states: Sequence[Any]) -> bool:  # noqa: ANN401
    """Whether this job set runs the next step too (`set_lasts` and every job's steps left)."""
    lasts = graphs.set_lasts() if graphs.set_lasts is not None else None
    return (lasts is None or lasts >= 2) and all(s.total_steps - s.step >= 2 for s in states)


def _next_capture(graphs: Any, states: Sequence[Any]) -> tuple[GraphKey, int, int] | None:  # noqa: ANN401
    """The next step's key, real tokens and sequences (each job's next batch from a copy of its stream), where that
    step would capture its key at its start: its class warm, no capture or cover serving it (`StepGraphs._cover_for`,
    `_captures`, `_transient` and `_near_end` as the next step reads them); None otherwise (covered, near the end
    too, eager in a short-lived set, or in passes)."""
    eng = graphs.engine
    per_job = [[eng.train_examples[i] for i in _peek(s.stream).next_indices(s.spec.batch_size)] for s in states]
    step = _step_key(graphs, states, eng.slots.layout_offsets(states), per_job, eng.cap_for(True))
    if step is None or graphs._cover_for(*step, ahead=1) is not None \
            or not graphs._captures(step[0], graphs.max_capture_tokens, ahead=1):
        return None
    return step


def widen(graphs: Any, states: Sequence[Any], key: GraphKey, real: int, n_seqs: int, train: bool  # noqa: ANN401
          ) -> GraphKey | None:
    """The next step's key, for a training step that would capture its own `key` at its start (no capture under
    way on the thread, none or no cover serving it) where the next step would capture its own at its start too
    (`_next_capture`): this step then captures the next one's key and runs padded on it, and the next step replays
    it. A job set's first steps capture at their start with the device idle (no replayed step to hide a thread's
    capture behind): the 200-step task's first two 2-job steps, 823 and 1,704 tokens, captured 1,024 and 1,792 rows
    at 0.33-0.43 s each (bench/results/session68_h200.md). Only within WIDEN_RATIO of this key's tokens, in its
    class (slots, rank tile, longest sequence, alignment, recompute), with sequence slots for this step's padding;
    None otherwise (and with LORAPLEX_WIDEN_START=0). An error is logged, never raised: the step captures its own."""
    if not (WIDEN and train and NEXT and graph_thread.ON) or graphs.flight is not None \
            or not graphs._captures(key, graphs.max_capture_tokens) or not _set_runs_on(graphs, states):
        return None
    try:
        step = _next_capture(graphs, states)
    except Exception as err:  # noqa: BLE001 - an optimisation: the step captures its own key
        log.warning("the next step's key was not found: %s", str(err)[:200])
        return None
    if step is None:
        return None
    nxt = step[0]
    pieces = -(-(nxt.tokens - real) // key.max_len)  # this step's padding tail as sequences
    if replace(nxt, tokens=key.tokens, seq_slots=key.seq_slots) != key \
            or not key.tokens < nxt.tokens <= WIDEN_RATIO * key.tokens or nxt.seq_slots < n_seqs + pieces:
        return None
    graphs.ahead["widened"] += 1
    return nxt


def capture_next(graphs: Any, states: Sequence[Any]) -> int:  # noqa: ANN401
    """The next step's key captured during this step (unless LORAPLEX_CAPTURE_NEXT=0; the engine calls it once the
    step's forward and backward are queued, before its sync), where that step would capture it at its start:
    the same job set next (`_set_runs_on`) and `_next_capture`. A
    capture's host pass (~0.25 s at 32 layers of the 8B shape) then runs while the device runs this step, not
    after it with the device idle; its kernels' first module loads wait for this step's queued work at most.
    Only after a replayed step (`last_replayed`): its memory is not observed (memory_plan.step_end), so the
    capture's allocations reach no step's peak. A key of unknown need (recompute on, on CUDA) is left to its
    step. Counted in `graphs.ahead` as next_*; returns 0 or 1; an error is logged, never raised."""
    if not graphs.last_replayed or not _set_runs_on(graphs, states) or not graphs.serves(states):
        return 0
    if graph_thread.ON:  # a key of the next steps (not only the next one's) captured on a thread
        try:
            return graph_thread.begin(graphs, states, _peek, _step_key)
        except Exception as err:  # noqa: BLE001 - an optimisation: the steps go on, each capturing its own key
            log.warning("a capture on a thread was not begun: %s", str(err)[:200])
            return 0
    try:
        step = _next_capture(graphs, states)
        return 0 if step is None else capture_ahead(graphs, Counter({step[0]: 1}), busy=lambda: True, prefix="next_")
    except Exception as err:  # noqa: BLE001 - an optimisation: the step goes on, and its next captures as before
        log.warning("the next step's capture failed: %s", str(err)[:200])
        return 0


def capture_ahead(graphs: Any, keys: Counter[GraphKey], busy: Callable[[], bool], prefix: str = "") -> int:  # noqa: ANN401
    """Capture `keys`, the most used first, while `busy()`; returns how many were captured. Keys captured or
    failed before, over the capture limit, without room (or of an unknown need, on a device), or of a class
    `near_warm` does not admit are left; so is the rest of a class not warm once one of its keys failed (a
    LoRA form that tunes at a new rank tile syncs inside the capture). `graphs.ahead` counts the calls, the
    keys, the captures ("made") and each reason a key was left, each name after `prefix`."""
    eng, why, p = graphs.engine, graphs.ahead, prefix
    graphs._check_storage()
    was = eng.gradient_checkpointing
    made, cold_failed = 0, set()
    why[p + "calls"] += 1
    why[p + "keys"] += len(keys)
    try:
        for key, _ in keys.most_common():
            if not busy():
                why[p + "late"] += 1  # the evaluation's forwards were done: the keys left go to their steps
                break
            entry = graphs.entries.get(key)
            warm = key.warm_class in graphs.warm
            left = "captured" if entry is not None and entry.graph is not None else \
                "failed" if entry is not None and entry.failed else \
                "cold" if key.warm_class in cold_failed or not (warm or near_warm(graphs.warm, key)) else \
                "large" if key.tokens > graphs.max_capture_tokens else None
            if left is None and eng.device.type == "cuda":
                need = graphs.capture_need(key.tokens, key.recompute) if graphs.capture_need else None
                left = "room" if need is None or not has_room(eng.device, need) else None
            if left is not None:
                why[p + left] += 1
                continue
            eng.set_recompute(key.recompute)
            new = entry is None
            entry = graphs._entry(key)
            entry.last = graphs.calls
            counts = graphs.failures, graphs.deferrals
            entry.graph = graphs._capture(entry, key, sync=False)
            made += entry.graph is not None
            if entry.graph is not None:  # its kernels are loaded now: the class's other keys capture at their first steps
                graphs.warm.add(key.warm_class)
                continue
            why[p + "unmade"] += 1
            unmade(graphs, key, entry, counts, new)
            if not warm:
                cold_failed.add(key.warm_class)
    finally:
        eng.set_recompute(was)
    why[p + "made"] += made
    return made


def near_warm(warm: set[tuple], key: GraphKey) -> bool:
    """Whether a capture ahead may try `key`: its class ran eagerly, or one that differs from it only in
    the rank tile and the arena's alignment (the LoRA kernels' constants: a relaxed capture loads their
    modules from the Triton cache). A ranking that keeps only jobs of lower ranks than the warmup's
    largest one (the 200-step task of session 54) moves its steps to such a class; its first step would
    otherwise run eagerly and its keys would wait for it."""
    same = (key.job_slots, key.max_len, key.recompute, key.train)
    return key.warm_class in warm or any((w[0], w[2], w[4], w[5]) == same for w in warm)


def ranking_sets(engine: Any, ranked: Sequence[str], reported: Sequence[str], n_ranked: int,  # noqa: ANN401
                 keep_fraction: float, out: Sequence[str] = ()) -> list[list[Any]]:
    """The job sets that may train after a warmup ranking decides (its last evaluation running now):
    the engine's other attached jobs (a co-located task's too: a step runs them all) with every choice of
    the kept among `ranked` (this stage's jobs) and `reported` (those that reported before), as many as the
    ranking keeps of its `n_ranked` jobs (the ones its staging evicted on their lead count too). List the
    likely kept first: sort `ranked` by their lead loss. `out`: jobs the staging evicts (in none)."""
    ranked_set = set(ranked) | set(reported) | set(out)
    others = [j for j, s in engine.jobs.items() if j not in ranked_set and not s.done]
    pool = [j for j in [*ranked, *reported] if j in engine.jobs and not engine.jobs[j].done]
    n_keep = min(keep_count(n_ranked, keep_fraction), len(pool))
    choices = itertools.islice(itertools.combinations(pool, n_keep), MAX_SETS)  # C(48, 12) is never listed
    return [[engine.jobs[j] for j in others + list(kept)] for kept in choices]
