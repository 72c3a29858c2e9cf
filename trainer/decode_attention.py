"""The decode's attention: transformers' SDPA attention, except that a token step (one query per
row) of a grouped-query model reads the cache's key/value heads as they are.

transformers' SDPA function (5.17, the GPU image's) repeats every key/value head for each of its
query heads (`repeat_kv`) whenever there is a mask, and a decode of left-padded prompts always has
one: in each token step, each layer copies its whole cache 4x (Llama-3.1-8B: 32 query heads over 8
key/value heads) before the attention reads it, and the math backend (the one whose decode repeats,
trainer.sampling.repeatable) reads the copy again. At 32 layers of the 8B shape and 32 rows that
copy is the largest part of a token step's memory traffic. Here a token step's query [B, H, 1, D]
is viewed as [B, Hkv, H/Hkv, D] (each key/value head's queries as its rows) and attends to the
cache [B, Hkv, L, D] directly, with the mask broadcast over the heads: the same products and sums
per query head, no copy (what newer transformers releases do themselves). Every other call (the
prefill, a model without grouped heads, scores with a bias or a soft-cap) is transformers' own.

Registered under its own name with SDPA's mask function, so the masks are built exactly as for
"sdpa"; trainer.sampling switches a model whose attention is "sdpa" to it for a decode and back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
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
    if query.shape[2] != 1 or groups <= 1 or dropout or special or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    b, h, _, d = query.shape
    q = query.reshape(b, h // groups, groups, d)
    mask = attention_mask
    if mask is not None and mask.shape[1] != 1:  # a mask per query head: the same regrouping
        mask = mask.reshape(mask.shape[0], h // groups, groups, mask.shape[-1])
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=0.0, scale=scaling,
                                         is_causal=False)
    return out.reshape(b, h, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def register_decode_attention() -> str:
    """Register the attention and SDPA's mask function under NAME (idempotent); the name."""
    AttentionInterface.register(NAME, decode_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
