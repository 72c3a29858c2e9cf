"""Unit: an exported adapter is portable. adapter_config.json names the base model, never a server
path, and holds only fields that PEFT, vLLM and LoRAX accept (vLLM's documented rules: r,
lora_alpha and target_modules given; no modules_to_save, no DoRA, no bias; LoRA on the decoder's
linears only, not lm_head or the embeddings); PEFT loads it onto the tiny model and it changes the
logits exactly as the weights say; the service's normalisation agrees with the trainer's."""

from __future__ import annotations

import json

import pytest
import torch

from service.adapters import PORTABLE_FIELDS, portable_config
from tests.helpers.engine_ref import tiny_model_dir
from trainer.export import export_peft, model_label, peft_config_dict
from trainer.multilora import JobAdapter

TARGETS = ["q_proj", "v_proj", "down_proj"]


def vllm_rejects(cfg: dict) -> list[str]:
    """Why vLLM's LoRA loader (PEFTHelper + its supported-module check) would refuse cfg."""
    why = [f"missing {k}" for k in ("r", "lora_alpha", "target_modules") if k not in cfg]
    if cfg.get("modules_to_save"):
        why.append("modules_to_save must be None")
    if cfg.get("use_dora"):
        why.append("DoRA")
    if cfg.get("bias", "none") != "none":
        why.append("bias needs bias_enabled")
    if {"lm_head", "embed_tokens"} & set(cfg.get("target_modules") or []):
        why.append("lm_head / embeddings are not LoRA modules")
    return why


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN201
    return tiny_model_dir("llama", tmp_path_factory.mktemp("export"))


def _adapter(model_dir, rank: int = 4, alpha: float = 8.0, rslora: bool = False):  # noqa: ANN001, ANN202
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shapes = {name: (mod.in_features, mod.out_features) for name, mod in base.named_modules()
              if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS}
    adapter = JobAdapter(shapes, rank, alpha, seed=3, use_rslora=rslora)
    with torch.no_grad():  # a trained-looking B (PEFT's init leaves it 0)
        adapter.flat.copy_(torch.randn(adapter.flat.shape, generator=torch.Generator().manual_seed(5))
                           * 0.05)
    return base, adapter


def test_exported_config_is_portable_and_names_no_path(model_dir, tmp_path) -> None:  # noqa: ANN001
    _, adapter = _adapter(model_dir)
    out = export_peft(adapter, tmp_path / "a", TARGETS, str(model_dir.resolve()))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == model_dir.name and "/" not in json.dumps(cfg)
    assert set(cfg) <= set(PORTABLE_FIELDS) and "use_dora" not in cfg and "use_rslora" not in cfg
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and isinstance(cfg["lora_alpha"], int)
    assert cfg["target_modules"] == sorted(TARGETS) and cfg["modules_to_save"] is None
    assert vllm_rejects(cfg) == []
    # the service's normalisation (what a tenant downloads) leaves it as it is, but the name
    assert portable_config(cfg, model_dir.name) == cfg
    assert portable_config(cfg, "tiny-llama")["base_model_name_or_path"] == "tiny-llama"
    assert model_label("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"  # a hub-style name
    rs = peft_config_dict(_adapter(model_dir, rslora=True)[1], TARGETS, "m")
    assert rs["use_rslora"] is True and vllm_rejects(rs) == []
    with pytest.raises(ValueError, match="lm_head"):
        peft_config_dict(adapter, [*TARGETS, "lm_head"], "m")


def test_peft_loads_the_export_and_applies_its_weights(model_dir, tmp_path) -> None:  # noqa: ANN001
    from peft import PeftConfig, PeftModel

    base, adapter = _adapter(model_dir, rank=4, alpha=8.0)
    out = export_peft(adapter, tmp_path / "a", TARGETS, str(model_dir))
    assert PeftConfig.from_pretrained(str(out)).r == 4
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        plain = base(input_ids=ids).logits
    model = PeftModel.from_pretrained(base, str(out)).eval()
    loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    mine = adapter.peft_state_dict()
    assert set(loaded) == set(mine) and len(mine) == 2 * sum(
        1 for n in adapter.names if n.rsplit(".", 1)[-1] in TARGETS)
    for k, v in mine.items():
        torch.testing.assert_close(loaded[k], v)
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        merged = model.merge_and_unload()(input_ids=ids).logits
    assert (adapted - plain).abs().max() > 1e-4
    torch.testing.assert_close(adapted, merged, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("bad", "why"), [
    ({"use_dora": True}, "DoRA"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"), ({"bias": "all"}, "bias"),
    ({"r": 0}, "r must"), ({"lora_alpha": "8"}, "lora_alpha"), ({"peft_type": "IA3"}, "LORA"),
    ({"target_modules": "all-linear"}, "target_modules"), ({"lora_dropout": 2}, "lora_dropout"),
])
def test_service_refuses_unportable_configs(bad: dict, why: str) -> None:
    good = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    with pytest.raises(ValueError, match=why):
        portable_config(good | bad, "m")


def test_service_drops_unknown_and_path_fields() -> None:
    raw = {"peft_type": "LORA", "r": 8, "lora_alpha": 16.0, "target_modules": ["v_proj", "q_proj"],
           "base_model_name_or_path": "/srv/models/llama", "revision": None,
           "megatron_config": None, "layers_pattern": None, "alpha_pattern": {},
           "use_dora": False, "use_rslora": False, "auto_mapping": {"base_model_class": "X"}}
    cfg = portable_config(raw, "llama-3-8b")
    assert cfg == {"peft_type": "LORA", "task_type": "CAUSAL_LM",
                   "base_model_name_or_path": "llama-3-8b", "r": 8, "lora_alpha": 16,
                   "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
                   "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": None,
                   "inference_mode": True}
    assert vllm_rejects(cfg) == []
