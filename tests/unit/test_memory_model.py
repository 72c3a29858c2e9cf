"""Unit: the memory model built with no profiling pass (trainer.memory_model): its terms from a
model config, and the online correction from the allocator's peaks of real steps (raised at once
when a step needs more, lowered to what the steps needed once they agree, replays ignored)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from trainer.admission import MemoryModel
from trainer.memory_model import OnlineCorrection, Shapes, analytic_model, per_token_bytes

LLAMA_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8)


def test_shapes_and_terms_of_the_8b_config() -> None:
    s = Shapes.of(LLAMA_8B)
    assert (s.hidden, s.intermediate, s.layers, s.kv, s.vocab) == (4096, 14336, 32, 1024, 128256)
    with_rc, without = (per_token_bytes(s, rc, 7, 64) for rc in (True, False))
    # recompute keeps a layer's input per layer (+ one layer live): far less than every layer's
    assert 32 * 2 * 4096 < with_rc < without / 4
    mm = analytic_model(LLAMA_8B, resident=16e9, state_bytes_per_rank=2.6e6 * 16, max_rank=64, n_targets=7,
                        head_chunk=2048, seq_len=1024, recompute=True)
    # the backbone, one rank-64 job's state (2.7 GB), the head's chunk (3.2 GB), a workspace
    assert 16e9 + 2.6e6 * 16 * 64 < mm.k0 < 16e9 + 2.6e6 * 16 * 64 + 4e9
    assert mm.k1 == pytest.approx(with_rc)
    # a DPO item is two sequences
    pairs = analytic_model(LLAMA_8B, resident=16e9, state_bytes_per_rank=0, max_rank=16, n_targets=7,
                           head_chunk=2048, seq_len=1024, recompute=True, sequences_per_item=2)
    assert pairs.k1 == pytest.approx(2 * per_token_bytes(Shapes.of(LLAMA_8B), True, 7, 16))


def test_online_correction_raises_at_once_and_settles_to_the_observed_need() -> None:
    corr = OnlineCorrection(MemoryModel(20e9, 500e3), fixed=1e9, settle=3)
    # a step needing 600 kB a token: raised at once, above it
    assert corr.observe(2000, True, 20_000_000_000, int(20e9 + 1e9 + 600e3 * 2000))
    assert corr.model.k1 == pytest.approx(600e3 * 1.05)
    # a replay allocates nothing: ignored
    assert not corr.observe(2000, True, 20_000_000_000, 20_000_000_000)
    # steps needing less: kept until `settle` steps agree, then lowered to the largest need + 5%
    assert not corr.observe(1000, True, 20_000_000_000, int(20e9 + 1e9 + 400e3 * 1000))
    assert corr.observe(3000, True, 20_000_000_000, int(20e9 + 1e9 + 590e3 * 3000)) is False
    assert corr.model.k1 == pytest.approx(630e3)
    corr2 = OnlineCorrection(MemoryModel(20e9, 900e3), fixed=1e9, settle=2)
    corr2.observe(1000, True, 20_000_000_000, int(20e9 + 1e9 + 500e3 * 1000))
    assert corr2.model.k1 == 900e3  # one step: not yet
    assert corr2.observe(1000, True, 20_000_000_000, int(20e9 + 1e9 + 520e3 * 1000))
    assert corr2.model.k1 == pytest.approx(520e3 * 1.05)
    assert corr2.model.k0 == 20e9
    # every step is traced with its prediction at the model of its time
    assert [round(p.predicted) for p in corr2.trace] == [round(20e9 + 1e9 + 900e3 * 1000)] * 2
