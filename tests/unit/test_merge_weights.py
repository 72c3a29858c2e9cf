"""Unit: a merged model (service.merged.weights) is the base with its adapter folded in. For
several families its logits equal PEFT's PeftModel on the same base within bf16 tolerance, it is
saved in the base's dtype as sharded safetensors with the config and tokenizer files, and
transformers loads it as a plain model (no PEFT). An adapter that does not fit is a MergeError
with a message fit for the tenant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from contract.families import family_of  # noqa: E402
from service.merged.weights import MergeError, merge_adapter  # noqa: E402
from trainer.tiny import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _base(family: str, root: Path, dtype: torch.dtype) -> Path:
    out = make_tiny_model(family, root / f"base-{family}")
    if dtype != torch.float32:
        AutoModelForCausalLM.from_pretrained(out, dtype=dtype).save_pretrained(out)
    return out


def _adapter(base_dir: Path, family: str, root: Path, targets: list[str] | None = None) -> Path:
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(1)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets or list(
        family_of(family).default_targets), init_lora_weights=False)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():  # B drawn as large as A: the adapter moves the logits well past bf16
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    out = root / f"adapter-{family}"
    peft_model.save_pretrained(out)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize(("family", "dtype"), [
    ("llama", torch.bfloat16), ("qwen2", torch.bfloat16), ("gemma2", torch.bfloat16),
    ("phi3", torch.bfloat16), ("qwen3", torch.float32)])
def test_merged_logits_equal_base_plus_adapter(tmp_path: Path, family: str,
                                               dtype: torch.dtype) -> None:
    base_dir = _base(family, tmp_path, dtype)
    adapter_dir = _adapter(base_dir, family, tmp_path)
    out = tmp_path / "merged"
    got = merge_adapter(base_dir, adapter_dir, out, max_shard_size="100KB")
    assert got == str(dtype).removeprefix("torch.")

    # sharded safetensors in the base's dtype, plain keys, config and tokenizer beside them
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    want = {torch.bfloat16: "BF16", torch.float32: "F32"}[dtype]
    for shard in shards:
        with safe_open(shard, "pt") as f:
            for key in f.keys():
                assert "lora" not in key and "base_model" not in key, key
                assert f.get_slice(key).get_dtype() == want, key
    assert not (out / "adapter_config.json").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == got
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == len(AutoTokenizer.from_pretrained(base_dir))

    ids = torch.randint(8, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out)
        assert merged.dtype == dtype and not hasattr(merged, "peft_config")
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto")
        plain = base(input_ids=ids).logits
        ref = PeftModel.from_pretrained(base, adapter_dir)(input_ids=ids).logits
        logits = merged(input_ids=ids).logits
        exact = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
            base_dir, dtype=torch.float32), adapter_dir)(input_ids=ids).logits
    # bf16: a few roundings of 2**-8 through two layers; fp32: the sum's order only
    tol = 4e-2 if dtype == torch.bfloat16 else 1e-4
    assert _rel(plain, ref) > 5 * tol  # the adapter matters
    assert _rel(logits, ref) < tol
    assert _rel(logits, exact) < tol  # as close to the float32 model as PEFT's own bf16 run
    if dtype == torch.bfloat16:  # no further from it than PEFT's own bf16 run, give or take
        assert _rel(logits, exact) < 2 * _rel(ref, exact)


def test_an_adapter_for_another_model_is_a_clear_error(tmp_path: Path) -> None:
    base_dir = _base("llama", tmp_path, torch.bfloat16)
    other = make_tiny_model("llama", tmp_path / "wide", hidden=96)
    adapter_dir = _adapter(other, "llama", tmp_path, ["q_proj"])
    with pytest.raises(MergeError) as err:
        merge_adapter(base_dir, adapter_dir, tmp_path / "out")
    assert str(tmp_path) not in str(err.value) and "does not fit" in str(err.value)
    assert not (tmp_path / "out").exists()
