"""DPO on the multi-LoRA engine: per job a micro-batch of preference pairs, one forward + one
backward over all jobs' chosen and rejected sequences, and reference log-probs shared by all jobs.

Loss of a job (Rafailov et al. 2023, eq. 7), mean over its pairs:
    -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))
with pi / ref the summed log-probs of the response tokens under the job's adapter / the frozen
backbone (every adapter off). Rewards are beta * (pi - ref); reward accuracy is the share of pairs
whose chosen reward beats the rejected one, reward margin the mean difference of the two.

Reference log-probs are computed once per sample (not per job): before each forward, the pairs
not yet in `DpoEngine.reference` (keyed by PairExample.key, a content digest, so train and
validation share one cache) go through ONE no-grad backbone forward, packed together whatever job
they came from (no adapter runs, so mixing jobs in a row is harmless). The cache is small (two
floats per pair); the executor checkpoints it, so a resumed run uses the very same numbers.
Isolation is the SFT engine's: a job's log-probs come from its own rows only, a non-finite loss
stays out of the backward objective, a non-finite gradient norm skips only that job's update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from trainer.data import IGNORE, Example
from trainer.engine import MultiLoraEngine
from trainer.head import token_losses
from trainer.jobs import JobState
from trainer.packing import PackedBatch
from trainer.pairs import PairExample

METRICS = ("loss", "reward_accuracy", "reward_margin")


def dpo_loss(
    policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor, beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO loss and the chosen / rejected rewards, from summed response log-probs."""
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    loss = -nn.functional.logsigmoid(chosen_reward - rejected_reward)
    return loss, chosen_reward, rejected_reward


def pair_sequences(pairs: Sequence[PairExample]) -> list[Example]:
    """A job's sequences in a step: every chosen, then every rejected (pair order)."""
    return [p.chosen for p in pairs] + [p.rejected for p in pairs]


class DpoEngine(MultiLoraEngine):
    """The multi-LoRA engine with the DPO objective; train examples are PairExamples.

    `passes` counts backbone forwards ("reference": no-grad, adapters off; "policy": with the
    jobs' adapters, training and evaluation), `reference_sequences` the sequences whose
    reference log-prob was computed: each pair adds 2 exactly once per engine.
    """

    def __init__(self, model: nn.Module, train_pairs: Sequence[PairExample], pad_id: int,
                 *args: Any, **kwargs: Any) -> None:
        super().__init__(model, train_pairs, pad_id, *args, **kwargs)
        self.reference: dict[bytes, tuple[float, float]] = {}
        self.passes = {"reference": 0, "policy": 0}
        self.reference_sequences = 0

    # ----- log-probs -------------------------------------------------------------------
    def _sequence_logps(self, hidden: torch.Tensor, targets: torch.Tensor, seq_index: torch.Tensor,
                        first: int, count: int) -> torch.Tensor:
        """Summed log-probs [count] of sequences first..first+count-1 of these rows (the head and
        cross-entropy at least float32, in chunks: trainer.head)."""
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        sel = t != IGNORE
        h_sel, t_sel, s_sel = h[sel], t[sel], seq_index.reshape(-1)[sel] - first
        out = torch.zeros(count, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        tok = -token_losses(self.output_logits, h_sel, t_sel, self.head_chunk)
        return out.index_add(0, s_sel, tok)

    @torch.no_grad()
    def ensure_reference(self, pairs: Sequence[PairExample]) -> int:
        """Compute the reference log-probs of the pairs not cached yet, all in one backbone
        forward with every adapter off; returns how many pairs were computed."""
        missing: dict[bytes, PairExample] = {}
        for p in pairs:
            if p.key not in self.reference and p.key not in missing:
                missing[p.key] = p
        # in lockstep every rank makes this pass when any rank needs it (idle if it has none)
        needed = self.agree(int(bool(missing))) if self.agree is not None else int(bool(missing))
        if not missing:
            if needed:
                self.idle_forward()
            return 0
        todo = list(missing.values())
        seqs = pair_sequences(todo)
        batch, _ = self.batch_to_device(self.pack_batch([seqs]))
        self._clear_layout()  # adapters off: every MultiLoraLinear is its frozen base linear
        was_training = self.model.training
        self.model.eval()
        try:
            hidden = self._hidden(batch)
            logps = self._sequence_logps(hidden, batch.targets, batch.seq_index, 0, len(seqs)).tolist()
        finally:
            self.model.train(was_training)
        self.passes["reference"] += 1
        self.reference_sequences += len(seqs)
        n = len(todo)
        for i, p in enumerate(todo):
            self.reference[p.key] = (logps[i], logps[n + i])
        return n

    def forget_reference(self, pairs: Sequence[PairExample]) -> None:
        """Drop cached reference numbers (e.g. of the executor's throwaway memory-probe pairs)."""
        for p in pairs:
            self.reference.pop(p.key, None)

    def reference_state(self) -> dict[str, torch.Tensor]:
        """The cache as two tensors (keys [N, 16] uint8, values [N, 2] float64) for checkpoints."""
        keys = list(self.reference)
        return {"keys": torch.tensor([list(k) for k in keys], dtype=torch.uint8).reshape(-1, 16),
                "values": torch.tensor([self.reference[k] for k in keys], dtype=torch.float64).reshape(-1, 2)}

    def load_reference_state(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in zip(state["keys"].tolist(), state["values"].tolist(), strict=True):
            self.reference[bytes(k)] = (v[0], v[1])

    def _forward_logps(self, states: Sequence[JobState], per_job: Sequence[Sequence[PairExample]]
                       ) -> tuple[PackedBatch, list[torch.Tensor]]:
        """One forward of all jobs' chosen + rejected sequences with their adapters; per job the
        summed response log-probs [2 * pairs] (chosen first), from the job's own rows."""
        seqs = [pair_sequences(pairs) for pairs in per_job]
        batch, _ = self.batch_to_device(self.pack_batch(seqs))
        bounds = batch.job_tokens
        self._set_layout(states, bounds)
        hidden = self._hidden(batch)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        targets, seq_index = batch.targets.reshape(-1), batch.seq_index.reshape(-1)
        self.passes["policy"] += 1
        out, first = [], 0
        for i, job_seqs in enumerate(seqs):
            t0, t1 = bounds[i], bounds[i + 1]
            out.append(self._sequence_logps(hidden[t0:t1], targets[t0:t1], seq_index[t0:t1], first,
                                            len(job_seqs)))
            first += len(job_seqs)
        return batch, out

    def _objective(self, state: JobState, pairs: Sequence[PairExample], logps: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The job's mean DPO loss (differentiable) and [loss, accuracy, margin] sums over pairs."""
        n = len(pairs)
        ref = self._to_device(torch.tensor([self.reference[p.key] for p in pairs], dtype=logps.dtype))
        loss, rc, rr = dpo_loss(logps[:n], logps[n:], ref[:, 0], ref[:, 1], state.spec.beta)
        sums = torch.stack([loss.detach().sum(), (rc > rr).float().sum(), (rc - rr).detach().sum()])
        return loss.mean(), sums

    # ----- the objective's parts of the engine's step and evaluation -------------------------
    metric_names = METRICS
    eval_metric_names = METRICS  # reward accuracy, not token accuracy

    def _prepare(self, per_job: Sequence[Sequence[PairExample]]) -> None:  # type: ignore[override]
        self.ensure_reference([p for pairs in per_job for p in pairs])

    def _losses(self, states: Sequence[JobState], per_job: Sequence[Sequence[PairExample]]  # type: ignore[override]
                ) -> tuple[PackedBatch, list[torch.Tensor], list[torch.Tensor]]:
        batch, logps = self._forward_logps(states, per_job)
        losses, numbers = [], []
        for s, pairs, lp in zip(states, per_job, logps, strict=True):
            loss, stat = self._objective(s, pairs, lp)
            losses.append(loss)
            numbers.append(stat / len(pairs))
        return batch, losses, numbers

    def _eval_sums(self, states: Sequence[JobState], chunk: Sequence[PairExample]  # type: ignore[override]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        if any(p.key not in self.reference for p in chunk):
            self.ensure_reference(chunk)
        _, logps = self._forward_logps(states, [chunk] * len(states))
        sums = torch.stack([self._objective(s, chunk, lp)[1] for s, lp in zip(states, logps, strict=True)])
        return sums, torch.full((len(states),), float(len(chunk)), dtype=torch.float64)
