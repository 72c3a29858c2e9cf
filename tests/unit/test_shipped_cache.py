"""The compiled kernels shipped with the code (kernels.shipped_cache): a process on a GPU kind with
an archive copies the entries its Triton cache lacks, once, never overwriting one and never
writing outside the cache; other kinds and Triton versions take nothing. The committed archive
for the H100/H200 (sm90) holds compiled kernels with their autotuning choices."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path, PurePosixPath

import pytest

from kernels import shipped_cache

KEY = ((9, 0), "3.6.0")


def make_archive(folder: Path, entries: dict[str, bytes], key=KEY) -> Path:  # noqa: ANN001
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / shipped_cache.archive_name(*key)
    with tarfile.open(path, "w:gz") as tar:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_seed_adds_missing_entries_once_and_keeps_existing_ones(tmp_path: Path) -> None:
    archives = tmp_path / "archives"
    make_archive(archives, {"triton/AAA/k.cubin": b"cubin", "triton/AAA/k.json": b"{}",
                            "triton/BBB/__grp__k.json": b"grp"})
    cache = tmp_path / "cache"
    (cache / "AAA").mkdir(parents=True)
    (cache / "AAA" / "k.json").write_bytes(b"mine")  # compiled here before: kept as it is
    assert shipped_cache.seed(cache, KEY, archives) == 2
    assert (cache / "AAA" / "k.cubin").read_bytes() == b"cubin"
    assert (cache / "BBB" / "__grp__k.json").read_bytes() == b"grp"
    assert (cache / "AAA" / "k.json").read_bytes() == b"mine"
    (cache / "AAA" / "k.cubin").unlink()  # a cache that took this archive is not read again
    assert shipped_cache.seed(cache, KEY, archives) == 0
    assert not (cache / "AAA" / "k.cubin").exists()
    assert not list(cache.rglob("*.tmp"))


@pytest.mark.parametrize("key", [((8, 0), "3.6.0"), ((9, 0), "3.5.1"), None])
def test_other_gpu_kinds_and_versions_take_nothing(tmp_path: Path, key, monkeypatch) -> None:  # noqa: ANN001
    archives = tmp_path / "archives"
    make_archive(archives, {"triton/AAA/k.cubin": b"cubin"})
    monkeypatch.setattr(shipped_cache, "device_key", lambda: None)  # no CUDA: nothing to match
    cache = tmp_path / "cache"
    assert shipped_cache.seed(cache, key, archives) == 0
    assert not cache.exists()


def test_members_outside_the_cache_are_never_written(tmp_path: Path) -> None:
    archives = tmp_path / "archives"
    make_archive(archives, {"triton/../../evil": b"x", "/abs/evil": b"x", "triton/OK/k.cubin": b"ok"})
    cache = tmp_path / "deep" / "cache"
    assert shipped_cache.seed(cache, KEY, archives) == 1
    assert (cache / "OK" / "k.cubin").read_bytes() == b"ok"
    assert not (tmp_path / "evil").exists() and not (tmp_path / "deep" / "evil").exists()


def test_the_default_cache_is_tritons(monkeypatch, tmp_path: Path) -> None:  # noqa: ANN001
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "t"))
    assert shipped_cache.cache_dir() == tmp_path / "t"
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert shipped_cache.cache_dir() == Path.home() / ".triton" / "cache"


def test_the_committed_sm90_archive_holds_compiled_kernels_and_tuning(tmp_path: Path) -> None:
    archives = sorted(shipped_cache.ARCHIVES.glob("sm90-triton*.tar.gz"))
    assert archives, "an archive for the H100/H200 is shipped"
    version = archives[-1].name.removeprefix("sm90-triton").removesuffix(".tar.gz")
    cache = tmp_path / "cache"
    assert shipped_cache.seed(cache, ((9, 0), version)) > 0
    names = [p.name for p in cache.rglob("*") if p.is_file()]
    kernels = {n.removesuffix(".cubin") for n in names if n.endswith(".cubin")}
    assert "_gemm_lora_persist_jit" in kernels, kernels
    assert any(n.endswith(".json") and n.startswith("__grp__") for n in names)  # each kernel's group


def _broken_groups(cache: Path) -> list[Path]:
    """The group files whose children are not where they say (Triton then compiles the kernel)."""
    import json

    broken = []
    for grp in cache.rglob("__grp__*.json"):
        children = json.loads(grp.read_text())["child_paths"]
        if not all(Path(p).is_file() and Path(p).parent == grp.parent for p in children.values()):
            broken.append(grp)
    return broken


def test_a_kernels_group_points_at_its_files_in_the_cache_it_was_copied_to(tmp_path: Path) -> None:
    import json

    elsewhere = "/tmp/the_device_cache/triton/ENTRY"  # where the device compiled it
    grp = json.dumps({"child_paths": {"k.cubin": f"{elsewhere}/k.cubin", "k.json": f"{elsewhere}/k.json"}}).encode()
    archives = tmp_path / "archives"
    make_archive(archives, {"triton/ENTRY/k.cubin": b"cubin", "triton/ENTRY/k.json": b"{}",
                            "triton/ENTRY/__grp__k.json": grp})
    cache = tmp_path / "cache"
    stale = cache / "ENTRY" / "__grp__k.json"  # an earlier seeding's group, pointing elsewhere
    stale.parent.mkdir(parents=True)
    stale.write_bytes(grp)
    assert shipped_cache.seed(cache, KEY, archives) == 3
    children = json.loads(stale.read_text())["child_paths"]
    assert children == {"k.cubin": str(cache / "ENTRY" / "k.cubin"), "k.json": str(cache / "ENTRY" / "k.json")}
    assert _broken_groups(cache) == []
    try:  # Triton's own lookup finds the entry (a miss would compile the kernel again)
        from triton.runtime.cache import FileCacheManager
    except ImportError:
        return
    manager = FileCacheManager.__new__(FileCacheManager)
    manager.cache_dir = str(cache / "ENTRY")
    assert manager.get_group("k.json") == children


def test_every_kernel_of_the_committed_archive_is_found_where_it_is_seeded(tmp_path: Path) -> None:
    archive = sorted(shipped_cache.ARCHIVES.glob("sm90-triton*.tar.gz"))[-1]
    version = archive.name.removeprefix("sm90-triton").removesuffix(".tar.gz")
    cache = tmp_path / "some" / "other" / "cache"
    assert shipped_cache.seed(cache, ((9, 0), version)) > 0
    groups = list(cache.rglob("__grp__*.json"))
    assert len(groups) >= len(list(cache.rglob("*.cubin"))) > 0
    assert _broken_groups(cache) == []


def test_the_manifest_names_every_shipped_archive_and_the_kernels_it_was_made_from() -> None:
    # a kernel edited, or moved by lines above it, misses every shipped entry of it (Triton's cache
    # key holds its source and first line) and compiles inside a task: refresh the archive on a
    # device, then `python -m kernels.shipped_cache --manifest`
    manifest = json.loads(shipped_cache.MANIFEST.read_text())
    archives = sorted(p.name for p in shipped_cache.ARCHIVES.glob("*.tar.gz"))
    assert archives and sorted(manifest) == archives
    now = shipped_cache.kernel_fingerprints()
    for name in archives:
        entry = manifest[name]
        assert entry["sha256"] == shipped_cache.archive_digest(shipped_cache.ARCHIVES / name), (
            f"{name} changed after its manifest was written: write the manifest again")
        changed = sorted(k for k in entry["kernels"] if now.get(k) != entry["kernels"][k])
        assert not changed, f"kernels changed or moved since {name} was made (refresh it on a device): {changed}"
    with tarfile.open(shipped_cache.ARCHIVES / archives[0]) as tar:
        shipped = {PurePosixPath(m).stem for m in tar.getnames() if m.endswith(".cubin")}
    assert shipped and all(any(k.endswith("." + s) for k in now) for s in shipped)  # every shipped kernel is watched


def test_a_kernel_moved_by_a_line_gets_another_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = "import triton\n\n\n@triton.jit\ndef _k(x_ptr):\n    pass\n"
    (tmp_path / "moved_kernel.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    first = shipped_cache.kernel_fingerprints(("moved_kernel",))
    assert list(first) == ["moved_kernel._k"]
    sys.modules.pop("moved_kernel")
    (tmp_path / "moved_kernel.py").write_text("# a line above\n" + body)  # the same source, one line lower
    second = shipped_cache.kernel_fingerprints(("moved_kernel",))
    assert second["moved_kernel._k"][0] == first["moved_kernel._k"][0]
    assert second["moved_kernel._k"][1] == first["moved_kernel._k"][1] + 1 and second != first
    sys.modules.pop("moved_kernel")


def test_merge_drops_the_entries_of_changed_kernels_and_adds_the_grown_ones(tmp_path: Path) -> None:
    """`merge` (python -m kernels.shipped_cache --merge): an archive refreshed from a cache a device
    grew from it. Entries of a kernel changed since the manifest are dropped; a helper's change drops
    every kernel of its module (Triton keys a kernel by its callees' sources); the rest are kept, the
    entries the device compiled added (not what its seed copied in, nor the seed's markers), the
    manifest written for the result."""
    now = shipped_cache.kernel_fingerprints()
    made_from = dict(now)
    made_from["kernels.fused_lora._gemm_lora_persist_jit"] = ["0" * 16, 1]  # changed since the archive
    made_from["kernels.fused_lora._gone_jit"] = ["1" * 16, 2]  # a helper since removed: its module's kernels go
    made_from["kernels.norm_act._gone_helper"] = now["kernels.cross_entropy._ce_rows"]
    old = {"triton/P1/_gemm_lora_persist_jit.cubin": b"old persist", "triton/P1/__grp___gemm_lora_persist_jit.json": b"{}",
           "triton/S1/_shrink_jit.cubin": b"old shrink", "triton/C1/_ce_rows.cubin": b"ce",
           "triton/N1/_rms_fwd.cubin": b"norm"}
    archive = make_archive(tmp_path / "archives", old)
    manifest = tmp_path / "archives" / "manifest.json"
    manifest.write_text(json.dumps({archive.name: {"sha256": "x", "kernels": made_from}}))
    # the device's cache: seeded (at t=100, its marker) from this archive and from an older one (X0: an entry of
    # a kernel since changed, which that archive had), then two kernels compiled (t=200)
    grown = tmp_path / "grown.tar.gz"
    with tarfile.open(grown, "w:gz") as tar:
        for name, data, mtime in [*((n, d, 100) for n, d in old.items()), ("triton/X0/_gemm_lora_persist_jit.cubin",
                                  b"older persist", 90), ("triton/.loraplex-shipped-abc", b"", 100),
                                  ("triton/P2/_gemm_lora_persist_jit.cubin", b"new persist", 200),
                                  ("triton/S2/_shrink_jit.cubin", b"new shrink", 200)]:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), mtime
            tar.addfile(info, io.BytesIO(data))
    res = shipped_cache.merge(grown, archive, manifest)
    with tarfile.open(archive) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
    # fused_lora's helper went: its kernels' old entries (persist, shrink) are dropped, the grown ones added;
    # cross_entropy's kernel is as it was; norm_act lost a helper: its kernel's entry goes too
    assert got == {"triton/C1/_ce_rows.cubin": b"ce", "triton/P2/_gemm_lora_persist_jit.cubin": b"new persist",
                   "triton/S2/_shrink_jit.cubin": b"new shrink"}
    assert res == {"kept": 1, "dropped": 3, "added": 2}
    written = json.loads(manifest.read_text())[archive.name]
    assert written["sha256"] == shipped_cache.archive_digest(archive) and written["kernels"] == now


def test_stale_kernels_are_the_changed_ones_or_all_of_a_module_whose_helper_changed() -> None:
    now = {"m.a": ["1", 10], "m.b": ["2", 20], "m.helper": ["3", 5], "n.c": ["4", 1]}
    assert shipped_cache.stale_kernels(now, now, {"a", "b", "c"}) == set()
    assert shipped_cache.stale_kernels(now | {"m.a": ["1", 11]}, now, {"a", "b", "c"}) == {"a"}  # moved a line
    assert shipped_cache.stale_kernels(now | {"m.helper": ["9", 5]}, now, {"a", "b", "c"}) == {"a", "b", "helper"}


def test_the_norm_kernels_compile_once_per_width_whatever_the_row_count() -> None:
    """Session 73 compiled `_rms_bwd` inside search (a): Triton specialised its row count on whether 16
    divides it, and the archive held only one of the two variants for that width. The norms take
    `do_not_specialize=["n_rows"]`, so one shipped kernel serves every token count (checked in a process
    without the interpreter, where the kernels are Triton's JIT functions)."""
    import os
    import subprocess

    code = ("from kernels import norm_act as n\n"
            "for k in (n._rms_fwd, n._rms_bwd):\n"
            "    print(type(k).__name__, sorted(p.name for p in k.params if p.do_not_specialize))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.split("\n")
    assert out[:2] == ["JITFunction ['n_rows']", "JITFunction ['n_rows']"], out
