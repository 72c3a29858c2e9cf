"""Unit: trainer.varlen's attention over packed sequences honours what the model's own attention
does: each sequence alone, causal, a layer's sliding window, an attention soft-cap (checked
against a float64 one-mask reference), the bounds read from the position ids where a layer drops
them (StableLM, Nemotron), and which models the flash kernel may serve."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers.attention_ref import packed_attention_ref
from trainer import varlen
from trainer.varlen import bounds_from_positions, flash_exact, varlen_attention

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


def positions(bounds: list[int]) -> torch.Tensor:
    """A packed row's position ids: 0, 1, ... within each sequence."""
    return torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])[None]


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (8, 2.0)])
def test_without_bounds_the_position_ids_give_them(window: int | None,
                                                   softcap: float | None) -> None:
    """A layer that drops cu_seq_lens_q but passes position_ids still attends within each
    sequence: the bounds are where the positions restart."""
    q, k, v = packed(2)
    pos = positions(BOUNDS)
    cu, longest = bounds_from_positions(pos, q, k)
    assert cu.tolist() == BOUNDS and cu.dtype == torch.int32 and longest == 24
    out, _ = varlen_attention(None, q, k, v, None, scaling=0.3, sliding_window=window,
                              softcap=softcap, position_ids=pos)
    ref = packed_attention_ref(q, k, v, BOUNDS, 0.3, window, softcap)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # across the bounds it would differ: the positions were read, not ignored
    assert (out.double() - packed_attention_ref(q, k, v, [0, BOUNDS[-1]], 0.3, window,
                                                softcap)).abs().max() > 1e-2
    # one plain sequence (positions 0..T-1) is one causal sequence
    whole = bounds_from_positions(positions([0, BOUNDS[-1]]), q, k)
    assert whole[0].tolist() == [0, BOUNDS[-1]] and whole[1] == BOUNDS[-1]
    # the same tensor is read once for every layer, and again once changed in place
    assert bounds_from_positions(pos, q, k)[0] is bounds_from_positions(pos, q, k)[0]
    pos[0, 5:] = torch.arange(BOUNDS[-1] - 5)
    assert bounds_from_positions(pos, q, k)[0].tolist() == [0, 5, BOUNDS[-1]]


def test_a_capture_fails_at_the_positions_read_and_keeps_no_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a CUDA-graph capture the positions' kernels are captured, not run: the read fails the
    capture at once (the step runs eagerly), and the bounds kept for the next layers stay the eager
    forward's own."""
    from trainer import varlen

    q, k, _ = packed(4)
    pos = positions(BOUNDS)
    kept = bounds_from_positions(pos, q, k)
    assert not varlen._in_capture(q)  # a host tensor is never inside a capture
    monkeypatch.setattr(varlen, "_in_capture", lambda t: True)
    with pytest.raises(RuntimeError, match="not capturable"):
        bounds_from_positions(positions([0, BOUNDS[-1]]), q, k)
    with pytest.raises(RuntimeError, match="not capturable"):
        bounds_from_positions(pos, q, k)  # not even the kept bounds: a replay would keep them forever
    monkeypatch.undo()
    assert bounds_from_positions(pos, q, k)[0] is kept[0]


def test_positions_that_do_not_describe_the_row_give_no_bounds() -> None:
    q, k, v = packed(3)
    assert bounds_from_positions(None, q, k) == (None, None)
    assert bounds_from_positions(positions(BOUNDS)[:, :-1], q, k) == (None, None)
    two = torch.cat([q, q])
    assert bounds_from_positions(positions(BOUNDS).expand(2, -1), two, torch.cat([k, k])) == (
        None, None)


def test_bounds_passed_are_used_and_the_positions_never_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that passes cu_seq_lens_q never pays for reading the positions (a device sync)."""
    def unread(*_a: object) -> None:
        raise AssertionError("position ids read although the bounds came")

    monkeypatch.setattr(varlen, "bounds_from_positions", unread)
    q, k, v = packed(4)
    out, _ = varlen_attention(None, q, k, v, None, scaling=0.3, position_ids=positions([0, 52]),
                              cu_seq_lens_q=torch.tensor(BOUNDS, dtype=torch.int32),
                              max_length_q=24)
    torch.testing.assert_close(out.double(), packed_attention_ref(q, k, v, BOUNDS, 0.3),
                               rtol=1e-5, atol=1e-5)


def _fake_varlen(seen: list, check: bool, flag: bool):  # noqa: ANN202
    """A stand-in for torch's varlen_attn of one torch version: with the `enable_gqa` flag (2.13),
    without it and without a check (2.11), or with a check and no flag (a wrapper that refuses
    fewer key/value heads). It records the key heads it got and attends as the flash kernel does
    (each key/value head serving its group of query heads)."""
    def attend(q, k, v, cu, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **kw):  # noqa: ANN001, ANN202
        if check and q.shape[1] != k.shape[1] and not kw.get("enable_gqa"):
            raise ValueError("Expect query and key/value to have the same number of heads")
        seen.append((k.shape[1], bool(kw.get("enable_gqa"))))
        bounds = [int(x) for x in cu.tolist()]
        ref = packed_attention_ref(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                   bounds, scale)
        return ref[0].to(q.dtype)

    def with_flag(q, k, v, cu, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):  # noqa: ANN001, ANN202
        return attend(q, k, v, cu, cu_k, max_q, max_k, scale=scale, window_size=window_size, enable_gqa=enable_gqa)

    def without(q, k, v, cu, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):  # noqa: ANN001, ANN202
        return attend(q, k, v, cu, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    fn = with_flag if flag else without
    import inspect
    return fn, frozenset(inspect.signature(fn).parameters)


@pytest.mark.parametrize(("check", "flag", "heads_seen"), [
    (True, True, [(2, True)]),                    # torch 2.13: the flag
    (False, False, [(2, False)]),                 # torch 2.11: no flag, no check
    (True, False, [(4, False), (4, False)]),      # a wrapper that refuses: expanded, then at once
])
def test_grouped_query_heads_reach_the_flash_kernel_unexpanded(
        monkeypatch: pytest.MonkeyPatch, check: bool, flag: bool, heads_seen: list) -> None:
    """Fewer key/value heads go to the flash kernel as they are (no two query-sized copies a layer),
    with the flag where torch has one; a wrapper that refuses them gets them expanded, the same
    attention, and is not asked again."""
    seen: list = []
    monkeypatch.setattr(varlen, "_flash_options", lambda: _fake_varlen(seen, check, flag))
    monkeypatch.setattr(varlen, "_GQA_STRAIGHT", [True])
    q, k, v = packed(5)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    ref = packed_attention_ref(q, k, v, BOUNDS, 0.3)
    for _ in range(2 if check and not flag else 1):
        out = varlen._flash(q, k, v, cu, 24, 0.3, None)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert seen == heads_seen
    assert varlen._GQA_STRAIGHT == [not (check and not flag)]


class _FlashLike(torch.autograd.Function):
    """The flash kernel's contract in a stand-in: [T, H, D] in, [T, H, D] out, and gradients
    returned contiguous in [T, H, D] (the reference's own backward gives them in its layout)."""

    @staticmethod
    def forward(ctx, q, k, v, bounds, scale):  # noqa: ANN001, ANN205, D102
        ctx.save_for_backward(q, k, v)
        ctx.bounds, ctx.scale = bounds, scale
        return _FlashLike._attend(q, k, v, bounds, scale).contiguous()

    @staticmethod
    def _attend(q, k, v, bounds, scale):  # noqa: ANN001, ANN205
        t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
        return packed_attention_ref(t(q), t(k), t(v), bounds, scale)[0].to(q.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205, D102
        inputs = [x.detach().requires_grad_() for x in ctx.saved_tensors]
        with torch.enable_grad():
            out = _FlashLike._attend(*inputs, ctx.bounds, ctx.scale)
        grads = torch.autograd.grad(out, inputs, grad)
        return (*(g.contiguous() for g in grads), None, None)


def test_the_kernels_gradients_reach_the_projections_in_their_own_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """q, k and v come from the projections as [1, T, H, D] memory seen as [1, H, T, D]; the flash
    path hands the kernel's [T, H, D] gradients back in that layout (views only: the projections'
    own view then needs no copy), and they are the reference's gradients."""
    def attend(q, k, v, cu, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):  # noqa: ANN001, ANN202
        return _FlashLike.apply(q, k, v, [int(x) for x in cu.tolist()], scale)

    import inspect
    monkeypatch.setattr(varlen, "_flash_options", lambda: (attend, frozenset(inspect.signature(attend).parameters)))
    monkeypatch.setattr(varlen, "_GQA_STRAIGHT", [True])
    total, dim = BOUNDS[-1], 16
    g = torch.Generator().manual_seed(3)
    rows = {name: torch.randn(1, total, heads * dim, generator=g, dtype=torch.float64, requires_grad=True)
            for name, heads in (("q", 4), ("k", 2), ("v", 2))}
    q, k, v = (rows[n].view(1, total, -1, dim).transpose(1, 2) for n in ("q", "k", "v"))
    seen = []
    for t in (q, k, v):
        t.register_hook(lambda grad: seen.append(grad))
    weight = torch.randn(1, total, 4, dim, generator=g, dtype=torch.float64)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    (varlen._flash(q, k, v, cu, 24, 0.3, None) * weight).sum().backward()
    assert len(seen) == 3 and all(grad.transpose(1, 2).is_contiguous() for grad in seen)
    ref = [x.detach().clone().requires_grad_() for x in rows.values()]
    rq, rk, rv = (x.view(1, total, -1, dim).transpose(1, 2) for x in ref)
    (packed_attention_ref(rq, rk, rv, BOUNDS, 0.3) * weight).sum().backward()
    for got, want in zip(rows.values(), ref, strict=True):
        torch.testing.assert_close(got.grad, want.grad)
