"""DPO on the multi-LoRA engine, as a pair objective (trainer.pairs.PairObjective): per job a
micro-batch of preference pairs, one forward + one backward over all jobs' chosen and rejected
sequences, and reference log-probs shared by all jobs.

Loss of a job (Rafailov et al. 2023, eq. 7), mean over its pairs:
    -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))
with pi / ref the summed log-probs of the response tokens under the job's adapter / the frozen
backbone (every adapter off). Rewards are beta * (pi - ref); reward accuracy is the share of pairs
whose chosen reward beats the rejected one, reward margin the mean difference of the two.

Reference log-probs are computed once per sample (not per job): before each forward, the pairs
not yet in `Dpo.reference` (keyed by PairExample.key, a content digest, so train and validation
share one cache) go through ONE no-grad backbone forward, packed together whatever job they came
from (no adapter runs, so mixing jobs in a row is harmless). The cache is small (two floats per
pair); the executor checkpoints it, so a resumed run uses the very same numbers. Isolation is the
engine's: a job's log-probs come from its own rows only, a non-finite loss stays out of the
backward objective, a non-finite gradient norm skips only that job's update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from trainer.arena import host_to_device
from trainer.data import Example
from trainer.engine import MultiLoraEngine
from trainer.jobs import JobRun
from trainer.packing import PackedBatch
from trainer.pairs import PairExample, PairObjective, pair_sequences

__all__ = ["Dpo", "DpoEngine", "dpo_loss", "pair_sequences"]


def dpo_loss(
    policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor, beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO loss and the chosen / rejected rewards, from summed response log-probs."""
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    loss = -nn.functional.logsigmoid(chosen_reward - rejected_reward)
    return loss, chosen_reward, rejected_reward


class Dpo(PairObjective):
    """Direct preference optimisation: pairs scored against the frozen base model's log-probs,
    cached per pair (`reference`). One instance per engine (the cache is the engine's).

    `passes` counts backbone forwards ("reference": no-grad, adapters off; "policy": with the
    jobs' adapters, training and evaluation), `reference_sequences` the sequences whose
    reference log-prob was computed: each pair adds 2 exactly once per engine.
    """

    name = "dpo"

    def __init__(self) -> None:
        self.reference: dict[bytes, tuple[float, float]] = {}
        self.passes = {"reference": 0, "policy": 0}
        self.reference_sequences = 0

    def engine_class(self, *args: Any, **kwargs: Any) -> MultiLoraEngine:
        return DpoEngine(*args, objective=self, **kwargs)

    def sequence_logps(self, engine: MultiLoraEngine, states: Sequence[JobRun] | None,
                       seqs: Sequence[Sequence[Example]]
                       ) -> tuple[PackedBatch, torch.Tensor, torch.Tensor]:
        self.passes["reference" if states is None else "policy"] += 1
        return super().sequence_logps(engine, states, seqs)

    # ----- the reference log-probs ---------------------------------------------------------
    @torch.no_grad()
    def ensure_reference(self, engine: MultiLoraEngine, pairs: Sequence[PairExample]) -> int:
        """Compute the reference log-probs of the pairs not cached yet, all in one backbone
        forward with every adapter off; returns how many pairs were computed."""
        missing: dict[bytes, PairExample] = {}
        for p in pairs:
            if p.key not in self.reference and p.key not in missing:
                missing[p.key] = p
        # in lockstep every rank makes this pass when any rank needs it (idle if it has none)
        needed = engine.agree(int(bool(missing))) if engine.agree is not None else int(bool(missing))
        if not missing:
            if needed:
                engine.idle_forward()
            return 0
        todo = list(missing.values())
        was_training = engine.model.training
        engine.model.eval()
        try:  # adapters off: every MultiLoraLinear is its frozen base linear
            logps = self.sequence_logps(engine, None, [pair_sequences(todo)])[1].tolist()
        finally:
            engine.model.train(was_training)
        self.reference_sequences += 2 * len(todo)
        n = len(todo)
        for i, p in enumerate(todo):
            self.reference[p.key] = (logps[i], logps[n + i])
        return n

    def forget(self, engine: MultiLoraEngine, items: Sequence[PairExample]) -> None:
        """Drop cached reference numbers (e.g. of the executor's throwaway memory-probe pairs)."""
        for p in items:
            self.reference.pop(p.key, None)

    def reference_state(self) -> dict[str, torch.Tensor]:
        """The cache as two tensors (keys [N, 16] uint8, values [N, 2] float64) for checkpoints."""
        keys = list(self.reference)
        return {"keys": torch.tensor([list(k) for k in keys], dtype=torch.uint8).reshape(-1, 16),
                "values": torch.tensor([self.reference[k] for k in keys], dtype=torch.float64).reshape(-1, 2)}

    def load_reference_state(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in zip(state["keys"].tolist(), state["values"].tolist(), strict=True):
            self.reference[bytes(k)] = (v[0], v[1])

    # ----- the loss --------------------------------------------------------------------------
    def prepare(self, engine: MultiLoraEngine, per_job: Sequence[Sequence[PairExample]]) -> None:
        self.ensure_reference(engine, [p for pairs in per_job for p in pairs])

    def pair_numbers(self, engine: MultiLoraEngine, state: JobRun, pairs: Sequence[PairExample],
                     logps: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The job's mean DPO loss (differentiable) and [loss, accuracy, margin] sums over pairs."""
        n = len(pairs)
        ref = host_to_device(torch.tensor([self.reference[p.key] for p in pairs], dtype=logps.dtype), engine.device)
        loss, rc, rr = dpo_loss(logps[:n], logps[n:], ref[:, 0], ref[:, 1], state.spec.knob("beta"))
        sums = torch.stack([loss.detach().sum(), (rc > rr).float().sum(), (rc - rr).detach().sum()])
        return loss.mean(), sums

    def eval_sums(self, engine: MultiLoraEngine, states: Sequence[JobRun],
                  chunk: Sequence[PairExample]) -> tuple[torch.Tensor, torch.Tensor]:
        if any(p.key not in self.reference for p in chunk):
            self.ensure_reference(engine, chunk)
        return super().eval_sums(engine, states, chunk)

    # ----- per-task numbers: the reference cache, checkpointed -------------------------------
    def prepare_validation(self, engine: MultiLoraEngine, val: Sequence[PairExample], chunk: int) -> None:
        # the validation pairs' reference log-probs once, in the evaluation's chunks, so no
        # evaluation needs a pass the other ranks do not make
        for lo in range(0, len(val), chunk):
            self.ensure_reference(engine, val[lo : lo + chunk])

    def task_state(self, engine: MultiLoraEngine, own: Sequence[PairExample]) -> dict[str, torch.Tensor]:
        """The cached reference numbers of the task's own pairs only."""
        state = self.reference_state()
        keys = {p.key for p in own}
        keep = torch.tensor([bytes(k) in keys for k in state["keys"].tolist()], dtype=torch.bool)
        return {"keys": state["keys"][keep], "values": state["values"][keep]}

    def merge_task_states(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        # every rank's reference log-probs (2 floats per pair): a resume reuses them
        return {k: torch.cat([p[k] for p in parts]) for k in ("keys", "values")}

    def load_task_state(self, engine: MultiLoraEngine, state: dict[str, torch.Tensor] | None) -> None:
        if state is not None:
            self.load_reference_state(state)


class DpoEngine(MultiLoraEngine):
    """The multi-LoRA engine with a DPO objective plugged in (its loss is the objective's; this
    class overrides none of the step): what the tests and benchmarks that build a DPO engine by
    hand call, with the objective's reference cache and pass counts in view."""

    def __init__(self, model: nn.Module, train_pairs: Sequence[PairExample], pad_id: int,
                 *args: Any, objective: Dpo | None = None, **kwargs: Any) -> None:
        super().__init__(model, train_pairs, pad_id, *args, objective=objective or Dpo(), **kwargs)
        self.dpo: Dpo = self.objective  # type: ignore[assignment]

    @property
    def reference(self) -> dict[bytes, tuple[float, float]]:
        return self.dpo.reference

    @property
    def passes(self) -> dict[str, int]:
        return self.dpo.passes

    @property
    def reference_sequences(self) -> int:
        return self.dpo.reference_sequences

    def ensure_reference(self, pairs: Sequence[PairExample]) -> int:
        return self.dpo.ensure_reference(self, pairs)

    def forget_reference(self, pairs: Sequence[PairExample]) -> None:
        self.dpo.forget(self, pairs)

    def reference_state(self) -> dict[str, torch.Tensor]:
        return self.dpo.reference_state()

    def load_reference_state(self, state: dict[str, torch.Tensor]) -> None:
        self.dpo.load_reference_state(state)
