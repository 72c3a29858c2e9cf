"""A new executor process on a node compiles no kernel a former one compiled: the node's Triton
cache (worker.processes.node_caches) holds them. Two fresh processes run the engine's grouped
LoRA operator forward and backward at the same shapes with one cache directory; the second adds
no file to it. Skipped without CUDA."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import torch
from kernels import multilora_linear_arena
from kernels.testing import make_case
c = make_case([300, 0, 212], [16, 64, 24], 512, 768, dtype=torch.bfloat16, device="cuda")
x = c.x.detach().clone().requires_grad_()
arena = torch.randn(200000, device="cuda", dtype=torch.bfloat16)
grad = torch.zeros(200000, device="cuda", dtype=torch.float32)
a_off = torch.tensor([0, 16 * 512, 96 * 512], device="cuda")
b_off = a_off + 120 * 512
token = torch.zeros((), device="cuda", requires_grad=True)
y = multilora_linear_arena(x, c.weight, None, arena, grad, a_off, b_off, c.scales, c.ranks, c.offsets, 64, token)
y.float().sum().backward()
torch.cuda.synchronize()
print("ok")
"""


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_a_second_process_compiles_nothing(tmp_path) -> None:  # noqa: ANN001
    cache = tmp_path / "triton"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    for run in (1, 2):
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
        if run == 1:
            first = files(cache)
            assert first, "the first process compiled into the node's cache"
    assert files(cache) == first  # the second loaded every kernel from the cache


def stamps(root: Path) -> dict[str, int]:
    """Every file of a cache and its modification time (a kernel compiled again rewrites its entry's
    files in place: the set of names alone does not change)."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_a_process_from_kernels_shipped_from_another_directory_compiles_nothing(tmp_path) -> None:  # noqa: ANN001
    """The shipped archive's case: compiled in one directory, seeded into another (a worker's).
    Triton's group files name the compiling directory's absolute paths; unless the seed rewrites
    them, every shipped kernel is compiled again (session 27, bench/results/session27_h100.md)."""
    import tarfile

    from kernels import shipped_cache

    built = tmp_path / "device" / "triton"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, "TRITON_CACHE_DIR": str(built)}, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
    key = shipped_cache.device_key()
    archives = tmp_path / "archives"
    archives.mkdir()
    with tarfile.open(archives / shipped_cache.archive_name(*key), "w:gz") as tar:
        tar.add(built, arcname="triton")
    shutil.rmtree(built)  # the compiling machine's directory is not on the node
    node = tmp_path / "node" / "triton"
    assert shipped_cache.seed(node, key, archives) > 0
    before = stamps(node)
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, "TRITON_CACHE_DIR": str(node)}, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
    assert stamps(node) == before  # nothing compiled: no file added, none rewritten
