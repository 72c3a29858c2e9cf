"""Step graphs captured on a thread, up to LOOKAHEAD steps before the step that first runs them (issue 40;
on by default since session 60, off with LORAPLEX_CAPTURE_THREAD=0).

A capture's host pass (0.2-0.3 s at 32 layers of the 8B shape: the whole step's Python, every launch recorded)
leaves the device idle unless queued work covers it. `graph_ahead.capture_next` runs it during the one step
queued before the step that needs it, and a replay of 40-120 ms covers a third of it at most: search (a)'s
captures cost 0.25-0.4 s each over a replay, the 200-step task's ~1 s in all (bench/results/session57_h200.md).
Here, once a replayed step's work is queued, the main thread looks for the first of the set's next LOOKAHEAD
steps that would capture its key at its start (`upcoming`: each job's next batches from a copy of its data
stream, keyed as the step keys them, the covers the steps before it would take counted as taken), and a thread
captures that key (relaxed mode, on the capture stream, no device sync) while the main thread replays the
steps before it. The capture's Python runs while the main thread waits for those steps' numbers, a wait that
lets go of the GIL; Python's switch interval is SWITCH_S meanwhile, so the main thread gets the GIL back
within half a millisecond of wanting it (restored after).

One capture at a time, and nothing it reads changes until it ends. The main thread waits for it (`settle`)
before any step that is not a replay of another capture (StepGraphs._execute), any change of the arena's
layout, jobs or storage (`AdapterArena.settle`, through its guard), of the recompute setting (the engine),
of the modules' mode (an evaluation, the samples' decode), and before any forward of the backbone (a
forward pre-hook: the net under all of them), and before a device-wide sync or an emptying of the allocator's
cache (torch.cuda.synchronize and empty_cache wait first while a capture runs: a device sync meanwhile fails,
"operation not permitted when stream is capturing", as the 200-step bench's per-step sync did in session 59's
first call). Only the thread that began the capture waits: the capture's own calls (its layouts, its forward)
and autograd's threads pass; another thread must not sync the whole device while a capture runs (none of the
executor's does: they wait on their own events). The graphs' own state changes on the main
thread alone: the thread hands back its graph, and `settle` files it. A capture that fails or lacks room
leaves nothing behind: its key's own step captures it as before (counted as ahead["thread_unmade"]). The
capture's allocations are no step's peak: `settle` resets the device's peak after it, and a step begun while a
capture ran is not observed by the memory plan (`StepGraphs.last_replayed`: the resident bytes it read at its
start held the capture's tensors). A prediction releases nothing: the keys come from graph_ahead._step_key, under
which no recompute policy releases the parked states (trainer.admission.predicting).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from contract.background import BackgroundWorker
from trainer.graph_parts import GraphKey, has_room, unmade

ON = os.environ.get("LORAPLEX_CAPTURE_THREAD", "1") != "0"
LOOKAHEAD = 8  # the set's next steps whose keys are looked at
SWITCH_S = 0.0005  # Python's switch interval while a capture runs on the thread
log = logging.getLogger(__name__)


@dataclass
class Flight:
    """A capture under way on a thread: its key and entry, what `settle` puts back if it makes nothing."""

    key: GraphKey
    entry: Any  # graph_parts.Entry
    owner: threading.Thread  # the thread that began it: the only one that waits for it
    counts: tuple[int, int]  # the graphs' failures and deferrals before it
    new: bool  # its entry was made for it
    switch: float = 0.0  # Python's switch interval before it
    done: threading.Event = field(default_factory=threading.Event)
    graph: Any = None
    error: str | None = None
    hook: Any = None
    saved: tuple[Callable[..., Any], Callable[..., Any]] | None = None  # torch.cuda's synchronize and empty_cache
    wrappers: tuple[Callable[..., Any], Callable[..., Any]] | None = None  # what stands in for them meanwhile
    started: float = field(default_factory=time.perf_counter)


def upcoming(graphs: Any, states: Sequence[Any], peek: Callable[[Any], Any], step_key: Callable[..., Any],  # noqa: ANN401
             lookahead: int = LOOKAHEAD) -> tuple[GraphKey, int] | None:
    """The key of the first of this set's next `lookahead` steps (after the one queued now) that would capture
    it at its start, and how many steps on it comes; None if a step before it would run eagerly or in passes,
    or none does within the steps the set and its jobs run. The steps before it replay their own captures or
    covers: their covers are counted as taken (a key covered capture_after times is captured at its next
    step), then given back. `peek` and `step_key`: graph_ahead's copy of a stream and key of a coming step."""
    eng = graphs.engine
    lasts = graphs.set_lasts() if graphs.set_lasts is not None else None
    horizon = min(lookahead, min(s.total_steps - s.step for s in states) - 1)
    if lasts is not None:
        horizon = min(horizon, lasts - 1)
    peeks = [peek(s.stream) for s in states]
    ints, cap = eng.slots.layout_offsets(states), eng.cap_for(True)
    taken: Counter[GraphKey] = Counter()
    try:
        for on in range(1, horizon + 1):
            per_job = [[eng.train_examples[i] for i in p.next_indices(s.spec.batch_size)]
                       for p, s in zip(peeks, states, strict=True)]
            step = step_key(graphs, states, ints, per_job, cap)
            if step is None or step[0].recompute != eng.gradient_checkpointing:
                return None  # passes, or a recompute switch: the step settles first anyway
            key, real, n_seqs = step
            cap = key.max_len
            known = graphs.entries.get(key)
            if known is not None and known.graph is not None:
                continue
            if graphs._cover_for(key, real, n_seqs, ahead=on) is not None:
                graphs.cover_uses[key] += 1
                taken[key] += 1
                continue
            return (key, on) if graphs._captures(key, graphs.max_capture_tokens, ahead=on) else None
        return None
    finally:
        for key, n in taken.items():
            graphs.cover_uses[key] -= n
            if graphs.cover_uses[key] <= 0:
                del graphs.cover_uses[key]


def begin(graphs: Any, states: Sequence[Any], peek: Callable[[Any], Any], step_key: Callable[..., Any]) -> int:  # noqa: ANN401
    """`capture_next` with the thread on: file a finished capture; where none is under way, start
    the capture of the first coming key (`upcoming`) on a thread. Returns 1 if one started. Counted in
    `graphs.ahead` as thread_*."""
    flight = graphs.flight
    if flight is not None:
        if not flight.done.is_set():
            return 0
        settle(graphs)
    found = upcoming(graphs, states, peek, step_key)
    if found is None:
        return 0
    key, _ = found
    eng, why = graphs.engine, graphs.ahead
    why["thread_keys"] += 1
    if eng.device.type == "cuda":
        need = graphs.capture_need(key.tokens, key.recompute) if graphs.capture_need else None
        if need is None or not has_room(eng.device, need):
            why["thread_room"] += 1
            return 0
    graphs._check_storage()
    new = key not in graphs.entries
    entry = graphs._entry(key)
    entry.last = graphs.calls
    flight = Flight(key, entry, threading.current_thread(), (graphs.failures, graphs.deferrals), new)
    flight.switch = sys.getswitchinterval()
    graphs.flight = flight
    try:
        _fly(graphs, flight)
    except Exception as err:  # noqa: BLE001 - no thread to be had, or a hook refused: nothing captured, nothing waits
        flight.error = str(err)[:200]
        flight.done.set()
        settle(graphs)
        return 0
    why["thread_started"] += 1
    return 1


def _fly(graphs: Any, flight: Flight) -> None:  # noqa: ANN401
    """The guards up (the arena's, the backbone's forward pre-hook, torch.cuda's sync and empty_cache), then the
    thread that captures `flight.key` started."""
    eng, entry, key = graphs.engine, flight.entry, flight.key
    sys.setswitchinterval(min(flight.switch, SWITCH_S))
    eng.slots.guard = lambda: settle(graphs)
    flight.hook = eng.model.base_model.register_forward_pre_hook(lambda *_: settle(graphs))
    flight.saved = torch.cuda.synchronize, torch.cuda.empty_cache
    flight.wrappers = (_settled(graphs, flight.saved[0]), _settled(graphs, flight.saved[1]))
    torch.cuda.synchronize, torch.cuda.empty_cache = flight.wrappers
    worker: BackgroundWorker

    def run() -> None:
        try:
            if eng.device.type == "cuda":
                torch.cuda.set_device(eng.device)
            flight.graph = graphs._capture(entry, key, sync=False)
        except Exception as err:  # noqa: BLE001 - the key's own step captures it as before
            flight.error = str(err)[:200]
        finally:
            flight.done.set()
            worker.stop()  # one capture: from inside, this only asks the loop to end

    worker = BackgroundWorker("step-capture", run, logger=log)
    worker.start()


def _settled(graphs: Any, real: Callable[..., Any]) -> Callable[..., Any]:  # noqa: ANN401
    def call(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        settle(graphs)
        return real(*args, **kwargs)

    return call


def settle(graphs: Any) -> None:  # noqa: ANN401
    """Wait for the capture under way (from the thread that began it; any other thread passes), then file it:
    its graph into its entry and its class warm, or, where it made none, the entry and counters as they were."""
    flight = graphs.flight
    if flight is None or threading.current_thread() is not flight.owner:
        return
    t0 = time.perf_counter()
    flight.done.wait()
    waited = time.perf_counter() - t0
    graphs.flight = None
    eng, why, key, entry = graphs.engine, graphs.ahead, flight.key, flight.entry
    eng.slots.guard = None
    if flight.hook is not None:
        flight.hook.remove()
    if flight.saved is not None and torch.cuda.synchronize is flight.wrappers[0]:
        torch.cuda.synchronize = flight.saved[0]
    if flight.saved is not None and torch.cuda.empty_cache is flight.wrappers[1]:
        torch.cuda.empty_cache = flight.saved[1]
    sys.setswitchinterval(flight.switch)
    if eng.device.type == "cuda":  # the capture's allocations are no step's peak
        torch.cuda.reset_peak_memory_stats(eng.device)
    why["thread_wait_ms"] += round(1e3 * waited)
    why["thread_flight_ms"] += round(1e3 * (time.perf_counter() - flight.started))
    if flight.graph is not None:
        entry.graph = flight.graph
        graphs.warm.add(key.warm_class)
        why["thread_made"] += 1
        return
    why["thread_unmade"] += 1
    unmade(graphs, key, entry, flight.counts, flight.new)
    if flight.error is not None:
        log.warning("a step capture on a thread failed: %s", flight.error)
