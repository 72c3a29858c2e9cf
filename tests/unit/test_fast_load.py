"""Unit: the backbone read shard by shard in parallel (trainer.fast_load) is the model
`from_pretrained` gives, for every family's tiny model, one file or several shards; a checkpoint
that does not map name for name onto the model falls back (None)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer.fast_load import load_to_device, shard_files
from trainer.tiny import FAMILIES, make_tiny_model

FALLS_BACK = {"gpt_neox"}  # its checkpoint's names differ from its state dict's


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parallel_load_equals_from_pretrained(family: str, tmp_path) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(family, tmp_path / family, seed=3)
    want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    got = load_to_device(str(model_dir), torch.device("cpu"), torch.float32)
    if got is None:  # names that differ from the model's state: from_pretrained loads it instead
        assert family in FALLS_BACK
        return
    assert family not in FALLS_BACK
    ws, gs = want.state_dict(), got.state_dict()
    assert set(ws) == set(gs)
    for k in ws:
        torch.testing.assert_close(gs[k], ws[k], rtol=0, atol=0, msg=k)
    ids = torch.tensor([[1, 5, 9, 12, 3]])
    torch.testing.assert_close(got(ids).logits, want(ids).logits, rtol=0, atol=0)


def test_shards_are_read_in_parallel_and_a_foreign_checkpoint_falls_back(tmp_path) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model("llama", tmp_path / "m", seed=4)
    want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # split the checkpoint in three shards with an index, as large checkpoints come
    state = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    keys = sorted(state)
    weight_map = {}
    for i in range(3):
        part = {k: state[k].contiguous() for k in keys[i::3]}
        name = f"model-0000{i + 1}-of-00003.safetensors"
        save_file(part, str(model_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert len(shard_files(model_dir)) == 3
    got = load_to_device(str(model_dir), torch.device("cpu"), torch.float32, threads=3)
    assert got is not None
    for k, v in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[k], v, rtol=0, atol=0, msg=k)
    # a tensor the model does not have: not this loader's checkpoint
    save_file({"extra.weight": torch.zeros(2)}, str(model_dir / "model-00001-of-00003.safetensors"))
    weight_map = {k: v for k, v in weight_map.items() if v != "model-00001-of-00003.safetensors"}
    weight_map["extra.weight"] = "model-00001-of-00003.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert load_to_device(str(model_dir), torch.device("cpu"), torch.float32) is None


@pytest.mark.parametrize("stored, wanted", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                            (torch.bfloat16, torch.bfloat16)])
def test_chunked_staging_and_dtype_conversion_give_the_same_weights(stored, wanted, tmp_path) -> None:  # noqa: ANN001
    """Through the staging buffers in chunks much smaller than a tensor (the GPU's path, here on
    the CPU), and from a checkpoint stored in another dtype than the model's: the weights are
    from_pretrained's, bit for bit."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model("llama", tmp_path / "m", seed=4)
    if stored != torch.float32:  # rewrite the checkpoint in the stored dtype
        path = model_dir / "model.safetensors"
        save_file({k: v.to(stored).contiguous() for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=wanted)
    got = load_to_device(str(model_dir), torch.device("cpu"), wanted, threads=3, stage_bytes=1000, staged=True)
    assert got is not None
    ws, gs = want.state_dict(), got.state_dict()
    for k in ws:
        assert gs[k].dtype == wanted
        torch.testing.assert_close(gs[k], ws[k], rtol=0, atol=0, msg=k)
