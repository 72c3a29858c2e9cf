"""Unit: a registered model's parameters for GET /v1/models without loading weights (issue 43:
the quick start's demo model showed `parameters: null`): the models file's value, else the
safetensors headers' shapes (every shard, exact), else its config.json."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from service.core.registry import BaseModelEntry
from service.learning_rates import parameter_count
from service.model_size import model_parameters


def write_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 2
        for d in shape:
            size *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def entry(path: Path, parameters: int | None = None) -> BaseModelEntry:
    return BaseModelEntry(name="m", path=str(path), parameters=parameters)


def test_counted_from_every_shards_header(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors",
                      {"embed.weight": [100, 16], "norm.weight": [16]})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"layer.weight": [16, 32]})
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096}))
    assert model_parameters(entry(tmp_path)) == 100 * 16 + 16 + 16 * 32
    assert model_parameters(entry(tmp_path, parameters=7)) == 7  # the operator's value wins


def test_a_model_replaced_in_place_is_counted_again(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    write_safetensors(weights, {"w": [4, 4]})
    assert model_parameters(entry(tmp_path)) == 16
    write_safetensors(weights, {"w": [4, 8]})
    os.utime(weights, ns=(1, 1))
    assert model_parameters(entry(tmp_path)) == 32


def test_from_the_config_without_weights_and_none_without_either(tmp_path: Path) -> None:
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "vocab_size": 1000, "intermediate_size": 128, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_parameters(entry(tmp_path)) == parameter_count(config) > 0
    assert model_parameters(entry(tmp_path / "missing")) is None
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"\xff" * 4)
    assert model_parameters(entry(broken)) is None
