"""ORPO on the multi-LoRA engine, as a pair objective (trainer.pairs.PairObjective): reference
free, on DPO's pairs, trained with every other job of the step in one forward and one backward.

Loss of a job (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference
Model", eq. 6-7), mean over its pairs:
    L = NLL(chosen) + lambda * -log sigmoid(log odds(chosen) - log odds(rejected))
with NLL(y) = -mean log p of y's response tokens, and log odds(y) = log p - log(1 - p) where
log p is that mean (length-normalised, as the paper). lambda is the job's `orpo_lambda`
(contract.methods). Reward accuracy is the share of pairs whose chosen log odds beat the
rejected one's, reward margin the mean log odds ratio. Device work only: no host sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from trainer.engine import MultiLoraEngine
from trainer.jobs import JobRun
from trainer.pairs import PairExample, PairObjective


def log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of p = exp(mean_logp), stable near p = 1 (mean_logp kept below 0, so a
    certain answer gives a large finite value, not inf)."""
    x = mean_logp.clamp(max=-torch.finfo(mean_logp.dtype).tiny)
    return x - torch.log(-torch.expm1(x))


def orpo_loss(chosen_logps: torch.Tensor, chosen_tokens: torch.Tensor, rejected_logps: torch.Tensor,
              rejected_tokens: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair ORPO loss and log odds ratio, from summed response log-probs and token counts."""
    chosen, rejected = chosen_logps / chosen_tokens.clamp(min=1), rejected_logps / rejected_tokens.clamp(min=1)
    ratio = log_odds(chosen) - log_odds(rejected)
    return -chosen - lam * nn.functional.logsigmoid(ratio), ratio


class Orpo(PairObjective):
    """Odds-ratio preference optimisation: the chosen answers' NLL plus lambda times the odds
    ratio term; no reference pass, nothing cached."""

    name = "orpo"

    def pair_numbers(self, engine: MultiLoraEngine, state: JobRun, pairs: Sequence[PairExample],
                     logps: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The job's mean ORPO loss (differentiable) and [loss, accuracy, margin] sums over pairs."""
        n = len(pairs)
        loss, ratio = orpo_loss(logps[:n], counts[:n], logps[n:], counts[n:], state.spec.knob("orpo_lambda"))
        ratio = ratio.detach()
        sums = torch.stack([loss.detach().sum(), (ratio > 0).to(loss.dtype).sum(), ratio.sum()])
        return loss.mean(), sums
