"""Unit: trainer.varlen's attention over packed sequences honours what the model's own attention
does: each sequence alone, causal, a layer's sliding window, an attention soft-cap (checked
against a float64 one-mask reference), and which models the flash kernel may serve."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers.attention_ref import packed_attention_ref
from trainer.varlen import flash_exact, varlen_attention

BOUNDS = [0, 5, 29, 30, 52]  # one sequence of 1 token, the others shorter/longer than window 8


def packed(seed: int = 0, heads: int = 4, kv_heads: int = 2, dim: int = 16):  # noqa: ANN201
    g = torch.Generator().manual_seed(seed)
    total = BOUNDS[-1]
    q = torch.randn(1, heads, total, dim, generator=g)
    k = torch.randn(1, kv_heads, total, dim, generator=g)
    v = torch.randn(1, kv_heads, total, dim, generator=g)
    return q, k, v


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (8, None), (None, 2.0), (8, 2.0),
                                                 (64, None)])
def test_packed_attention_matches_the_one_mask_reference(window: int | None,
                                                         softcap: float | None) -> None:
    q, k, v = packed()
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    out, _ = varlen_attention(None, q, k, v, None, scaling=0.3, sliding_window=window,
                              softcap=softcap, cu_seq_lens_q=cu, max_length_q=24)
    ref = packed_attention_ref(q, k, v, BOUNDS, 0.3, window, softcap)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    if window == 8 or softcap:  # the window and the cap change the result: not a no-op
        plain = packed_attention_ref(q, k, v, BOUNDS, 0.3)
        assert (out.double() - plain).abs().max() > 1e-2


def test_a_plain_call_is_one_causal_sequence_within_the_window() -> None:
    q, k, v = packed(1)
    out, _ = varlen_attention(None, q, k, v, None, scaling=0.25, sliding_window=8)
    ref = packed_attention_ref(q, k, v, [0, BOUNDS[-1]], 0.25, 8)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_flash_serves_only_models_whose_attention_it_computes() -> None:
    if not flash_exact(SimpleNamespace()):
        pytest.skip("this torch has no flash varlen kernel")
    assert flash_exact(SimpleNamespace(sliding_window=None, attn_logit_softcapping=None))
    assert not flash_exact(SimpleNamespace(attn_logit_softcapping=50.0))  # Gemma-2
