"""GPU: the varlen attention's flash path (torch's varlen kernel, bf16) over packed sequences,
with and without a sliding window, and its exact fallback for a soft-capped layer, against the
float64 one-mask reference."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.attention_ref import packed_attention_ref
from trainer.varlen import flash_varlen_available, varlen_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BOUNDS = [0, 100, 700, 701, 1500, 2048]


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (256, None), (4096, None),
                                                 (256, 50.0)])
def test_flash_varlen_matches_the_reference(window: int | None, softcap: float | None) -> None:
    if not flash_varlen_available():
        pytest.skip("this torch has no flash varlen kernel")
    g = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, dim = 8, 2, 64
    total = BOUNDS[-1]
    q, k, v = (torch.randn(1, h, total, dim, generator=g, device="cuda", dtype=torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor(BOUNDS, dtype=torch.int32, device="cuda")
    longest = max(b - a for a, b in zip(BOUNDS[:-1], BOUNDS[1:], strict=True))
    out, _ = varlen_attention(None, q, k, v, None, scaling=dim ** -0.5, sliding_window=window,
                              softcap=softcap, cu_seq_lens_q=cu, max_length_q=longest)
    ref = packed_attention_ref(q, k, v, BOUNDS, dim ** -0.5, window, softcap)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    if window == 256:  # the window matters here: the unwindowed result differs
        plain = packed_attention_ref(q, k, v, BOUNDS, dim ** -0.5, None, softcap)
        assert (out.double() - plain).abs().max() > 5e-2


def test_flash_varlen_bounds_from_position_ids() -> None:
    """A layer that drops the bounds but passes its position ids (StableLM, Nemotron): the flash
    path attends within the sequences where the positions restart."""
    if not flash_varlen_available():
        pytest.skip("this torch has no flash varlen kernel")
    g = torch.Generator(device="cuda").manual_seed(1)
    dim, total = 64, BOUNDS[-1]
    q, k, v = (torch.randn(1, h, total, dim, generator=g, device="cuda", dtype=torch.bfloat16)
               for h in (8, 8, 8))
    positions = torch.cat([torch.arange(b - a, device="cuda")
                           for a, b in zip(BOUNDS[:-1], BOUNDS[1:], strict=True)])[None]
    out, _ = varlen_attention(None, q, k, v, None, scaling=dim ** -0.5, position_ids=positions)
    ref = packed_attention_ref(q, k, v, BOUNDS, dim ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    whole = packed_attention_ref(q, k, v, [0, total], dim ** -0.5)
    assert (out.double() - whole).abs().max() > 5e-2  # not one causal row


def test_flash_varlen_grouped_query_gradients_match_the_reference() -> None:
    """Fewer key/value heads go to the flash kernel unexpanded (trainer.varlen._GQA_STRAIGHT stays
    on: this torch's wrapper takes them), and the output and the gradients of q, k and v (the key and
    value ones summed over each head's group by the kernel) match the float64 reference."""
    if not flash_varlen_available():
        pytest.skip("this torch has no flash varlen kernel")
    from trainer import varlen

    g = torch.Generator(device="cuda").manual_seed(2)
    heads, kv_heads, dim, total = 8, 2, 64, BOUNDS[-1]
    q, k, v = (torch.randn(1, h, total, dim, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
               for h in (heads, kv_heads, kv_heads))
    w = torch.randn(1, total, heads, dim, generator=g, device="cuda")
    cu = torch.tensor(BOUNDS, dtype=torch.int32, device="cuda")
    longest = max(b - a for a, b in zip(BOUNDS[:-1], BOUNDS[1:], strict=True))
    out, _ = varlen_attention(None, q, k, v, None, scaling=dim ** -0.5, cu_seq_lens_q=cu, max_length_q=longest)
    (out.float() * w).sum().backward()
    assert varlen._GQA_STRAIGHT == [True]
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = packed_attention_ref(q64, k64, v64, BOUNDS, dim ** -0.5)
    (ref * w.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert got.shape == want.shape
        scale = want.abs().max().item()
        assert (got.double() - want).abs().max().item() <= 2e-2 * scale
