"""A training step run as several forward-backward passes over its jobs (`engine.split_for`,
chosen by trainer.admission.RecomputePolicy.passes): where one pass over every job's rows would need
activation recompute, passes that each fit without it. A job's loss and gradient depend on its own
rows and adapter only, so the passes give what one pass would; each keeps only its own activations.
The first pass zeroes the gradient arena, the later ones add their own jobs' regions to it
(`AdapterArena.pass_of`). Every pass launches the kernels with the whole step's jobs (those
of other passes hold no rows), so a pass compiles no kernel specialization the step would not."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer.arena import AdapterArena
from trainer.data import Example
from trainer.jobs import JobRun

# one eager forward and backward over some jobs: (its batch, each job's detached numbers)
ForwardBackward = Callable[[Sequence[JobRun], Sequence[Sequence[Example]]], tuple[Any, list[torch.Tensor]]]


@dataclass(frozen=True)
class StepTotals:
    """What a step's report reads of its batch where it ran as several passes."""

    real_tokens: int
    padded_fraction: float


def forward_backward_passes(slots: AdapterArena, forward_backward: ForwardBackward, states: Sequence[JobRun],
                            per_job: Sequence[Sequence[Example]], passes: list[list[int]]
                            ) -> tuple[StepTotals, list[torch.Tensor], list[int]]:
    """The step's passes (each a list of indices into states), one after another: each job's
    numbers in states' order, the step's token totals, and each pass's cells (rows x length)."""
    if sorted(i for members in passes for i in members) != list(range(len(states))):
        raise ValueError(f"the passes {passes} do not cover the step's {len(states)} jobs once each")
    numbers: list[torch.Tensor] = [torch.empty(0)] * len(states)
    real, cells = 0, []
    for k, members in enumerate(passes):
        with slots.pass_of(states, later=k > 0):
            batch, part = forward_backward([states[i] for i in members], [per_job[i] for i in members])
        for i, n in zip(members, part, strict=True):
            numbers[i] = n
        real += batch.real_tokens
        cells.append(batch.input_ids.numel())
    total = sum(cells)
    return StepTotals(real, 0.0 if total == 0 else 1.0 - real / total), numbers, cells
