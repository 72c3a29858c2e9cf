"""Held-out evaluation of the attached jobs: every job's numbers on the same examples in no-grad
forwards (jobs grouped so a forward holds at most a step's sequences), and how many backbone
forwards that takes (eval_forwards, eval_chunk: lockstep ranks plan and pad to the same count).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from trainer.data import Example
from trainer.jobs import JobRun


def eval_forwards(n_jobs: int, n_examples: int, batch_size: int, max_sequences: int | None) -> int:
    """Backbone forwards of `MultiLoraEngine.evaluate_metrics` for these sizes (in lockstep every
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


class EngineEvaluation:
    """MultiLoraEngine's evaluation (a part of the engine, not used alone: it runs the engine's
    `_forward_tokens`; the engine's objective, when it has one, computes `_eval_sums`)."""

    # evaluation's numbers: SFT adds the mean token accuracy (argmax == target over target tokens)
    TOKEN_METRICS = ("loss", "token_accuracy")

    @property
    def eval_metric_names(self) -> tuple[str, ...]:
        objective = getattr(self, "objective", None)
        return self.TOKEN_METRICS if objective is None else objective.eval_metric_names

    def _eval_sums(self, states: Sequence[JobRun], chunk: Sequence[Example]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """One no-grad forward of every job on the same chunk: per job the sums of the
        evaluation's numbers [N, len(eval_metric_names)] and what each is averaged over [N]
        (SFT: summed token losses and hits over target tokens; DPO: sums over pairs)."""
        objective = getattr(self, "objective", None)
        if objective is not None:
            return objective.eval_sums(self, states, chunk)
        return self.token_eval_sums(states, chunk)

    def token_eval_sums(self, states: Sequence[JobRun], chunk: Sequence[Example]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """_eval_sums of the token losses and hits (SFT's), from a replayed graph where one serves."""
        graphs = self.step_graphs
        if graphs is not None and graphs.serves(states):
            return graphs.eval_sums(states, chunk)  # the same sums from a replayed graph
        _, losses, hits, counts = self._forward_tokens(states, [chunk] * len(states), hits=True)
        sums = [torch.stack([loss.sum(), hit.sum()])
                for loss, hit in zip(losses.split(counts), hits.split(counts), strict=True)]
        return torch.stack(sums), torch.tensor(counts, dtype=torch.float64)

    @torch.no_grad()
    def evaluate_metrics(
        self, examples: Sequence[Example], batch_size: int = 8, job_ids: Sequence[str] | None = None,
        max_sequences: int | None = None, forwards: int | None = None,
    ) -> dict[str, dict[str, float]]:
        """Every number of the evaluation (`eval_metric_names`, the loss first) of each job on the same
        held-out examples. With max_sequences, jobs go in groups so one forward holds at most
        that many sequences (e.g. the training step's total batch, which admission sized to
        fit). With `forwards` (lockstep), idle forwards pad this rank's passes to that count."""
        states = [self.jobs[j] for j in (job_ids if job_ids is not None else list(self.jobs))]
        group = max(1, (max_sequences or 1 << 62) // batch_size)
        was_training = self.model.training
        self.model.eval()
        out: dict[str, dict[str, float]] = {}
        try:
            for g in range(0, len(states), group):
                members = states[g : g + group]
                totals = torch.zeros(len(members), len(self.eval_metric_names), dtype=torch.float64,
                                     device=self.device)
                denoms = torch.zeros(len(members), dtype=torch.float64)
                for lo in range(0, len(examples), batch_size):
                    sums, counts = self._eval_sums(members, list(examples[lo : lo + batch_size]))
                    totals += sums.double()  # summed on the device: one sync per group of jobs
                    denoms += counts
                means = (totals.cpu() / denoms.clamp(min=1).unsqueeze(1)).tolist()
                out.update({s.job_id: dict(zip(self.eval_metric_names, row, strict=True))
                            for s, row in zip(members, means, strict=True)})
        finally:
            self._clear_layout()
            self.model.train(was_training)
        own = eval_forwards(len(states), len(examples), batch_size, max_sequences)
        if forwards is not None:
            if own > forwards:
                raise RuntimeError(f"this rank needs {own} eval forwards, more than the planned {forwards}")
            for _ in range(forwards - own):
                self.idle_forward()
        return out

    def evaluate(
        self, examples: Sequence[Example], batch_size: int = 8, job_ids: Sequence[str] | None = None,
        max_sequences: int | None = None,
    ) -> dict[str, float]:
        """The mean loss of each job on the same held-out examples (SFT: token mean; DPO: the
        mean DPO loss over pairs), what early exit and the ranking use."""
        metrics = self.evaluate_metrics(examples, batch_size, job_ids, max_sequences)
        return {j: m["loss"] for j, m in metrics.items()}

    @torch.no_grad()
    def logits(self, job_id: str, input_ids: torch.Tensor) -> torch.Tensor:
        """Full logits of one job on plain (unpacked) rows [B, L] (for the export round trip)."""
        state = self.jobs[job_id]
        was_training = self.model.training
        self.model.eval()
        try:
            self._set_layout([state], [0, input_ids.numel()])
            return self.model(input_ids=input_ids.to(self.device), use_cache=False).logits
        finally:
            self._clear_layout()
            self.model.train(was_training)
