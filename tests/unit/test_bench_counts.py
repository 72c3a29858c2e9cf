"""Unit: the benchmarks' MFU count from a config alone (bench/baselines.config_matmul_params) equals
the count over a built model's weights (backbone_params), which only the baseline arms build."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from baselines import backbone_params, config_matmul_params  # noqa: E402


@pytest.mark.parametrize("cfg", [
    LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=3,
                num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, head_dim=48, tie_word_embeddings=False),
    Qwen2Config(vocab_size=800, hidden_size=192, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False),
])
def test_the_count_from_the_config_equals_the_built_models(cfg) -> None:  # noqa: ANN001
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert config_matmul_params(cfg) == backbone_params(model)
