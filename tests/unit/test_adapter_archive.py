"""Uploaded adapter archives: layout, config, safetensors header and rank/target/shape
consistency, read without loading a tensor."""

import io
import json
import tarfile
import zipfile

import pytest
import torch
from safetensors.torch import save

from service.adapter_archive import AdapterError, inspect_bytes


def _weights(r=4, layers=2, targets=("q_proj", "v_proj"), dim=16, dtype=torch.float32,
             bad_rank=False):
    out = {}
    for i in range(layers):
        for t in targets:
            base = f"base_model.model.model.layers.{i}.self_attn.{t}"
            out[f"{base}.lora_A.weight"] = torch.zeros(r, dim, dtype=dtype)
            out[f"{base}.lora_B.weight"] = torch.zeros(dim, r + (1 if bad_rank else 0),
                                                       dtype=dtype)
    return save(out)


def _config(r=4, targets=("q_proj", "v_proj"), **extra):
    return json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 8,
                       "target_modules": list(targets),
                       "base_model_name_or_path": "tiny", **extra}).encode()


def _tar(files, folder=""):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(folder + name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _zip(files):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _files(**kw):
    return {"adapter_config.json": _config(), "adapter_model.safetensors": _weights(), **kw}


@pytest.mark.parametrize("pack", [_tar, lambda f: _tar(f, "adapter/"), _zip])
def test_good_archive_described(pack):
    info = inspect_bytes(pack(_files()))
    assert info.rank == 4 and info.alpha == 8.0
    assert info.target_modules == ("q_proj", "v_proj")
    assert info.shapes == {"q_proj": (16, 16), "v_proj": (16, 16)}
    assert info.layers == 2 and info.dtype == "F32" and info.base_model == "tiny"


@pytest.mark.parametrize("blob, words", [
    (b"not an archive", "not a .tar.gz or .zip"),
    (b"\x1f\x8b garbage", "unreadable archive"),
    (_tar({"adapter_config.json": _config()}), "no adapter_model.safetensors"),
    (_tar(_files(**{"adapter_config.json": b"{nope"})), "not valid JSON"),
    (_tar(_files(**{"adapter_config.json": _config(r=0)})), "r must be"),
    (_tar(_files(**{"adapter_config.json": _config(peft_type="IA3")})), "not LORA"),
    (_tar(_files(**{"adapter_model.safetensors": b"\xff" * 16})), "past the file's end"),
    (_tar(_files(**{"adapter_model.safetensors": _weights(bad_rank=True)})), "rank"),
    (_tar(_files(**{"adapter_config.json": _config(targets=("q_proj",))})),
     "not in target_modules"),
    (_tar(_files(**{"adapter_config.json": _config(targets=("q_proj", "v_proj", "o_proj"))})),
     "no weights for target_modules"),
    (_tar(_files(**{"adapter_model.safetensors": _weights(dtype=torch.int8)})), "dtype"),
])
def test_bad_archive_rejected(blob, words):
    with pytest.raises(AdapterError, match=words):
        inspect_bytes(blob)


def test_a_layer_is_counted_once_whether_its_modules_are_attention_or_mlp():
    out = {}
    for i in range(2):
        for path in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"):
            base = f"base_model.model.model.layers.{i}.{path}"
            out[f"{base}.lora_A.weight"] = torch.zeros(4, 16)
            out[f"{base}.lora_B.weight"] = torch.zeros(16, 4)
    info = inspect_bytes(_tar(_files(**{
        "adapter_config.json": _config(targets=("q_proj", "v_proj", "up_proj")),
        "adapter_model.safetensors": save(out)})))
    assert info.layers == 2 and len(info.modules) == 6
