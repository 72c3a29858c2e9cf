"""Unit: service.init_adapter's checks of an uploaded adapter against a registered base model:
the lenient name match, the module features from the model's safetensors headers (a bare
decoder's names too) or from its config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.adapter_archive import AdapterInfo
from service.core.errors import ApiError
from service.core.registry import BaseModelEntry
from service.init_adapter import base_linears, check_against_model

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

CONFIG = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 2,
          "num_key_value_heads": 1, "intermediate_size": 32, "num_hidden_layers": 2}


def _info(base: str | None = "org/Tiny-Llama", layers: int = 2, dim: int = 16) -> AdapterInfo:
    modules = tuple(f"base_model.model.model.layers.{i}.self_attn.{t}"
                    for i in range(layers) for t in ("q_proj", "k_proj"))
    return AdapterInfo(rank=4, alpha=8.0, target_modules=("k_proj", "q_proj"), base_model=base,
                       dtype="F32", shapes={"q_proj": (dim, 16), "k_proj": (dim, 8)},
                       layers=layers, modules=modules)


def _model(tmp_path: Path, weights: str | None = "model.") -> BaseModelEntry:
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    if weights is not None:
        (d / "model.safetensors").write_bytes(safetensors_torch.save({
            f"{weights}layers.{i}.self_attn.{t}.weight": torch.zeros(out, 16)
            for i in range(2) for t, out in (("q_proj", 16), ("k_proj", 8))}))
    return BaseModelEntry(name="tiny", path=str(d), family="llama")


@pytest.mark.parametrize("weights", ["model.", "", None])
def test_a_fitting_adapter_passes(tmp_path: Path, weights: str | None) -> None:
    model = _model(tmp_path, weights)
    assert (base_linears(model.path).exact is None) == (weights is None)
    for base in ("org/Tiny-Llama", str(tmp_path / "tiny-llama") + "/", "TINY", None):
        check_against_model(_info(base), model)


@pytest.mark.parametrize("weights", ["model.", None])
@pytest.mark.parametrize("info,needle", [
    (_info(base="org/Other-Model"), "other-model"),
    (_info(layers=3), "layers.2"),
    (_info(dim=32), "features"),
])
def test_an_adapter_that_does_not_fit_is_a_422(tmp_path: Path, weights: str | None,
                                               info: AdapterInfo, needle: str) -> None:
    with pytest.raises(ApiError) as exc:
        check_against_model(info, _model(tmp_path, weights))
    assert exc.value.status == 422 and exc.value.param == "init_adapter_file"
    assert needle in exc.value.message


def test_a_model_the_api_cannot_read_is_left_to_the_trainer(tmp_path: Path) -> None:
    nowhere = BaseModelEntry(name="tiny", path=str(tmp_path / "nope"), family="llama")
    check_against_model(_info(base=None, dim=32), nowhere)
