"""trainer.decode_attention: a token step's attention over the cache's own key/value heads equals
the attention over heads repeated for every query head (the float64 softmax of the scores, masked),
for masks shared by the heads, masks per head and additive masks, with or without grouped heads,
and in bfloat16 within bfloat16's precision; every other call is transformers' SDPA function
unchanged; and trainer.sampling's decodes run their token steps on it and leave the model on SDPA."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from tests.helpers.engine_ref import tiny_model_dir
from trainer import decode_attention
from trainer.decode_attention import NAME, decode_sdpa_attention, register_decode_attention
from trainer.sampling import generate

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(query, key, value, mask, scaling):  # noqa: ANN001, ANN201
    """Every key/value head repeated for its query heads, the scores' softmax in float64."""
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def case(rows: int = 5, heads: int = 8, kv_heads: int = 2, length: int = 13, dim: int = 16, seed: int = 0):  # noqa: ANN201
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, 1, dim, generator=g)
    k = torch.randn(rows, kv_heads, length, dim, generator=g)
    v = torch.randn(rows, kv_heads, length, dim, generator=g)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    return module, q, k, v


@pytest.mark.parametrize("per_head", [False, True])
def test_a_token_step_equals_the_attention_over_repeated_heads(per_head: bool) -> None:
    module, q, k, v = case()
    rows, heads, length = q.shape[0], q.shape[1], k.shape[2]
    mask = torch.ones(rows, heads if per_head else 1, 1, length, dtype=torch.bool)
    for r in range(rows):  # left padding of different lengths, and a few closed columns per head
        mask[r, ..., : r * 2] = False
    if per_head:
        mask[:, 1::3, :, -4] = False
    out, weights = decode_sdpa_attention(module, q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == (rows, 1, heads, q.shape[-1]) and out.is_contiguous()
    torch.testing.assert_close(out.double(), reference(q, k, v, mask, 0.25), rtol=1e-5, atol=1e-5)
    # the mask matters (so the comparison above saw it)
    open_out, _ = decode_sdpa_attention(module, q, k, v, None, scaling=0.25)
    assert not torch.allclose(open_out, out, atol=1e-3)
    torch.testing.assert_close(open_out.double(), reference(q, k, v, None, 0.25), rtol=1e-5, atol=1e-5)


def test_other_calls_are_transformers_own_sdpa() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, _, k, v = case()
    q = torch.randn(5, 8, 4, 16, generator=torch.Generator().manual_seed(1))  # a prefill: 4 queries
    mask = torch.ones(5, 1, 4, 13, dtype=torch.bool).tril(diagonal=9)
    got, _ = decode_sdpa_attention(module, q, k, v, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    drop, _, kd, vd = case(seed=2)  # dropout: transformers' own as well
    q1 = torch.randn(5, 8, 1, 16)
    torch.manual_seed(0)
    got, _ = decode_sdpa_attention(drop, q1, kd, vd, None, dropout=0.5, scaling=0.3)
    torch.manual_seed(0)
    want, _ = sdpa_attention_forward(drop, q1, kd, vd, None, dropout=0.5, scaling=0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_token_step_without_grouped_heads_and_with_an_additive_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = decode_attention.token_attention
    monkeypatch.setattr(decode_attention, "token_attention", lambda *a: calls.append(1) or real(*a))
    plain = types.SimpleNamespace(num_key_value_groups=1, is_causal=True)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, 2, n, 16, generator=g) for n in (1, 7, 7))
    closed = torch.zeros(3, 1, 1, 7, dtype=torch.bool)
    closed[1, ..., :3] = True
    additive = torch.zeros(3, 1, 1, 7).masked_fill(closed, float("-inf"))
    got, _ = decode_sdpa_attention(plain, q, k, v, additive, scaling=0.2)
    torch.testing.assert_close(got.double(), reference(q, k, v, ~closed, 0.2), rtol=1e-5, atol=1e-5)
    # no scaling given: 1/sqrt(D), as SDPA's default
    got, _ = decode_sdpa_attention(plain, q, k, v, None)
    torch.testing.assert_close(got.double(), reference(q, k, v, None, 16 ** -0.5), rtol=1e-5, atol=1e-5)
    assert len(calls) == 2  # both on the GEMMs, not transformers' SDPA


def test_masks_of_other_dtypes_and_a_batch_unlike_the_caches_go_to_transformers_sdpa(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    monkeypatch.setattr(decode_attention, "token_attention", lambda *a: pytest.fail("not for the GEMMs"))
    module, q, k, v = case()
    ones = torch.ones(5, 1, 1, 13, dtype=torch.long)  # SDPA refuses an integer mask: so must this
    with pytest.raises(RuntimeError):
        decode_sdpa_attention(module, q, k, v, ones, scaling=0.25)
    with pytest.raises(RuntimeError):
        sdpa_attention_forward(module, q, k, v, ones, scaling=0.25)
    got, _ = decode_sdpa_attention(module, q[:1], k, v, None, scaling=0.25)  # batch 1 against 5: broadcast
    want, _ = sdpa_attention_forward(module, q[:1], k, v, None, scaling=0.25)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bfloat16_is_within_its_precision_and_float64_stays_float64() -> None:
    module, q, k, v = case(rows=4, length=40, dim=64, seed=5)
    mask = torch.ones(4, 1, 1, 40, dtype=torch.bool)
    mask[2, ..., :11] = False
    want = reference(q, k, v, mask, 0.125)
    half, _ = decode_sdpa_attention(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, scaling=0.125)
    assert half.dtype == torch.bfloat16
    # the inputs' own rounding (2^-9 relative) dominates: within a few bfloat16 places of float64
    assert (half.double() - want).abs().max() < 2 ** -6 * want.abs().max()
    wide, _ = decode_sdpa_attention(module, q.double(), k.double(), v.double(), mask, scaling=0.125)
    assert wide.dtype == torch.float64
    torch.testing.assert_close(wide, want, rtol=1e-12, atol=1e-12)


def test_it_is_registered_with_sdpas_masks() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    assert register_decode_attention() == NAME == register_decode_attention()
    assert AttentionInterface()[NAME] is decode_sdpa_attention
    assert AttentionMaskInterface()[NAME] is sdpa_mask


@pytest.mark.parametrize("static", [True, False])
def test_generate_runs_its_token_steps_on_it_and_leaves_sdpa(static: bool, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.engine import MultiLoraEngine
    from trainer.jobs import TrainJob

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", tmp_path), dtype=torch.float64).eval()
    assert model.config._attn_implementation == "sdpa" and model.config.num_key_value_heads < model.config.num_attention_heads
    engine = MultiLoraEngine(model, [], model.config.pad_token_id)
    engine.attach(TrainJob("a", lora_rank=2, lora_alpha=4.0, seed=0, learning_rate=1e-2, batch_size=1, max_steps=2))
    seen: list[tuple[int, ...]] = []
    real = decode_attention.token_attention

    def spy(q, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    prompts = [[11, 12, 13], [14, 15, 16, 17, 18]]
    off = {"LORAPLEX_DECODE_GQA": "0"}
    with monkeypatch.context() as m:
        for k, v in off.items():
            m.setenv(k, v)
        want = generate(engine, prompts, ["a", None], max_new_tokens=5, pad_id=engine.pad_id, static=static)
    monkeypatch.setattr(decode_attention, "token_attention", spy)
    got = generate(engine, prompts, ["a", None], max_new_tokens=5, pad_id=engine.pad_id, static=static)
    assert got == want
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    layers = model.config.num_hidden_layers
    # every token step after the prefill, in every layer, as [rows, kv heads, groups, dim]
    assert len(seen) == 4 * layers and {s[:3] for s in seen} == {(2, model.config.num_key_value_heads, groups)}
    assert model.config._attn_implementation == "sdpa"
