"""What may leave the device when a step or an evaluation needs its room (one GPU): the states
parked there while they wait for a warmup ranking (they go to pinned host memory), and the step
graphs' pool where it is mostly captures no step ran lately (the graphs are dropped; later steps
capture again). The executor wires these into the recompute policy (`RecomputePolicy.spare` and
`release`: a step that fits without recompute only once they leave has them leave first) and
calls `eval_short` before an evaluation."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from trainer.arena import state_bytes

# tokens an evaluation forward needs to keep an H100 busy (a 12-job evaluation of 64 samples is ~190k)
EVAL_WANT_TOKENS = 32768


def spare_bytes(engine: Any, tasks: Iterable[Any]) -> float:
    """Device bytes that may leave: the tasks' states parked on the device, and the graphs' pool
    where it is mostly stale (StepGraphs.stale_pool)."""
    parked = sum(state_bytes(t.parked[j]) for t in tasks for j in t.parked_on_device if j in t.parked)
    graphs = engine.step_graphs
    return float(parked) + (graphs.stale_pool() if graphs is not None else 0)


def release(engine: Any, spill: Callable[[], bool]) -> bool:
    """Send them off: a stale pool back with its captures, the parked states to the host (`spill`);
    whether anything left."""
    graphs = engine.step_graphs
    stale = graphs is not None and graphs.stale_pool() > 0
    if stale:
        graphs.reset()
        torch.cuda.empty_cache()
    return spill() or stale


def eval_short(room: int | None, tokens: int) -> bool:
    """Whether an evaluation whose forwards want `tokens` (up to EVAL_WANT_TOKENS) is short of the
    room one forward may hold (MemoryPlan.eval_tokens; None: not planned by tokens). Session 33's
    warmup evaluations ran 32-64 sequences a forward beside 10.6 GB of parked states: 0.49-0.64 s a
    job against 0.43 s."""
    return room is not None and room < min(tokens, EVAL_WANT_TOKENS)
