"""The next training step launched before this one's numbers are read (issue 40: the host's path between two
replayed steps left the device idle 4-6 ms a step; bench/results/session64_h200.md, section 5).

A replayed step ends in one device sync: the host reads every job's loss and gradient norm, then makes the step's
decisions (its report, early exit, divergence, evaluations) and packs, fills and launches the next step. Here,
once step N's forward and backward are queued and its updates are queued behind them (decided on the device:
trainer.step_update, the non-finite skip and the clip as `found_inf` and `grad_scale`), step N+1's graph is
filled and launched too, before the sync: its batch is each job's next one from a copy of its data stream (the
stream itself stays), its key one that a capture serves (its own or a cover, as the step itself would take).
The device then runs N's graph, N's updates and N+1's graph back to back while the host reads N's numbers and
decides.

The next `engine.step()` adopts the step launched ahead (`adopt`) where nothing it read has changed: the same
jobs (the same states, in the same slots of the same arenas, none stepped since), each job's data stream still
giving the launched batch. The streams then advance and the step's updates are queued after the sync of its
numbers, as a step's own are, so a job's updates, decisions and data order are the steps' without the pipeline.
Otherwise the step launched ahead is dropped (its gradients are never applied: the weights and moments stay as
step N left them) and the step runs as it would have. A job that stops at N thus costs one wasted pass; to make
that rare, a step is launched ahead only where the executor says the job set holds (`holds`: no job's last step,
warmup end or evaluation after this step, graph_parts.holds_next).

Device work stays in stream order: N+1's graph reads the weights after N's updates and writes its own buffers
after N's numbers were taken out of them; anything the host queues between the two steps (an evaluation, a park,
a checkpoint's copies) runs after N+1's graph and sees N's weights. A dropped step's graph and buffers are kept
until the device has run them.

Off unless LORAPLEX_STEP_AHEAD=1, and then only where the executor sets `holds`. Session 65 (bench/results/
session65_h200.md): in the 200-step task every step launched ahead was adopted (185 of 200, none dropped), its
numbers equal the task's without (tests), but the task was even: 12.64-12.69k tok/s on against 12.28-12.85k off
in three pairs, the replayed steps' walls within a millisecond. The device was not idle between replays for as
long as the host's path (bench/step_gap.py) suggested. Search (a) with it on has not run yet.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from trainer import graph_ahead, graph_parts, graph_thread
from trainer.data import sequence_tokens
from trainer.packing import pack_flat

ON = os.environ.get("LORAPLEX_STEP_AHEAD", "0") == "1"
log = logging.getLogger(__name__)


@dataclass
class Ahead:
    """A step launched before the step before it was read: what it ran, and what must still hold to adopt it."""

    states: list[Any]  # the jobs (JobRun), in slot order
    steps: list[int]  # each job's step count at launch
    indices: list[list[int]]  # each job's examples of the step
    regions: list[Any]  # each job's arena region at launch
    storage: tuple  # the arenas' storage at launch
    recompute: bool  # the key's recompute setting
    cpu: Any  # the host batch (PackedBatch)
    entry: Any  # the key's entry: its graph and buffers, kept (even if the graphs drop it) until the device ran them
    tokens: list[int]  # each job's sequence tokens
    done: torch.cuda.Event | None  # recorded after the graph (None off CUDA)


class StepPipeline:
    """The engine's steps launched ahead (see the module docstring)."""

    def __init__(self, engine: Any) -> None:  # noqa: ANN401 - a MultiLoraEngine
        self.engine = engine
        self.ahead: Ahead | None = None
        # -> whether the attached job set runs the step after this one unchanged (the executor's
        # graph_parts.holds_next); None: never launch ahead (the bare engine, its benches and tests)
        self.holds: Callable[[], bool] | None = None

    @property
    def counts(self) -> Any:  # noqa: ANN401 - the graphs' Counter (StepGraphs.stats: ahead_step_*)
        return self.engine.step_graphs.ahead

    def adopt(self, states: Sequence[Any]) -> tuple | None:  # noqa: ANN401
        """The step launched during the one before, where it is still this step: its host batch, each job's
        mean loss (device), each job's tokens, no passes, graphed. None: there is none, or it was dropped."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        eng = self.engine
        slots = eng.slots
        same = (len(states) == len(ahead.states) and all(a is b for a, b in zip(states, ahead.states, strict=True))
                and [s.step for s in states] == ahead.steps and slots.storage() == ahead.storage
                and [slots.regions.get(s.job_id) for s in states] == ahead.regions
                and all(graph_ahead._peek(s.stream).next_indices(s.spec.batch_size) == idx
                        for s, idx in zip(states, ahead.indices, strict=True)))
        if not same:
            self.counts["step_dropped"] += 1
            if ahead.done is not None:
                ahead.done.synchronize()  # its graph and buffers go once the device ran them
            return None
        for s in states:
            s.stream.next_indices(s.spec.batch_size)
        graphs = eng.step_graphs
        if eng.recompute_for is not None and eng.gradient_checkpointing != ahead.recompute:
            eng.set_recompute(ahead.recompute)  # as the step's own key would have set it
        graphs.last_replayed = True
        self.counts["step_adopted"] += 1
        if graph_ahead.NEXT:  # a capture of a coming key, while the device runs this step
            graph_ahead.capture_next(graphs, states)
        out = ahead.entry.static.out
        return ahead.cpu, [out[i, :1] for i in range(len(states))], ahead.tokens, None, True

    def launcher(self, states: Sequence[Any]) -> Callable[[], None] | None:  # noqa: ANN401
        """What launches the next step once this one's updates are queued (trainer.step_update), or None."""
        if not ON or self.holds is None:
            return None
        return lambda: self.launch(states)

    def launch(self, states: Sequence[Any]) -> bool:  # noqa: ANN401
        """Step N+1 of `states`, filled and replayed now (step N's updates queued), where the job set holds and a
        capture serves its key; True if launched. An error is logged, never raised: the next step runs as before."""
        try:
            return self._launch(list(states))
        except Exception as err:  # noqa: BLE001 - an optimisation: the next step runs as it would have
            self.ahead = None
            log.warning("the next step was not launched ahead: %s", str(err)[:200])
            return False

    def _launch(self, states: list[Any]) -> bool:  # noqa: ANN401
        eng = self.engine
        graphs = eng.step_graphs
        counts = self.counts
        if any(s.done for s in states) or not self.holds():  # type: ignore[misc]
            counts["step_held"] += 1
            return False
        indices = [graph_ahead._peek(s.stream).next_indices(s.spec.batch_size) for s in states]
        per_job = [[eng.train_examples[i] for i in idx] for idx in indices]
        cap = eng.cap_for(True)
        ints = eng.slots.layout_offsets(states)
        step = graph_ahead._step_key(graphs, states, ints, per_job, cap)  # its passes and recompute, as predicted
        if step is None:
            counts["step_passes"] += 1
            return False
        key, real, n_seqs = step
        entry = graphs.entries.get(key)
        target = key if entry is not None and entry.graph is not None else graphs._cover_for(key, real, n_seqs)
        if target is None:  # the step captures its key or runs eagerly: it runs in its own call
            counts["step_uncaptured"] += 1
            return False
        if target == key:
            packed, cpu, _ = graph_parts.step_key(eng, graphs.per_octave, states, per_job, True, cap)
            if replace(packed, recompute=key.recompute) != key:
                counts["step_unkeyed"] += 1
                return False
        else:
            cpu = pack_flat(per_job, eng.pad_id, length=target.tokens, max_len=cap)
            graphs.cover_uses[key] += 1
            graphs.covered += 1
        if graphs.flight is not None and graphs.flight.done.is_set():
            graph_thread.settle(graphs)  # the thread's capture is done: filed
            if graphs.entries.get(target) is None or graphs.entries[target].graph is None:
                return False
        entry = graphs._entry(target)
        entry.last = graphs.calls = graphs.calls + 1
        graphs._fill(entry.static, target, cpu, states, ints)
        eng.forward_shapes[(*cpu.input_ids.shape, True)] += 1
        entry.graph.replay()
        graphs.replays += 1
        done = None
        if eng.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(eng.device))
        tokens = [sum(sequence_tokens(e) for e in items) for items in per_job]
        self.ahead = Ahead(states, [s.step for s in states], indices, [eng.slots.regions.get(s.job_id) for s in states],
                           eng.slots.storage(), target.recompute, cpu, entry, tokens, done)
        counts["step_launched"] += 1
        return True
