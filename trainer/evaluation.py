"""Held-out evaluation of the attached jobs (`Evaluation`, held as `engine.evaluation`): every
job's numbers on the same examples in no-grad forwards (jobs grouped so a forward holds at most a
step's sequences, or on one GPU a no-grad forward's room in tokens), and how many backbone forwards
that takes (eval_forwards, eval_chunk, eval_chunk_tokens: lockstep ranks plan and pad to the same
count). A whole class: it sees its engine through `Evaluated`
(its model, device, job slots, step graphs, forward and the objective's evaluation sums).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from trainer.arena import AdapterArena
from trainer.data import Example
from trainer.head import load_hits_kernel
from trainer.jobs import JobRun
from trainer.packing import PackedBatch
from trainer.step_graphs import StepGraphs

log = logging.getLogger(__name__)

# evaluation's numbers without an objective (SFT's): the mean token loss and the mean token
# accuracy (argmax == target over target tokens)
TOKEN_METRICS = ("loss", "token_accuracy")


def eval_forwards(n_jobs: int, n_examples: int, batch_size: int, max_sequences: int | None) -> int:
    """Backbone forwards of `Evaluation.metrics` for these sizes (in lockstep every
    rank computes it for every rank, to pad the ranks with fewer to the same count)."""
    if n_jobs == 0 or n_examples == 0:
        return 0
    group = max(1, (max_sequences or 1 << 62) // batch_size)
    return math.ceil(n_jobs / group) * math.ceil(n_examples / batch_size)


def eval_chunk(n_jobs: int, n_examples: int, max_sequences: int, min_chunk: int = 1) -> int:
    """Examples per evaluation forward that make the fewest backbone forwards when one forward
    holds at most `max_sequences` sequences (groups of max_sequences // chunk jobs share it);
    among equals the smallest chunk (the least memory). At least min(min_chunk, n_examples)."""
    if n_jobs <= 0 or n_examples <= 0:
        return max(1, min_chunk)
    floor = max(1, min(min_chunk, n_examples))
    cap = max(max_sequences, floor)
    best: tuple[int, int] | None = None
    for pieces in range(1, n_examples + 1):
        chunk = -(-n_examples // pieces)
        if chunk < floor:
            break
        if chunk > cap or (best is not None and chunk == best[1]):
            continue
        cost = eval_forwards(n_jobs, n_examples, chunk, cap)
        if best is None or cost <= best[0]:
            best = (cost, chunk)
    return best[1] if best is not None else floor


def eval_chunk_tokens(n_jobs: int, lengths: Sequence[int], max_tokens: int, min_chunk: int = 1,
                      job_tokens: int = 0) -> tuple[int, int]:
    """(examples per forward, sequences per forward) that make the fewest backbone forwards when
    one forward holds at most `max_tokens` tokens (a no-grad forward's room on one GPU, not a
    training step's batch), each job of it costing `job_tokens` more (its adapter's copy, in
    tokens' worth of memory). `lengths`: the examples' tokens, longest first as the evaluation
    runs them (its first chunk is its largest). Among equals the smallest chunk. At least
    min(min_chunk, n) examples of one job a forward, even over max_tokens."""
    n = len(lengths)
    floor = max(1, min(min_chunk, n))
    if n_jobs <= 0 or n == 0:
        return floor, floor
    prefix = list(itertools.accumulate(lengths))
    best: tuple[int, int, int] | None = None  # (forwards, chunk, jobs a forward)
    for pieces in range(1, n + 1):
        chunk = -(-n // pieces)
        if chunk < floor:
            break
        if best is not None and chunk == best[1]:
            continue
        group = min(n_jobs, max_tokens // max(1, prefix[chunk - 1] + job_tokens))
        if group < 1:
            continue
        cost = eval_forwards(n_jobs, n, chunk, group * chunk)
        if best is None or cost <= best[0]:
            best = (cost, chunk, group)
    if best is None:  # not even the floor's chunk of one job fits: it runs all the same
        return floor, floor
    return best[1], best[1] * best[2]


class Evaluated(Protocol):
    """What an evaluation uses of its engine (trainer.engine.MultiLoraEngine): the model and its
    device, the job slots (their jobs and layout), the step graphs, the forward of every job's
    target tokens, the idle forward (lockstep) and the objective's evaluation (`eval_sums`, which
    is `Evaluation.token_sums` without an objective)."""

    model: nn.Module
    device: torch.device
    compute_dtype: torch.dtype
    slots: AdapterArena
    step_graphs: StepGraphs | None

    @property
    def eval_metric_names(self) -> tuple[str, ...]: ...

    def eval_sums(self, states: Sequence[JobRun], chunk: Sequence[Example]
                  ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward_tokens(self, states: Sequence[JobRun], per_job: Sequence[Sequence[Example]], hits: bool = False
                       ) -> tuple[PackedBatch, torch.Tensor, torch.Tensor | None, list[int]]: ...

    def idle_forward(self) -> None: ...


class Evaluation:
    """An engine's held-out evaluation (see the module docstring)."""

    def __init__(self, engine: Evaluated) -> None:
        self.engine = engine
        # each job's denominator in the last `metrics` (the target tokens or pairs its means
        # average over): evaluations of disjoint subsets merge exactly (trainer.task_eval)
        self.last_weights: dict[str, float] = {}
        # called once, by the next `metrics` (`offer_ahead`), while the device runs its forwards, with
        # whether it still does (trainer.graph_ahead: step graphs captured meanwhile)
        self.ahead: Callable[[Callable[[], bool]], object] | None = None
        self._was_training = True  # the model's mode before the running `metrics`
        self._load_kernels()

    def token_sums(self, states: Sequence[JobRun], chunk: Sequence[Example]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's `eval_sums` of the token losses and hits (SFT's), from a replayed graph
        where one serves: one no-grad forward of every job on the same chunk, per job the sums
        [N, 2] and the target tokens they are averaged over [N]."""
        eng = self.engine
        graphs = eng.step_graphs
        # within an evaluation's arena copy (AdapterArena.compute_copy) the forwards run eagerly:
        # a capture would keep the copy's address past it
        if graphs is not None and graphs.serves(states) and not eng.slots.copied:
            sums = graphs.eval_sums(states, chunk)  # the same sums from a replayed graph
            self.offer_ahead()
            return sums
        _, losses, hits, counts = eng.forward_tokens(states, [chunk] * len(states), hits=True)
        assert hits is not None  # asked for
        sums = [torch.stack([loss.sum(), hit.sum()])
                for loss, hit in zip(losses.split(counts), hits.split(counts), strict=True)]
        return torch.stack(sums), torch.tensor(counts, dtype=torch.float64)

    @torch.no_grad()
    def metrics(
        self, examples: Sequence[Example], batch_size: int = 8, job_ids: Sequence[str] | None = None,
        max_sequences: int | None = None, forwards: int | None = None,
    ) -> dict[str, dict[str, float]]:
        """Every number of the evaluation (the engine's `eval_metric_names`, the loss first) of each
        job on the same held-out examples. With max_sequences, jobs go in groups so one forward
        holds at most that many sequences (e.g. the training step's total batch, which admission
        sized to fit). With `forwards` (lockstep), idle forwards pad this rank's passes to that count."""
        eng = self.engine
        jobs = eng.slots.jobs
        states = [jobs[j] for j in (job_ids if job_ids is not None else list(jobs))]
        group = max(1, (max_sequences or 1 << 62) // batch_size)
        eng.slots.settle()  # before the modules' mode changes (a step capture on a thread reads it)
        was_training = self._was_training = eng.model.training
        eng.model.eval()
        out: dict[str, dict[str, float]] = {}
        self.last_weights = {}
        try:
            for g in range(0, len(states), group):
                members = states[g : g + group]
                # the group's adapters copied once in the compute dtype (AdapterArena.compute_copy)
                with eng.slots.compute_copy(members):
                    totals, denoms = self._group_sums(members, examples, batch_size)
                self.offer_ahead()
                means = (totals.cpu() / denoms.clamp(min=1).unsqueeze(1)).tolist()
                self.last_weights.update({s.job_id: float(d) for s, d in zip(members, denoms.tolist(), strict=True)})
                out.update({s.job_id: dict(zip(eng.eval_metric_names, row, strict=True))
                            for s, row in zip(members, means, strict=True)})
        finally:
            eng.slots.clear_layout()
            eng.model.train(was_training)
        own = eval_forwards(len(states), len(examples), batch_size, max_sequences)
        if forwards is not None:
            if own > forwards:
                raise RuntimeError(f"this rank needs {own} eval forwards, more than the planned {forwards}")
            for _ in range(forwards - own):
                eng.idle_forward()
        return out

    def _load_kernels(self) -> None:
        """The evaluation's own kernels loaded while the device is idle (the engine's construction), not at
        the first evaluation, where a kernel's first load waits for the forwards queued before it: the
        head's hits variant of the cross-entropy (trainer.head.load_hits_kernel; 1.1 s in session 54's
        probe) and the float64 sums `_group_sums` keeps (a training step never runs them)."""
        eng = self.engine
        try:
            load_hits_kernel(eng.device, eng.compute_dtype)
            if eng.device.type == "cuda":
                totals = torch.zeros(1, 2, dtype=torch.float64, device=eng.device)
                totals += torch.ones(1, 2, device=eng.device).double()
        except Exception as err:  # noqa: BLE001 - a head the kernel cannot serve: the first evaluation loads its own
            log.warning("the evaluation's kernels were not loaded ahead: %s", str(err)[:200])

    def offer_ahead(self) -> None:
        """Run `ahead` here if the device still runs queued work (on the CPU: at once), else keep it for
        the next point: after each forward's backbone is queued (the engine's `forward_tokens`) and after
        each group's forwards. Session 54 offered it only after a group's forwards: at a task's first
        rankings the host had waited for them by then (1.3 and 0.7 s of host in the group's forwards at 32
        layers of the 8B shape, with no sync torch saw), and the captures found the device idle."""
        if self.ahead is None:
            return
        eng = self.engine
        queued = torch.cuda.Event() if eng.device.type == "cuda" else None
        if queued is not None:
            queued.record()
            if queued.query():
                return
        # the call, once: the model as it was before the evaluation (a capture records the training step)
        # and gradients on, while the queued work still runs
        ahead, self.ahead = self.ahead, None
        eng.model.train(self._was_training)
        try:
            with torch.enable_grad():
                ahead(lambda: queued is None or not queued.query())
        except Exception as err:  # noqa: BLE001 - an optimisation: the evaluation goes on without it
            log.warning("captures ahead of the next steps failed: %s", str(err)[:200])
        finally:
            eng.model.eval()

    def _group_sums(self, members: Sequence[JobRun], examples: Sequence[Example], batch_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One group's evaluation sums [jobs, numbers] (device, float64) and what each job's are
        averaged over (host), every chunk of `batch_size` examples one forward."""
        eng = self.engine
        totals = torch.zeros(len(members), len(eng.eval_metric_names), dtype=torch.float64, device=eng.device)
        denoms = torch.zeros(len(members), dtype=torch.float64)
        for lo in range(0, len(examples), batch_size):
            sums, counts = eng.eval_sums(members, list(examples[lo : lo + batch_size]))
            totals += sums.double()  # summed on the device: one sync per group of jobs
            denoms += counts
        return totals, denoms

    @torch.no_grad()
    def logits(self, job_id: str, input_ids: torch.Tensor) -> torch.Tensor:
        """Full logits of one job on plain (unpacked) rows [B, L] (for the export round trip)."""
        eng = self.engine
        state = eng.slots.jobs[job_id]
        eng.slots.settle()
        was_training = eng.model.training
        eng.model.eval()
        try:
            eng.slots.set_layout([state], [0, input_ids.numel()])
            return eng.model(input_ids=input_ids.to(eng.device), use_cache=False).logits
        finally:
            eng.slots.clear_layout()
            eng.model.train(was_training)
