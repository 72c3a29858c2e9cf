"""Attention over variable-length sequences laid one after another in one row (cu_seqlens), as a
transformers attention implementation: the engine's "varlen" packing needs no padding between
sequences or jobs and no [L, L] mask, and no token attends across a sequence bound. A layer's
sliding window (Mistral, Gemma-2/3, StarCoder2: a token sees itself and the window - 1 before it)
and attention soft-cap (Gemma-2: cap * tanh(scores / cap)) are honoured as the model's own
attention applies them; they arrive as the attention call's `sliding_window` / `softcap`.

On CUDA it is torch's flash varlen kernel (torch.nn.attention.varlen.varlen_attn, causal, GQA);
elsewhere, or without bounds (a plain call such as the export round trip), exact causal SDPA per
sequence. The model's forward passes the bounds as `cu_seq_lens_q` / `max_length_q` keyword
arguments, which transformers hands to the attention function of every layer; where a layer drops
them but passes its `position_ids` (StableLM, Nemotron), the bounds are where the positions
restart (bounds_from_positions).
"""

from __future__ import annotations

import functools
import inspect
import weakref
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


def _flash_serves(window: int | None, softcap: float | None) -> bool:
    """Whether torch's flash varlen kernel computes attention with this window and soft-cap:
    never a soft-cap (the kernel has none), a window only where this torch's kernel takes one."""
    options = _flash_options()
    return options is not None and not softcap and (not window or "window_size" in options[1])


def flash_exact(config: Any) -> bool:
    """Whether torch's flash varlen kernel computes this model's own attention (_flash_serves
    with its sliding window and attention soft-cap). Otherwise the varlen attention falls back to
    exact per-sequence attention, which is correct but slow: the executor then keeps its padded
    rows."""
    return _flash_serves(getattr(config, "sliding_window", None),
                         getattr(config, "attn_logit_softcapping", None))


# Grouped-query attention (fewer key/value heads) goes to the flash kernel as it is: torch's flash
# varlen kernel reads each key/value head for its group of query heads (forward) and sums the
# group's gradients (backward). Torch 2.13 asks for `enable_gqa=True`; torch 2.11's wrapper has no
# such flag and no check, so the heads pass straight through. Expanding them instead
# (repeat_interleave) cost two copies of a query's size per layer and per forward, kept for the
# backward: on an H100 at 32 layers of the 8B shape, 116 ms of a 12-job evaluation's 5.2 s and
# 12 KB a token a layer of a training step's activations. A wrapper that refuses them (ValueError)
# gets them expanded from then on.
_GQA_STRAIGHT = [True]


def gqa_unexpanded() -> bool:
    """Whether the flash path keeps grouped-query key/value heads at their own width (the memory
    model counts what the attention keeps)."""
    options = _flash_options()
    return options is not None and ("enable_gqa" in options[1] or _GQA_STRAIGHT[0])


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor,
           max_len: int, scaling: float | None, window: int | None) -> torch.Tensor:
    varlen_attn, params = _flash_options()
    # [1, H, T, D] -> [T, H, D], by views whose backward are views too: the kernel's gradients
    # ([T, H, D], contiguous) reach the projections laid out as their outputs are. `t[0]` here cost
    # its backward a zeroed [1, H, T, D] copy of each gradient, then the projections' view a copy
    # back: 6 copies and 3 fills of a query's size a layer (2.0 ms of an H200's 2-job step at
    # 32 layers, session 51's `bench/host_profile.py --stacks`)
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))
    kw: dict[str, Any] = {"scale": scaling} if "scale" in params else {}
    if "window_size" in params:
        kw["window_size"] = (-1 if window is None else window - 1, 0)
    else:  # a torch without windows: varlen_attention passes none here
        kw["is_causal"] = True
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if q.shape[1] != k.shape[1] and "enable_gqa" in params:
        kw["enable_gqa"] = True
    elif q.shape[1] != k.shape[1]:
        if _GQA_STRAIGHT[0]:
            try:  # flash takes fewer key/value heads itself; this torch's wrapper may still refuse
                return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw).unsqueeze(0)
            except ValueError:
                _GQA_STRAIGHT[0] = False
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)
    return out.unsqueeze(0)  # [1, T, H, D]


def _exact(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
           window: int | None, softcap: float | None) -> torch.Tensor:
    """Causal attention of one sequence [1, H, T, D] (key/value already expanded to H heads),
    with the model's window and soft-cap where they change anything: SDPA when neither does."""
    length = query.shape[2]
    if not softcap and (window is None or window >= length):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(length, device=query.device)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)


def _per_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  bounds: list[int] | None, scaling: float | None, window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    if bounds is None:
        out = _exact(query, key, value, scaling, window, softcap)
    else:
        # empty sequences (a graphed step's spare bounds repeat the row's end) hold no tokens
        out = torch.cat([_exact(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scaling,
                                window, softcap)
                         for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a], dim=2)
    return out.transpose(1, 2).contiguous()


_positions_seen: list[Any] = []  # [weakref to the position ids, their version, (cu, longest)]


def _in_capture(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def bounds_from_positions(position_ids: torch.Tensor | None, query: torch.Tensor,
                          key: torch.Tensor) -> tuple[torch.Tensor | None, int | None]:
    """The sequence bounds of a packed row [1, T] from its position ids, for the layers that
    hand the attention their position ids but drop the bounds (StableLM's and Nemotron's decoder
    layers call their attention without the forward's keyword arguments): a sequence starts at
    the row's first token and wherever the positions do not go on by one (the engine restarts
    them at 0 per sequence and for the padding tail; transformers detects packed rows the same
    way). (None, None) without position ids of this row. Finding the starts reads the positions
    on the host: one device sync per forward (the bounds are kept for the layers after the first
    while the same position-id tensor comes unchanged), paid only by a model whose layers drop
    the bounds; a model that passes them never comes here."""
    if _in_capture(query):
        # the host cannot read what a capture has not computed: fail it here, before a read whose
        # garbage (kernels captured, not run) a bound kept for the later layers would carry on
        raise RuntimeError("the sequence bounds are read from the positions on the host: not capturable")
    if (position_ids is None or query.shape[0] != 1 or position_ids.dim() != 2
            or position_ids.shape != (1, query.shape[2]) or key.shape[2] != query.shape[2]):
        return None, None
    if _positions_seen:
        ref, version, found = _positions_seen
        if ref() is position_ids and version == position_ids._version:
            return found
    pos = position_ids[0]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    edges = torch.cat([starts.nonzero()[:, 0], starts.new_tensor([pos.numel()], dtype=torch.long)])
    cu = edges.to(torch.int32)
    found = (cu, int((edges[1:] - edges[:-1]).max()))
    _positions_seen[:] = [weakref.ref(position_ids), position_ids._version, found]
    return found


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, T, D], key/value [B, Hkv, T, D]
    -> ([B, T, H, D], None). With `cu_seq_lens_q` (B = 1): causal within each sequence, within
    the layer's sliding window, scores soft-capped where the layer caps them."""
    if dropout:
        raise ValueError("varlen attention trains without attention dropout")
    window = int(sliding_window) if sliding_window else None
    cu = kwargs.get("cu_seq_lens_q")
    max_len = kwargs.get("max_length_q")
    if cu is None:  # a layer that drops the bounds (StableLM, Nemotron): read the positions
        cu, max_len = bounds_from_positions(kwargs.get("position_ids"), query, key)
    if cu is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        max_len = int(max_len)
        if window is not None and window >= max_len:
            window = None  # no sequence is longer than the window: plain causal
        if _flash_serves(window, softcap):
            return _flash(query, key, value, cu, max_len, scaling, window), None
    bounds = None if cu is None else [int(x) for x in cu.tolist()]
    return _per_sequence(query, key, value, bounds, scaling, window, softcap), None


def register_varlen() -> str:
    """Register the attention with transformers (idempotent); its implementation name."""
    from transformers import AttentionInterface

    # registered as an attention only: transformers then builds no mask for it (the bounds come
    # as cu_seq_lens), which also skips its packed-sequence detection and that detection's sync
    AttentionInterface.register(NAME, varlen_attention)
    return NAME
