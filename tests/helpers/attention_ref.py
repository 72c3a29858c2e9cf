"""A float64 reference of causal attention over sequences packed into one row: one [T, T] mask
(same sequence, causal, within the window) and explicit soft-capped scores, computed apart from
trainer.varlen's per-sequence loop and its flash path."""

from __future__ import annotations

import torch


def packed_attention_ref(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         bounds: list[int], scaling: float, window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> [1, T, H, D] in float64."""
    q, k, v = (t.double() for t in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    total = q.shape[2]
    seq = torch.empty(total, dtype=torch.long)
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        seq[a:b] = n
    pos = torch.arange(total)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    scores = q @ k.transpose(2, 3) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)
