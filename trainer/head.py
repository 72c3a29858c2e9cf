"""The output head and cross-entropy of every job of a step at once, in chunks of tokens.

`token_losses(logits_fn, h, targets, chunk)` is the per-token cross-entropy of the model's own
head (`logits_fn`: its LM head, logit scale and soft-cap, at least float32) over the selected
hidden states of all jobs together: one head matmul per chunk of `chunk` tokens instead of one
per job, and never more than a chunk of [tokens, vocab] float32 logits alive. With grad, each
chunk's gradient with respect to its hidden states is computed in the forward (the head's
backward for a unit weight per token, as Liger's fused linear cross-entropy does) and kept in the
hidden states' dtype; the backward only scales it by each token's incoming weight. So the logits
are neither kept nor recomputed: two head matmuls per token in all, where a checkpointed head
takes three. The frozen head gets no gradient.

`token_losses_and_hits` (no grad, for evaluation) also says per token whether the head's argmax is
the target, from the same chunk of logits (token accuracy at no second head matmul).

Isolation: a token's loss and gradient depend on its own hidden state alone (rows of a matmul),
so one job's non-finite values stay in that job's tokens; the caller sums tokens per job.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def default_chunk(vocab: int, budget_bytes: int = 1 << 30) -> int:
    """Tokens per chunk: about `budget_bytes` of float32 logits (2048 at a 128k vocabulary)."""
    return max(256, budget_bytes // (4 * max(1, vocab)))


def _chunk_losses(logits_fn: LogitsFn, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits_fn(h), t, reduction="none")


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, t: torch.Tensor, logits_fn: LogitsFn, chunk: int) -> torch.Tensor:  # noqa: ANN001, D102
        losses = torch.empty(h.shape[0], dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        grad = torch.empty_like(h)
        for lo in range(0, h.shape[0], chunk):
            with torch.enable_grad():
                hc = h[lo : lo + chunk].detach().requires_grad_(True)
                tok = _chunk_losses(logits_fn, hc, t[lo : lo + chunk])
                (g,) = torch.autograd.grad(tok.sum(), hc)
            losses[lo : lo + chunk] = tok.detach()
            grad[lo : lo + chunk] = g
        ctx.save_for_backward(grad)
        return losses

    @staticmethod
    def backward(ctx, d_losses: torch.Tensor):  # noqa: ANN001, ANN205, D102
        (grad,) = ctx.saved_tensors
        return grad * d_losses.unsqueeze(1).to(grad.dtype), None, None, None


def token_losses(logits_fn: LogitsFn, h: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-token cross-entropy [T] of hidden states h [T, d] against targets [T] (see the module
    docstring); differentiable with respect to h when grad is enabled."""
    if h.shape[0] == 0:
        return h.new_zeros(0, dtype=torch.promote_types(h.dtype, torch.float32))
    if torch.is_grad_enabled() and h.requires_grad:
        return _ChunkedHeadLoss.apply(h, targets, logits_fn, chunk)
    with torch.no_grad():
        return torch.cat([_chunk_losses(logits_fn, h[lo : lo + chunk], targets[lo : lo + chunk])
                          for lo in range(0, h.shape[0], chunk)])


@torch.no_grad()
def token_losses_and_hits(logits_fn: LogitsFn, h: torch.Tensor, targets: torch.Tensor, chunk: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy [T] and hits [T] (1.0 where the logits' argmax is the target, else
    0.0) of hidden states h [T, d], each chunk's logits made once and used for both."""
    dtype = torch.promote_types(h.dtype, torch.float32)
    losses, hits = [h.new_zeros(0, dtype=dtype)], [h.new_zeros(0, dtype=dtype)]
    for lo in range(0, h.shape[0], chunk):
        logits, t = logits_fn(h[lo : lo + chunk]), targets[lo : lo + chunk]
        losses.append(nn.functional.cross_entropy(logits, t, reduction="none").to(dtype))
        hits.append((logits.argmax(dim=-1) == t).to(dtype))
    return torch.cat(losses), torch.cat(hits)
