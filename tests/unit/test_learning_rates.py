"""Unit: the centre LoRA learning rate of "auto" per model family and size (service.learning_rates),
the grid around it, and parameter counts from config.json (real shapes, no weights)."""

from __future__ import annotations

import json
import math

import pytest

from service.api.openai_compat.create import search_space
from service.api.openai_compat.schemas import Hyperparameters
from service.core.registry import BaseModelEntry
from service.learning_rates import (
    auto_learning_rates,
    calibration,
    centre_learning_rate,
    model_centre,
    parameter_count,
)
from service.schemas import TaskCreate
from service.tasks import resolve_auto

# config.json shapes of public checkpoints (the fields parameter_count reads)
LLAMA_31_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
               "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
               "vocab_size": 128256, "tie_word_embeddings": False}
LLAMA_32_1B = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
               "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8,
               "vocab_size": 128256, "tie_word_embeddings": True}
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
            "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False}
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
             "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
             "vocab_size": 152064, "tie_word_embeddings": False}


@pytest.mark.parametrize(("config", "billions"), [
    (LLAMA_31_8B, 8.03), (LLAMA_32_1B, 1.24), (QWEN3_8B, 8.19), (QWEN25_7B, 7.62)])
def test_parameter_count_from_config(config: dict, billions: float) -> None:
    assert parameter_count(config) / 1e9 == pytest.approx(billions, abs=0.02)


def test_parameter_count_of_an_ungated_mlp_and_a_partial_config() -> None:
    gated = parameter_count({**LLAMA_31_8B, "model_type": "llama"})
    ungated = parameter_count({**LLAMA_31_8B, "model_type": "nemotron"})  # up/down only
    assert gated - ungated == 32 * 4096 * 14336
    assert parameter_count({"model_type": "llama"}) is None


@pytest.mark.parametrize(("family", "params", "centre"), [
    ("llama", 1.24e9, 1e-3),  # LoRA Without Regret: 1-4B
    ("llama", 3.2e9, 1e-3),
    ("llama", 8.03e9, 3e-4),  # Llama-3.1-8B
    ("llama", 70e9, 1e-4),
    ("qwen3", 8.19e9, 1e-3),  # Qwen3-8B
    ("qwen3", 4e9, 1e-3),
    ("qwen2", 8e9, 5e-4),  # generic 7-8B
    ("mistral", 1e6, 1e-3),  # below the table: flat
    ("gemma2", 1e12, 1e-4),  # above the table: flat
    (None, None, 5e-4),  # unknown size: the default 8B
])
def test_centre_per_family_and_size(family: str | None, params: float | None,
                                    centre: float) -> None:
    assert centre_learning_rate(family, params) == pytest.approx(centre, rel=0.03)


def test_centre_interpolates_on_log_parameters() -> None:
    # halfway between 8B (5e-4) and 70B (1e-4) on log(params) is the geometric mean of the rates
    mid = math.sqrt(8e9 * 70e9)
    assert centre_learning_rate("qwen2", mid) == pytest.approx(math.sqrt(5e-4 * 1e-4))
    rates = [centre_learning_rate("llama", n) for n in (1e9, 2e9, 4e9, 6e9, 8e9, 20e9, 70e9)]
    assert rates == sorted(rates, reverse=True)  # never rises with size


def test_family_points_replace_the_generic_ones_near_them() -> None:
    assert calibration("llama") == ((1e9, 1e-3), (4e9, 1e-3), (8e9, 3e-4), (70e9, 1e-4))
    assert calibration("qwen2") == calibration(None)


@pytest.mark.parametrize("centre", [1e-3, 3e-4, 1e-4, 5e-4])
def test_auto_grid_brackets_the_centre(centre: float) -> None:
    grid = auto_learning_rates(centre)
    assert len(grid) == 3 and grid == sorted(grid)
    assert grid[0] < centre < grid[-1] and centre in grid
    assert grid[-1] / grid[0] == pytest.approx(9, rel=0.03)  # two significant digits


def test_model_centre_reads_the_model_directory(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    assert model_centre(tmp_path) == pytest.approx(3e-4, rel=0.03)
    # unreadable config: the registry's family and size
    assert model_centre(tmp_path / "missing", "llama", 1_000_000) == 1e-3
    assert model_centre(None, "qwen3", 8_000_000_000) == pytest.approx(1e-3)


def test_openai_auto_is_the_native_auto_and_a_task_resolves_it(tmp_path) -> None:  # noqa: ANN001
    assert search_space("sft", Hyperparameters(), "hyperparameters")["learning_rate"] == "auto"
    assert search_space("sft", Hyperparameters(learning_rate="auto"), "h")["learning_rate"] == "auto"
    # an explicit multiplier stays one of 1e-4
    given = search_space("sft", Hyperparameters(learning_rate_multiplier=[1, 3]), "h")
    assert given["learning_rate"] == [1e-4, 3e-4]

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    registry = _Registry({"llama8b": BaseModelEntry(name="llama8b", path=str(tmp_path)),
                          "qwen3": BaseModelEntry(name="qwen3", path="/none", family="qwen3",
                                                  parameters=8_000_000_000)})

    def body(model: str, rates: object) -> TaskCreate:
        return TaskCreate(base_model=model, training_file="file_x",
                          search_space={"learning_rate": rates})

    assert resolve_auto(body("llama8b", "auto"), registry).search_space.learning_rate == [
        1e-4, 3e-4, 9e-4]
    assert resolve_auto(body("qwen3", "auto"), registry).search_space.learning_rate == [
        3.3e-4, 1e-3, 3e-3]
    fixed = body("qwen3", [1e-4])
    assert resolve_auto(fixed, registry) is fixed
    assert resolve_auto(body("nope", "auto"), registry).search_space.learning_rate == [
        1.7e-4, 5e-4, 1.5e-3]


class _Registry:
    def __init__(self, models: dict) -> None:
        self.models = models

    def get(self, name: str) -> BaseModelEntry | None:
        return self.models.get(name)
