"""A new executor process on a node compiles no kernel a former one compiled: the node's Triton
cache (worker.processes.node_caches) holds them. Two fresh processes run the engine's grouped
LoRA operator forward and backward at the same shapes with one cache directory; the second adds
no file to it. Skipped without CUDA."""

from __future__ import annotations

import os
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
