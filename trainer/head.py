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

Where the logits are the head's weight product alone (`ModelHead.plain_weight`: no bias, scale or
cap; a GPU), each chunk's cross-entropy, argmax and gradient come from the bf16 logits in one kernel
(kernels.cross_entropy), never a float32 copy of them: the same values, float32 sums.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kernels.cross_entropy import DTYPES, cross_entropy_rows
from kernels.cross_entropy import available as fused_ce_available

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def default_chunk(vocab: int, budget_bytes: int = 1 << 30) -> int:
    """Tokens per chunk: about `budget_bytes` of float32 logits (2080 at a 128k vocabulary), a
    multiple of 16, so every chunk's targets start 16-byte aligned: the fused cross-entropy's
    kernel is then one compiled kernel whatever the vocabulary (Triton specialises a pointer on
    its alignment; Qwen2.5's 152,064 gave 1,765-token chunks, every other one unaligned)."""
    return max(256, budget_bytes // (4 * max(1, vocab))) // 16 * 16


def _chunk_losses(logits_fn: LogitsFn, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits_fn(h), t, reduction="none")


def _plain(logits_fn: LogitsFn, h: torch.Tensor) -> torch.Tensor | None:
    """The head's weight where the fused cross-entropy serves this call (`plain_weight`), else None."""
    plain = getattr(logits_fn, "plain_weight", None)
    return plain(h) if plain is not None else None


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, t: torch.Tensor, logits_fn: LogitsFn, chunk: int,  # noqa: ANN001, D102
                weight: torch.Tensor | None) -> torch.Tensor:
        losses = torch.empty(h.shape[0], dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        grad = torch.empty_like(h)
        for lo in range(0, h.shape[0], chunk):
            if weight is not None:  # the kernel leaves the logits' gradient in their place
                logits = nn.functional.linear(h[lo : lo + chunk], weight)
                losses[lo : lo + chunk] = cross_entropy_rows(logits, t[lo : lo + chunk], grad=True)[0]
                torch.matmul(logits, weight, out=grad[lo : lo + chunk])
                continue
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
        return grad * d_losses.unsqueeze(1).to(grad.dtype), None, None, None, None


def token_losses(logits_fn: LogitsFn, h: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-token cross-entropy [T] of hidden states h [T, d] against targets [T] (see the module
    docstring); differentiable with respect to h when grad is enabled."""
    if h.shape[0] == 0:
        return h.new_zeros(0, dtype=torch.promote_types(h.dtype, torch.float32))
    weight = _plain(logits_fn, h)
    if torch.is_grad_enabled() and h.requires_grad:
        return _ChunkedHeadLoss.apply(h, targets, logits_fn, chunk, weight)
    if weight is not None:  # the evaluation's kernel (hits unread): one compiled kernel fewer
        return token_losses_and_hits(logits_fn, h, targets, chunk)[0]
    with torch.no_grad():
        return torch.cat([_chunk_losses(logits_fn, h[lo : lo + chunk], targets[lo : lo + chunk])
                          for lo in range(0, h.shape[0], chunk)])


@torch.no_grad()
def load_hits_kernel(device: torch.device, dtype: torch.dtype) -> None:
    """The evaluation's cross-entropy kernel (with hits) loaded now, on a tiny row. A kernel module's first
    load waits for everything queued on the device: at a task's first evaluation that was its forwards
    (1.1 s at 32 layers of the 8B shape, session 54's probe), and a capture ahead (trainer.graph_ahead)
    then found the device idle. The engine calls this while the device is idle (its construction)."""
    if device.type == "cuda" and dtype in DTYPES and os.environ.get("LORAPLEX_FUSED_CE", "1") != "0" \
            and fused_ce_available(torch.empty(0, device=device)):
        cross_entropy_rows(torch.zeros(1, 16, dtype=dtype, device=device), torch.zeros(1, dtype=torch.long, device=device),
                           hits=True)


@torch.no_grad()
def token_losses_and_hits(logits_fn: LogitsFn, h: torch.Tensor, targets: torch.Tensor, chunk: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy [T] and hits [T] (1.0 where the logits' argmax is the target, else
    0.0) of hidden states h [T, d], each chunk's logits made once and used for both."""
    dtype = torch.promote_types(h.dtype, torch.float32)
    losses, hits = [h.new_zeros(0, dtype=dtype)], [h.new_zeros(0, dtype=dtype)]
    weight = _plain(logits_fn, h)
    for lo in range(0, h.shape[0], chunk):
        if weight is not None:
            loss, hit = cross_entropy_rows(nn.functional.linear(h[lo : lo + chunk], weight), targets[lo : lo + chunk],
                                           hits=True)
            losses.append(loss.to(dtype))
            hits.append(hit.to(dtype))
            continue
        logits, t = logits_fn(h[lo : lo + chunk]), targets[lo : lo + chunk]
        losses.append(nn.functional.cross_entropy(logits, t, reduction="none").to(dtype))
        hits.append((logits.argmax(dim=-1) == t).to(dtype))
    return torch.cat(losses), torch.cat(hits)


class ModelHead:
    """An engine's model's own logits of hidden states, at least float32 (`engine.output_logits`):
    its LM head, then its family's logit scaling (Cohere: x logit_scale; Granite: / logits_scaling)
    and final soft-cap (Gemma-2: cap * tanh(logits / cap)) as the model's forward does. Read from
    the engine at each call (its family and cap may change after it is built); held weakly.
    `force_fused`: the fused cross-entropy on the CPU too (tests, under TRITON_INTERPRET=1)."""

    def __init__(self, engine: Any) -> None:  # noqa: ANN401
        self._ref = weakref.ref(engine)
        self.force_fused = False

    def _engine(self) -> Any:  # noqa: ANN401
        eng = self._ref()
        if eng is None:
            raise RuntimeError("this head's engine is gone (a head serves the engine that built it)")
        return eng

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        eng = self._engine()
        logits = eng.model.get_output_embeddings()(h)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        scale, divisor = self._scaling(eng)
        if scale is not None:
            logits = logits * scale
        if divisor is not None:
            logits = logits / divisor
        if eng.logit_softcap:
            logits = torch.tanh(logits / eng.logit_softcap) * eng.logit_softcap
        return logits

    @staticmethod
    def _scaling(eng: Any) -> tuple[float | None, float | None]:  # noqa: ANN401
        config, family = eng.model.config, eng.family
        scale = getattr(config, family.logit_scale_attr, None) if family.logit_scale_attr else None
        divisor = getattr(config, family.logit_divisor_attr, None) if family.logit_divisor_attr else None
        return scale, divisor

    def plain_weight(self, h: torch.Tensor) -> torch.Tensor | None:
        """The LM head's weight where the logits of h are its product alone (no bias, scaling or cap;
        a local tensor, not a shard of adapter parallelism's) and the fused kernel runs on h's device
        (on the CPU only with `force_fused`), else None. LORAPLEX_FUSED_CE=0: always None."""
        if os.environ.get("LORAPLEX_FUSED_CE", "1") == "0":
            return None
        eng = self._engine()
        head = eng.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if (type(head) is not nn.Linear or head.bias is not None or weight is None or eng.logit_softcap
                or self._scaling(eng) != (None, None) or hasattr(weight, "device_mesh")):
            return None
        if h.dtype not in DTYPES or weight.dtype != h.dtype or weight.device != h.device:
            return None
        return weight if (h.is_cuda or self.force_fused) and fused_ce_available(h) else None
