"""The decode's attention: transformers' SDPA attention, except that a token step (one query per
row) reads the cache's key/value heads as they are, in its own dtype.

transformers' SDPA function (5.17, the GPU image's) repeats every key/value head for each of its
query heads (`repeat_kv`) whenever there is a mask, and a decode of left-padded prompts always has
one: in each token step, each layer copies its whole cache 4x (Llama-3.1-8B: 32 query heads over 8
key/value heads) before the attention reads it, and the math backend (the one whose decode repeats,
trainer.sampling.repeatable) reads the copy again. At 32 layers of the 8B shape and 32 rows that
copy is the largest part of a token step's memory traffic. Here a token step's query [B, H, 1, D]
is viewed as [B, Hkv, H/Hkv, D] (each key/value head's queries as its rows) and attends to the
cache [B, Hkv, L, D] directly, with the mask broadcast over the heads: the same products and sums
per query head, no copy (what newer transformers releases do themselves). Every other call (the
prefill, scores with a bias or a soft-cap, dropout) is transformers' own.

A token step's attention is two batched GEMMs (`token_attention`): the scores of each key/value
head's queries against the cache in float32 from the cache's own bfloat16 (cuBLAS's float32 output
of 16-bit inputs), the masked float32 softmax, and its weights in the cache's dtype times the
values, accumulated in float32 (as flash attention keeps them). SDPA's math backend, the one whose
decode repeats (trainer.sampling.repeatable), first copies the whole cache to float32 in every
layer: at 32 layers of the 8B shape and 32 rows, ~14 GB a token step against ~1.4 GB read here.
cuBLAS's GEMMs repeat from run to run with its workspaces fixed, as the decode's other GEMMs do.

Registered under its own name with SDPA's mask function, so the masks are built exactly as for
"sdpa"; trainer.sampling switches a model whose attention is "sdpa" to it for a decode and back.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "loraplex_decode_sdpa"


def decode_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, T, D], key/value [B, Hkv, L, D]
    -> ([B, T, H, D], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    special = any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux", "sinks"))
    mask_ok = attention_mask is None or attention_mask.dtype == torch.bool or attention_mask.is_floating_point()
    if (query.shape[2] != 1 or query.shape[1] != key.shape[1] * groups or query.shape[0] != key.shape[0]
            or not mask_ok or dropout or special or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    b, h, _, d = query.shape
    q = query.reshape(b, h // groups, groups, d)
    mask = attention_mask
    if mask is not None and mask.shape[1] != 1:  # a mask per query head: the same regrouping
        mask = mask.reshape(mask.shape[0], h // groups, groups, mask.shape[-1])
    out = token_attention(q, key, value, mask, d ** -0.5 if scaling is None else scaling)
    return out.reshape(b, h, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def token_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                    scaling: float) -> torch.Tensor:
    """q [B, Hkv, G, D] (each key/value head's G queries), key/value [B, Hkv, L, D], mask (bool:
    True attends; floating: added to the scores) broadcast to [B, Hkv, G, L] -> [B, Hkv, G, Dv] in
    q's dtype: softmax(q k^T * scaling) v with float32 (or wider) scores, softmax and sums. Every
    query attends at least one position (a decode's new token attends itself): a row the mask
    closes whole comes out NaN, where SDPA gives zeros."""
    b, hkv, g, d = q.shape
    length = key.shape[2]
    scores = _gemm_f32(q.reshape(b * hkv, g, d), key.reshape(b * hkv, length, d).transpose(1, 2))
    scores = scores.view(b, hkv, g, length).mul_(scaling)
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else scores.add_(mask)
    weights = scores.softmax(-1).to(value.dtype).view(b * hkv, g, length)
    out = _gemm_f32(weights, value.reshape(b * hkv, length, value.shape[-1]))
    return out.view(b, hkv, g, value.shape[-1]).to(q.dtype)


def _gemm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b [N, M, K] x [N, K, P] in float32 (or wider): on CUDA, 16-bit inputs as they are with
    cuBLAS's float32 output; elsewhere (a CPU has no such kernel) the inputs widened first."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype:
        return torch.bmm(a, b, out_dtype=torch.float32)
    wide = torch.promote_types(a.dtype, torch.float32)
    return torch.bmm(a.to(wide), b.to(wide))


def register_decode_attention() -> str:
    """Register the attention and SDPA's mask function under NAME (idempotent); the name."""
    AttentionInterface.register(NAME, decode_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
