"""Every supported model family (contract.families) on its tiny model (trainer.tiny): the engine's
loss is the model's own loss (a PEFT model of the same adapter through the model's own forward),
the exported adapter loads whole into PEFT and adapts every targeted projection of every layer,
and a target the family lacks is refused by name."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from contract.families import FAMILIES as SUPPORTED
from contract.families import Family, UnsupportedModel, family_of, resolve_targets
from tests.helpers.engine_ref import synthetic_rows
from trainer.data import IGNORE, Example, parse_record, tokenize_all
from trainer.engine import MultiLoraEngine
from trainer.export import export_peft, load_peft_weights
from trainer.jobs import TrainJob
from trainer.multilora import inject_multilora
from trainer.packing import pack_step
from trainer.parallel_engine import decoder_layers as sharded_layers
from trainer.tiny import FAMILIES, make_tiny_model

pytest.importorskip("peft")

REL = 1e-5  # float32 forward, float64 sums: the two losses agree to ~1e-7 in practice


@dataclass
class Trained:
    """One family's tiny model, an engine with one job trained a few steps (B != 0), the job's
    exported adapter and held-out examples."""

    family: Family
    model_dir: Path
    engine: MultiLoraEngine
    adapter_dir: Path
    val: list[Example]
    pad_id: int


def base_model(model_dir: Path, **overrides):  # noqa: ANN003, ANN201
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **overrides)
    if getattr(model.config, "attn_logit_softcapping", None):
        # Gemma-2's attention soft-cap: older transformers' default SDPA drops it silently
        model.set_attn_implementation("eager")
    return model


def peft_of(t: Trained):  # noqa: ANN201
    from peft import PeftModel

    return PeftModel.from_pretrained(base_model(t.model_dir), t.adapter_dir)


def load_whole(model_dir: Path, adapter_dir: Path):  # noqa: ANN201
    """The adapter loaded by PeftModel.from_pretrained, once PEFT's own loading showed that it
    uses every key of the file and leaves none of the model's LoRA weights unset."""
    from peft import (
        LoraConfig,
        PeftModel,
        get_peft_model,
        get_peft_model_state_dict,
        set_peft_model_state_dict,
    )

    saved = load_peft_weights(adapter_dir)
    fresh = get_peft_model(base_model(model_dir), LoraConfig.from_pretrained(str(adapter_dir)))
    result = set_peft_model_state_dict(fresh, saved)
    assert not [k for k in result.missing_keys if "lora_" in k], result.missing_keys
    assert not result.unexpected_keys, result.unexpected_keys
    model = PeftModel.from_pretrained(base_model(model_dir), adapter_dir)
    loaded = get_peft_model_state_dict(model)
    assert set(loaded) == set(saved)
    for k, v in saved.items():
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=0)
    return model


@torch.no_grad()
def own_loss(model, examples: list[Example]) -> float:  # noqa: ANN001
    """Token mean of the model's own loss (its forward with labels: shift, head, soft-cap, CE)
    over every target token of the examples, each example one plain unpadded row."""
    model.eval()
    total, count = 0.0, 0
    for ex in examples:
        labels = torch.tensor([ex.labels])
        n = int((labels[:, 1:] != IGNORE).sum())
        loss = model(input_ids=torch.tensor([ex.input_ids]), labels=labels, use_cache=False).loss
        total, count = total + float(loss) * n, count + n
    return total / count


def decoder_layers(model, family: Family) -> torch.nn.ModuleList:  # noqa: ANN001
    return functools.reduce(getattr, family.layers_path.split("."), model)


def lora_keys(model, family: Family, targets) -> set[str]:  # noqa: ANN001
    """PEFT's saved key names of an adapter of `targets` on every decoder layer of `model`
    (lora_A and lora_B of each targeted projection; every target is in every layer, and a name
    two projections of a layer share, GPTBigCode's c_proj, targets both)."""
    layers = decoder_layers(model, family)
    assert len(layers) == model.config.num_hidden_layers
    projections = []
    for i, layer in enumerate(layers):
        own = [name for name, m in layer.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets]
        assert {name.rsplit(".", 1)[-1] for name in own} == set(targets)
        projections += [f"{family.layers_path}.{i}.{name}" for name in own]
    return {f"base_model.model.{p}.lora_{ab}.weight" for p in projections for ab in "AB"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_tiny_model(request.param, root / "model", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # 14 to 47 tokens: most longer than the tiny Mistral's and Gemma-2's sliding windows (16)
    examples = tokenize_all(tokenizer, [parse_record(r) for r in synthetic_rows(24, seed=3)], 64)
    engine = MultiLoraEngine(base_model(model_dir), examples[:16], tokenizer.pad_token_id)
    engine.attach(TrainJob("job", lora_rank=4, lora_alpha=8.0, learning_rate=3e-2, batch_size=4, max_steps=3, seed=0))
    for _ in range(3):
        engine.step()
    adapter_dir = export_peft(engine.jobs["job"].adapter, root / "adapter", list(engine.targets),
                              str(model_dir))
    return Trained(engine.family, model_dir, engine, adapter_dir, examples[16:],
                   tokenizer.pad_token_id)


def test_engine_loss_is_the_models_own_loss(trained: Trained) -> None:
    assert trained.engine.family.name == trained.family.name == json.loads(
        (trained.model_dir / "config.json").read_text())["model_type"]
    # evaluation packs several sequences into a row (position ids restart per sequence); the
    # reference runs each example alone: the packed forward must not change a single number
    assert pack_step([trained.val[:4]], trained.pad_id).input_ids.shape[0] < 4
    got = trained.engine.evaluate(trained.val, batch_size=4)["job"]
    want = own_loss(peft_of(trained), trained.val)
    assert got == pytest.approx(want, rel=REL)
    # the adapter moves the loss by far more than the tolerance: the comparison sees it
    base = own_loss(base_model(trained.model_dir), trained.val)
    assert abs(want - base) > 1e2 * REL * base, (want, base)


# the families whose forward changes the LM head's logits, and what it does to them
OUTPUT_HEADS = {"gemma2": ("logit_softcap_attr", 3.0), "granite": ("logit_divisor_attr", 8.0),
                "cohere": ("logit_scale_attr", 0.25)}


@pytest.mark.parametrize("trained", list(OUTPUT_HEADS), indirect=True)
def test_loss_needs_the_familys_own_output_head(trained: Trained) -> None:
    """Without Gemma-2's final logit soft-cap, Granite's logit division or Cohere's logit scale
    the engine's loss is off the model's own loss by far more than the tolerance: the comparison
    above would catch a missing one."""
    engine, family = trained.engine, trained.engine.family
    attr, value = OUTPUT_HEADS[family.name]
    assert getattr(engine.model.config, getattr(family, attr)) == value
    want = own_loss(peft_of(trained), trained.val)
    cap = engine.logit_softcap
    try:
        engine.family, engine.logit_softcap = dataclasses.replace(family, **{attr: None}), None
        plain = engine.evaluate(trained.val, batch_size=4)["job"]
    finally:
        engine.family, engine.logit_softcap = family, cap
    assert abs(plain - want) > 1e3 * REL * want, (plain, want)
    assert engine.evaluate(trained.val, batch_size=4)["job"] == pytest.approx(want, rel=REL)


ALL_GLOBAL = {"layer_types": ["full_attention"] * 2}
NO_WINDOW = {"mistral": {"sliding_window": None}, "starcoder2": {"sliding_window": None},
             "gemma2": ALL_GLOBAL, "gemma3_text": ALL_GLOBAL, "olmo3": ALL_GLOBAL,
             "cohere2": ALL_GLOBAL, "exaone4": ALL_GLOBAL, "ministral": ALL_GLOBAL,
             "vaultgemma": ALL_GLOBAL, "gpt_neo": {"attention_layers": ["global"] * 2}}


@pytest.mark.parametrize("trained", list(NO_WINDOW), indirect=True)
def test_sliding_window_is_shorter_than_the_examples(trained: Trained) -> None:
    """The tiny Mistral's, StarCoder2's, Gemma-2's and Gemma-3's sliding windows change their own
    loss on these examples,
    so the engine's packed forward reproduces a window that matters (not a no-op)."""
    assert max(len(e.input_ids) for e in trained.val) > 16
    windowed = own_loss(base_model(trained.model_dir), trained.val)
    full = own_loss(base_model(trained.model_dir, **NO_WINDOW[trained.family.name]), trained.val)
    assert abs(windowed - full) > 1e2 * REL * full, (windowed, full)


def test_varlen_packing_gives_the_rows_loss(trained: Trained) -> None:
    """The one-GPU default packs every sequence into one row and hands their bounds to the varlen
    attention through the model's keyword arguments (StableLM's and Nemotron's layers drop them
    and the attention reads them from the position ids): a family whose attention got neither
    would attend across sequences; here its loss would differ from the rows loss (which
    the test above holds to the model's own, sliding windows and soft-caps included)."""
    engine = trained.engine
    rows = engine.evaluate(trained.val, batch_size=4)["job"]
    try:
        engine.set_attention("varlen")
        assert engine.pack_batch([trained.val[:4]]).input_ids.shape[0] == 1
        varlen = engine.evaluate(trained.val, batch_size=4)["job"]
    finally:
        engine.set_attention("rows")
    assert varlen == pytest.approx(rows, rel=REL)


def test_exported_adapter_loads_whole_and_adapts_every_target(trained: Trained) -> None:
    family = trained.family
    cfg = json.loads((trained.adapter_dir / "adapter_config.json").read_text())
    assert cfg["target_modules"] == sorted(family.default_targets)
    saved = load_peft_weights(trained.adapter_dir)
    # every targeted projection of every decoder layer, by its full module name
    assert set(saved) == lora_keys(base_model(trained.model_dir), family, family.default_targets)
    assert all(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)
    load_whole(trained.model_dir, trained.adapter_dir)


def test_family_table_names_the_models_own_linears(trained: Trained) -> None:
    """The table's linears are exactly the Linear modules of the family's decoder layers (in
    transformers as installed): a renamed or fused projection shows up here first."""
    model = base_model(trained.model_dir)
    layers = decoder_layers(model, trained.family)
    # adapter parallelism shards the same layers (each one an FSDP unit)
    assert sharded_layers(model) is layers
    names = {name.rsplit(".", 1)[-1] for layer in layers for name, m in layer.named_modules()
             if isinstance(m, torch.nn.Linear)}
    assert names == set(trained.family.linears)
    assert set(trained.family.default_targets) <= names


def test_a_target_the_family_lacks_is_refused_by_name(trained: Trained) -> None:
    family = trained.family
    # a projection of another family (a fused one where this family splits it, and back)
    unknown = "q_proj" if "q_proj" not in family.linears else "qkv_proj"
    assert unknown not in family.linears
    known = family.linears[-1]
    with pytest.raises(UnsupportedModel, match=unknown) as refused:
        MultiLoraEngine(base_model(trained.model_dir), trained.val, trained.pad_id,
                        targets=(unknown, known))
    assert known not in str(refused.value).split("(choose from")[0]
    # the model surgery refuses it too, whatever the table says: never a silent subset
    with pytest.raises(ValueError, match=unknown):
        inject_multilora(base_model(trained.model_dir), [unknown, known])


def test_every_supported_family_has_a_tiny_model() -> None:
    assert set(FAMILIES) == set(SUPPORTED)
    for name in FAMILIES:
        assert family_of(name).name == name


def test_default_targets_are_every_linear_attention_and_mlp() -> None:
    """A task that names no target_modules (or the OpenAI surface, always) adapts every linear
    projection of its family: attention and MLP alike (LoRA Without Regret: MLP layers matter)."""
    for name, family in SUPPORTED.items():
        assert family.default_targets == family.linears, name
        assert resolve_targets(family, None) == family.linears, name
        assert len(family.linears) >= 3, name  # at least an attention and an MLP projection
    assert set(family_of("llama").default_targets) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_backbone_dropout_is_off_so_varlen_trains_and_steps_repeat(tmp_path: Path) -> None:
    """A checkpoint that ships dropout (StarCoder2's attention, residual and embedding dropout
    0.1) trains with the backbone's dropout off: the varlen attention (which has none) takes
    it, and the same step from the same state gives the same loss whatever RNG state it meets."""
    from transformers import AutoTokenizer

    model_dir = make_tiny_model("starcoder2", tmp_path / "model", seed=1)
    drop = {"attention_dropout": 0.1, "residual_dropout": 0.1, "embedding_dropout": 0.1}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = tokenize_all(tokenizer, [parse_record(r) for r in synthetic_rows(8, seed=3)], 64)
    losses = []
    for rng_seed in (0, 1):
        model = base_model(model_dir, **drop)
        assert model.config.attention_dropout == 0.1
        engine = MultiLoraEngine(model, examples, tokenizer.pad_token_id, attention="varlen")
        assert model.training and model.config.attention_dropout == 0.0
        assert not [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        engine.attach(TrainJob("job", lora_rank=4, lora_alpha=8.0, learning_rate=3e-2, batch_size=4, max_steps=2,
                              seed=0))
        torch.manual_seed(rng_seed)  # dropout would draw different masks from these
        losses.append([engine.step().losses["job"] for _ in range(2)])
    assert losses[0] == losses[1]
