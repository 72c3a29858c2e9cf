"""Unit: trainer.export.save_safetensors writes files that safetensors' own readers (load_file and
safe_open) read back to the same tensors and metadata: every dtype an adapter or its bookkeeping
uses, 0-d and empty tensors, non-contiguous inputs, a dtype conversion on the way out; the header
keeps the data 8-byte aligned and each tensor aligned to its element size; short writes resume
where they stopped and writes split mid-file keep the order; a dtype without a safetensors name is
refused by name; write_peft writes a JobAdapter snapshot's views (PEFT loading them is tested in
test_export_portable)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from trainer.export import load_peft_weights, save_safetensors, write_peft
from trainer.multilora import JobAdapter

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random values of dtype (not zeros, so misplaced bytes show)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    lo, hi = (0, 255) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def read_header(path) -> tuple[int, dict]:  # noqa: ANN001
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8:8 + n])


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_reads_back_through_both_safetensors_readers(dtype, tmp_path) -> None:  # noqa: ANN001
    tensors = {
        "matrix": sample(dtype, (33, 7)),
        "scalar": sample(dtype, (), seed=1),
        "empty": sample(dtype, (0, 5)),
        "transposed": sample(dtype, (6, 9), seed=2).t(),  # non-contiguous
        "strided": sample(dtype, (40,), seed=3)[1::3],  # non-contiguous, storage offset
        "expanded": sample(dtype, (3, 1), seed=4).expand(3, 4),  # a stride of 0
    }
    assert not tensors["transposed"].is_contiguous() and not tensors["strided"].is_contiguous()
    path = save_safetensors(tensors, tmp_path / "t.safetensors", {"format": "pt", "step": "12"})
    assert_same(load_file(str(path)), tensors)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "step": "12"}
        assert_same({k: f.get_tensor(k) for k in f.keys()}, tensors)  # noqa: SIM118


def test_layout_is_aligned_contiguous_and_matches_the_file_size(tmp_path) -> None:  # noqa: ANN001
    tensors = {f"t{i}_{d}": sample(d, (i + 1, 3)) for i, d in enumerate(
        [torch.uint8, torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])}
    path = save_safetensors(tensors, tmp_path / "t.safetensors", {"k": "v"})
    n, header = read_header(path)
    assert n % 8 == 0 and header.pop("__metadata__") == {"k": "v"}
    spans = sorted((h["data_offsets"], name) for name, h in header.items())
    end = 0
    for (begin, stop), name in spans:
        assert begin == end, "tensors must be contiguous and non-overlapping"
        assert (8 + n + begin) % tensors[name].element_size() == 0, f"{name} misaligned in the file"
        end = stop
    assert path.stat().st_size == 8 + n + end


def test_dtype_conversion_on_the_way_out(tmp_path) -> None:  # noqa: ANN001
    tensors = {"a": sample(torch.float32, (16, 8)), "b": sample(torch.float32, (8, 16)).t()}
    path = save_safetensors(tensors, tmp_path / "t.safetensors", dtype=torch.bfloat16)
    got = load_file(str(path))
    assert_same(got, {k: v.to(torch.bfloat16) for k, v in tensors.items()})
    assert tensors["a"].dtype == torch.float32  # the caller's tensors are left as they were
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() is None  # none given, none written (as save_file does)


def test_loads_like_the_same_tensors_written_by_save_file(tmp_path) -> None:  # noqa: ANN001
    tensors = {"w.lora_A.weight": sample(torch.bfloat16, (4, 64)),
               "w.lora_B.weight": sample(torch.bfloat16, (64, 4), seed=1),
               "count": sample(torch.int64, (3,), seed=2)}
    ours = save_safetensors(tensors, tmp_path / "ours.safetensors", {"format": "pt"})
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    assert_same(load_file(str(ours)), load_file(str(tmp_path / "theirs.safetensors")))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fnuz], ids=str)
def test_a_dtype_without_a_safetensors_name_is_refused(dtype, tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=str(dtype).replace(".", r"\.")):
        save_safetensors({"ok": torch.ones(2), "bad": torch.zeros(2, dtype=dtype)}, tmp_path / "t")
    with pytest.raises(ValueError, match=r"torch\.complex128"):  # a conversion to one, too
        save_safetensors({"ok": torch.ones(2)}, tmp_path / "t", dtype=torch.complex128)
    with pytest.raises(ValueError, match="str to str"):
        save_safetensors({"ok": torch.ones(2)}, tmp_path / "t", {"step": 3})  # type: ignore[dict-item]


def test_write_peft_writes_a_snapshots_views(tmp_path) -> None:  # noqa: ANN001
    adapter = JobAdapter({"layers.0.q_proj": (32, 48), "layers.0.v_proj": (32, 16)}, rank=4,
                         alpha=8.0, seed=3)
    snapshot = torch.randn(adapter.flat.shape, generator=torch.Generator().manual_seed(1))
    weights = adapter.peft_state_dict(flat=snapshot)
    assert all(v.untyped_storage().data_ptr() == snapshot.untyped_storage().data_ptr()
               for v in weights.values())  # views of one flat tensor, as the writer thread gets
    out = write_peft(weights, {"r": 4}, tmp_path / "a", torch.bfloat16, {"step": "7"})
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert_same(load_peft_weights(out), {k: v.to(torch.bfloat16) for k, v in weights.items()})
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "step": "7"}


def test_partial_writes_resume_where_they_stopped(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    real_write = os.write
    calls = []

    def short_writev(fd: int, buffers: list) -> int:  # as a full disk or a 2 GiB cap would: a part
        calls.append(len(buffers))
        if len(calls) > 10_000:  # the file is a few kB: a writer that never moves on would fill the disk
            raise AssertionError("the writer keeps rewriting the same bytes")
        return real_write(fd, bytes(memoryview(buffers[0])[:333]))

    monkeypatch.setattr(os, "writev", short_writev)
    tensors = {"a": sample(torch.float32, (64, 9)), "b": sample(torch.bfloat16, (5,), seed=1),
               "c": sample(torch.int8, (1000,), seed=2)}
    path = save_safetensors(tensors, tmp_path / "t.safetensors", {"format": "pt"})
    monkeypatch.undo()
    assert len(calls) > 10 and max(calls) > 1  # many short calls, each offered several buffers
    assert_same(load_file(str(path)), tensors)


def test_copies_and_buffers_flushed_mid_file_keep_the_order(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from trainer import export

    monkeypatch.setattr(export, "_COPIES_HELD", 1)  # every transposed copy written at once
    monkeypatch.setattr(export, "_IOV_MAX", 2)  # and at most 2 buffers a writev
    flat = sample(torch.bfloat16, (600,))
    tensors = {f"a{i}": flat[i * 60:(i + 1) * 60].view(6, 10) for i in range(5)}
    tensors |= {f"b{i}": flat[300 + i * 60:300 + (i + 1) * 60].view(6, 10).t() for i in range(5)}
    path = save_safetensors(tensors, tmp_path / "t.safetensors", {"format": "pt"})
    assert_same(load_file(str(path)), tensors)


@pytest.mark.parametrize("links", [True, False])
def test_an_exports_files_linked_or_copied_under_another_name(tmp_path, monkeypatch, links: bool) -> None:  # noqa: ANN001
    from trainer.export import EXPORT_FILES, link_files

    src = tmp_path / "best"
    write_peft({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, {"r": 4}, src, metadata={"step": "7"})
    if not links:  # another file system: no hard link, a copy
        def no_link(*_a) -> None:  # noqa: ANN002
            raise OSError("cross-device link")
        monkeypatch.setattr(os, "link", no_link)
    dst = link_files(src, tmp_path / "final")
    for name in EXPORT_FILES:
        assert (dst / name).read_bytes() == (src / name).read_bytes()
        assert (os.stat(dst / name).st_ino == os.stat(src / name).st_ino) is links
    assert not [p for p in dst.iterdir() if p.name.startswith(".")]  # no temp file left
    write_peft({"w": torch.zeros(2, 3)}, {"r": 4}, src)  # a later write of src leaves dst as it was
    assert load_file(str(dst / "adapter_model.safetensors"))["w"].sum() == 15
