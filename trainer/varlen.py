"""Attention over variable-length sequences laid one after another in one row (cu_seqlens), as a
transformers attention implementation: the engine's "varlen" packing needs no padding between
sequences or jobs and no [L, L] mask, and no token attends across a sequence bound.

On CUDA it is torch's flash varlen kernel (torch.nn.attention.varlen.varlen_attn, causal, GQA);
elsewhere, or without bounds (a plain call such as the export round trip), exact causal SDPA per
sequence. The model's forward passes the bounds as `cu_seq_lens_q` / `max_length_q` keyword
arguments, which transformers hands to the attention function of every layer.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812

NAME = "loraplex_varlen"


@functools.cache
def _flash_options() -> tuple[Any, frozenset[str]] | None:
    """torch's varlen kernel and its keyword arguments (causality is `window_size=(-1, 0)` in
    newer torch, `is_causal` in older), or None where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def flash_varlen_available() -> bool:
    """Whether this torch has the flash varlen kernel (it runs on CUDA only)."""
    return _flash_options() is not None


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor,
           max_len: int, scaling: float | None) -> torch.Tensor:
    varlen_attn, params = _flash_options()
    # [1, H, T, D] -> [T, H, D]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    kw: dict[str, Any] = {"scale": scaling} if "scale" in params else {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, **kw)
    return out.unsqueeze(0)  # [1, T, H, D]


def _per_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  bounds: list[int] | None, scaling: float | None) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    if bounds is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    else:
        out = torch.cat([F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b],
                                                        value[:, :, a:b], is_causal=True, scale=scaling)
                         for a, b in zip(bounds[:-1], bounds[1:], strict=True)], dim=2)
    return out.transpose(1, 2).contiguous()


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
                     ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, T, D], key/value [B, Hkv, T, D]
    -> ([B, T, H, D], None). With `cu_seq_lens_q` (B = 1): causal within each sequence."""
    if dropout:
        raise ValueError("varlen attention trains without attention dropout")
    cu = kwargs.get("cu_seq_lens_q")
    if (cu is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and _flash_options() is not None):
        return _flash(query, key, value, cu, int(kwargs["max_length_q"]), scaling), None
    bounds = None if cu is None else [int(x) for x in cu.tolist()]
    return _per_sequence(query, key, value, bounds, scaling), None


def register_varlen() -> str:
    """Register the attention with transformers (idempotent); its implementation name."""
    from transformers import AttentionInterface

    # registered as an attention only: transformers then builds no mask for it (the bounds come
    # as cu_seq_lens), which also skips its packed-sequence detection and that detection's sync
    AttentionInterface.register(NAME, varlen_attention)
    return NAME
