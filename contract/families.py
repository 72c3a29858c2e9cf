"""Model-family knowledge in one table keyed by `config.model_type`: the linears LoRA may target
(fused projections included), the default targets, the decoder-layer path and the model's own
output head (Cohere's logit scale, Granite's logit division, Gemma-2's final soft-cap). Pure
stdlib, in the contract because both sides read it: the service to check a task's
`target_modules` at create (reading the registered model's config.json), the trainer to build,
shard and score the model exactly as the model itself does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
STARCODER2_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")
GLM_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
PHI_LINEARS = ("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2")
NEOX_LINEARS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
UP_DOWN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")  # no gate
GPTJ_LINEARS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out")
GPT_NEO_LINEARS = ("q_proj", "k_proj", "v_proj", "out_proj", "c_fc", "c_proj")
CODEGEN_LINEARS = ("qkv_proj", "out_proj", "fc_in", "fc_out")
GPT_BIGCODE_LINEARS = ("c_attn", "c_proj", "c_fc")  # c_proj: attention's output and MLP's down


@dataclass(frozen=True)
class Family:
    """How one model family is built, as far as LoRA training needs to know."""

    name: str
    linears: tuple[str, ...]  # every linear of a decoder layer that LoRA may adapt
    default_targets: tuple[str, ...]  # what a task adapts when it names none (all of them)
    layers_path: str = "model.layers"  # attribute path of the decoder layers' ModuleList
    logit_softcap_attr: str | None = None  # config attribute of the final logit soft-cap
    logit_scale_attr: str | None = None  # config attribute the logits are multiplied by
    logit_divisor_attr: str | None = None  # config attribute the logits are divided by


_LLAMA = Family("llama", LLAMA_LINEARS, LLAMA_LINEARS)
FAMILIES: dict[str, Family] = {
    "llama": _LLAMA,
    "mistral": Family("mistral", LLAMA_LINEARS, LLAMA_LINEARS),
    "qwen2": Family("qwen2", LLAMA_LINEARS, LLAMA_LINEARS),
    "qwen3": Family("qwen3", LLAMA_LINEARS, LLAMA_LINEARS),
    "gemma": Family("gemma", LLAMA_LINEARS, LLAMA_LINEARS),
    # Gemma-2 caps its final logits: cap * tanh(logits / cap) (config.final_logit_softcapping)
    "gemma2": Family("gemma2", LLAMA_LINEARS, LLAMA_LINEARS,
                     logit_softcap_attr="final_logit_softcapping"),
    # Phi-3 fuses q/k/v into qkv_proj and gate/up into gate_up_proj
    "phi3": Family("phi3", PHI3_LINEARS, PHI3_LINEARS),
    # Gemma-3 has the soft-cap setting too (its checkpoints leave it unset)
    "gemma3_text": Family("gemma3_text", LLAMA_LINEARS, LLAMA_LINEARS,
                          logit_softcap_attr="final_logit_softcapping"),
    "olmo": Family("olmo", LLAMA_LINEARS, LLAMA_LINEARS),
    "olmo2": Family("olmo2", LLAMA_LINEARS, LLAMA_LINEARS),
    # Granite divides its logits by config.logits_scaling
    "granite": Family("granite", LLAMA_LINEARS, LLAMA_LINEARS, logit_divisor_attr="logits_scaling"),
    # Cohere (Command-R) multiplies its logits by config.logit_scale
    "cohere": Family("cohere", LLAMA_LINEARS, LLAMA_LINEARS, logit_scale_attr="logit_scale"),
    "helium": Family("helium", LLAMA_LINEARS, LLAMA_LINEARS),
    "smollm3": Family("smollm3", LLAMA_LINEARS, LLAMA_LINEARS),
    # StarCoder2's MLP is c_fc -> GELU -> c_proj
    "starcoder2": Family("starcoder2", STARCODER2_LINEARS, STARCODER2_LINEARS),
    # GLM-4 fuses gate/up into gate_up_proj (q/k/v stay apart)
    "glm": Family("glm", GLM_LINEARS, GLM_LINEARS),
    # Phi-1/Phi-2: attention output `dense`, MLP fc1 -> fc2
    "phi": Family("phi", PHI_LINEARS, PHI_LINEARS),
    # GPT-NeoX (Pythia): fused query_key_value, layers under gpt_neox
    "gpt_neox": Family("gpt_neox", NEOX_LINEARS, NEOX_LINEARS, layers_path="gpt_neox.layers"),
    "olmo3": Family("olmo3", LLAMA_LINEARS, LLAMA_LINEARS),
    # Command-R7B / Command-A multiply their logits like Cohere
    "cohere2": Family("cohere2", LLAMA_LINEARS, LLAMA_LINEARS, logit_scale_attr="logit_scale"),
    "glm4": Family("glm4", GLM_LINEARS, GLM_LINEARS),
    "exaone4": Family("exaone4", LLAMA_LINEARS, LLAMA_LINEARS),
    "ministral": Family("ministral", LLAMA_LINEARS, LLAMA_LINEARS),
    # Arcee (AFM) and Apertus: an MLP without a gate (up_proj -> activation -> down_proj)
    "arcee": Family("arcee", UP_DOWN_LINEARS, UP_DOWN_LINEARS),
    "apertus": Family("apertus", UP_DOWN_LINEARS, UP_DOWN_LINEARS),
    "hunyuan_v1_dense": Family("hunyuan_v1_dense", LLAMA_LINEARS, LLAMA_LINEARS),
    "ernie4_5": Family("ernie4_5", LLAMA_LINEARS, LLAMA_LINEARS),
    # VaultGemma soft-caps its final logits like Gemma-2
    "vaultgemma": Family("vaultgemma", LLAMA_LINEARS, LLAMA_LINEARS,
                         logit_softcap_attr="final_logit_softcapping"),
    # Persimmon (Fuyu's decoder) names its linears like GPT-NeoX
    "persimmon": Family("persimmon", NEOX_LINEARS, NEOX_LINEARS),
    # the GPT-2-era layouts: decoder layers at transformer.h
    "gptj": Family("gptj", GPTJ_LINEARS, GPTJ_LINEARS, layers_path="transformer.h"),
    "gpt_neo": Family("gpt_neo", GPT_NEO_LINEARS, GPT_NEO_LINEARS, layers_path="transformer.h"),
    # CodeGen fuses q/k/v into qkv_proj
    "codegen": Family("codegen", CODEGEN_LINEARS, CODEGEN_LINEARS, layers_path="transformer.h"),
    # GPTBigCode (StarCoder-1, SantaCoder): multi-query q/k/v fused into c_attn; `c_proj` names
    # both the attention's output and the MLP's down projection (a target adapts both)
    "gpt_bigcode": Family("gpt_bigcode", GPT_BIGCODE_LINEARS, GPT_BIGCODE_LINEARS,
                          layers_path="transformer.h"),
    "seed_oss": Family("seed_oss", LLAMA_LINEARS, LLAMA_LINEARS),
    # StableLM and Nemotron (an MLP without a gate): their decoder layers drop the varlen bounds
    # but pass the position ids, from which trainer.varlen reads them
    "stablelm": Family("stablelm", LLAMA_LINEARS, LLAMA_LINEARS),
    "nemotron": Family("nemotron", UP_DOWN_LINEARS, UP_DOWN_LINEARS),
}
# Not listed: OPT, Falcon, MPT and XGLM (their decoders build the attention mask without the
# position ids, so sequences the engine packs into one row would attend across their bounds),
# BLOOM (its ALiBi bias grows with the position in the whole row, not the sequence, and is cast
# to the model's dtype: packed sequences lose precision; 1e-4 off in float32 on the tiny model,
# far more in bfloat16), GPT-2-style Conv1D projections (the multi-LoRA layers replace nn.Linear)
# and mixture-of-experts models (expert weights are not per-layer linears). StableLM and Nemotron
# are in since trainer.varlen reads the sequence bounds their layers drop from the position ids
# they pass; GPTBigCode and Seed-OSS since the engine turns the backbone's dropout off.


class UnsupportedModel(ValueError):
    """The model's family is not in the table, or a target does not exist in it."""


def family_of(model_type: str | None) -> Family:
    """The family of a `config.model_type`; UnsupportedModel for one the table lacks."""
    family = FAMILIES.get(model_type or "")
    if family is None:
        known = ", ".join(sorted(FAMILIES))
        what = f"model type {model_type!r}" if model_type else "a model without a model_type"
        raise UnsupportedModel(f"{what} is not supported (supported: {known})")
    return family


def model_type_of(model_dir: str | Path) -> str | None:
    """`model_type` from a local model directory's config.json (None when unreadable)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def resolve_targets(family: Family, targets: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """The target linears of a task: its own (each must exist in the family), else the
    family's defaults. Raises UnsupportedModel naming the unknown ones."""
    if not targets:
        return family.default_targets
    unknown = [t for t in targets if t not in family.linears]
    if unknown:
        raise UnsupportedModel(
            f"target_modules {unknown} do not exist in {family.name} models "
            f"(choose from {', '.join(family.linears)})")
    return tuple(dict.fromkeys(targets))  # unique, in the task's order
