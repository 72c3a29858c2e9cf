"""trainer.head: one chunked head + cross-entropy for every job of a step equals each job's own
head and loss (values and gradients, in float64), with the family's logit scale and soft-cap, at
any chunk size; a non-finite hidden state stays in its own tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.head import default_chunk, token_losses


def _logits_fn(head: nn.Linear, scale: float | None, cap: float | None):  # noqa: ANN202
    def fn(h: torch.Tensor) -> torch.Tensor:
        z = head(h).to(torch.promote_types(h.dtype, torch.float32))
        if scale is not None:
            z = z * scale
        if cap is not None:
            z = torch.tanh(z / cap) * cap
        return z
    return fn


@pytest.mark.parametrize("scale,cap", [(None, None), (0.0625, None), (None, 30.0), (2.0, 5.0)])
@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_chunked_losses_and_gradients_equal_the_plain_head(scale, cap, chunk) -> None:  # noqa: ANN001
    torch.manual_seed(chunk)
    head = nn.Linear(16, 50, bias=False).double().requires_grad_(False)
    fn = _logits_fn(head, scale, cap)
    h = torch.randn(23, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (23,))
    w = torch.rand(23, dtype=torch.float64)  # per-token weights, as 1/n of each job
    got = token_losses(fn, h, t, chunk)
    (got * w).sum().backward()
    g_got = h.grad.clone()
    h.grad = None
    want = nn.functional.cross_entropy(fn(h), t, reduction="none")
    (want * w).sum().backward()
    assert torch.allclose(got, want.detach(), rtol=1e-12, atol=1e-12)
    assert torch.allclose(g_got, h.grad, rtol=1e-10, atol=1e-12)
    assert head.weight.grad is None  # the frozen head gets nothing
    with torch.no_grad():  # evaluation: the same values without a graph
        assert torch.allclose(token_losses(fn, h, t, chunk), want.detach(), rtol=1e-12)


def test_a_non_finite_hidden_state_stays_in_its_own_tokens() -> None:
    head = nn.Linear(8, 20, bias=False).requires_grad_(False)
    fn = _logits_fn(head, None, None)
    h = torch.randn(10, 8)
    h[3] = float("nan")
    h.requires_grad_(True)
    t = torch.randint(0, 20, (10,))
    losses = token_losses(fn, h, t, 4)
    assert torch.isnan(losses[3]) and torch.isfinite(torch.cat([losses[:3], losses[4:]])).all()
    w = torch.ones(10)
    w[3] = 0.0
    (losses * w).nan_to_num(0.0).sum().backward()
    assert torch.isfinite(torch.cat([h.grad[:3], h.grad[4:]])).all()


def test_default_chunk_bounds_the_logits() -> None:
    assert default_chunk(128256) == 2080 and default_chunk(32000) == 8384 and default_chunk(10**9) == 256
    # a multiple of 16 for every vocabulary: each chunk's int64 targets start 16-byte aligned, so the
    # fused cross-entropy's kernel compiles once (Qwen2.5's 152,064 gave 1,765 tokens before)
    assert all(default_chunk(v) % 16 == 0 for v in (152064, 151936, 49152, 50257, 256000, 32001))


def test_the_fused_cross_entropy_serves_a_plain_head_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelHead.plain_weight (the fused kernel's gate) on a real engine, its device check stood in:
    the LM head's weight for a bias-free head with no logit scale or cap, on the CPU only when forced;
    None for a soft-cap, a head with a bias, another dtype, or under LORAPLEX_FUSED_CE=0."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainer import head as head_mod
    from trainer.engine import MultiLoraEngine

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    eng = MultiLoraEngine(AutoModelForCausalLM.from_config(cfg), [], 0)
    monkeypatch.setattr(head_mod, "fused_ce_available", lambda _t: True)
    head, h = eng.output_logits, torch.zeros(3, 32)
    assert head.plain_weight(h) is None  # the CPU, not forced
    head.force_fused = True
    assert head.plain_weight(h) is eng.model.get_output_embeddings().weight
    assert head.plain_weight(h.double()) is None  # another dtype than the head's
    monkeypatch.setenv("LORAPLEX_FUSED_CE", "0")
    assert head.plain_weight(h) is None
    monkeypatch.delenv("LORAPLEX_FUSED_CE")
    eng.logit_softcap = 30.0
    assert head.plain_weight(h) is None
    eng.logit_softcap = None
    lin = eng.model.get_output_embeddings()
    lin.bias = torch.nn.Parameter(torch.zeros(64), requires_grad=False)
    assert head.plain_weight(h) is None
    lin.bias = None
    assert head.plain_weight(h) is lin.weight
    del eng
    import gc

    gc.collect()
    with pytest.raises(RuntimeError, match="engine is gone"):
        head(h)
