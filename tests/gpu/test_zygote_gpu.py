"""A node's executor process forked by its zygote (worker.zygote: torch, Triton, transformers and the
engine imported, CUDA untouched) uses its GPU as a new interpreter would: one visible device, a
correct matmul, the engine's Triton LoRA operator forward and backward. Skipped without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_forked_executor_process_uses_its_gpu(tmp_path: Path) -> None:
    from worker.processes import ForkedProcess, process_env, spawn
    from worker.zygote import Zygote

    cache = tmp_path / "cache"
    z = Zygote(process_env([], cuda=True, cache_dir=cache), tmp_path, tmp_path / "zygote.log")
    try:
        assert z.ready(300.0), (tmp_path / "zygote.log").read_text()[-3000:]
        d = tmp_path / "placement"
        d.mkdir()
        proc = spawn("tests.helpers.cuda_child", "--dir", d, [0], "child.log", cuda=True, cache_dir=cache,
                     zygote=z)
        assert isinstance(proc, ForkedProcess)
        assert proc.wait(timeout=300) == 0, (d / "child.log").read_text()[-3000:]
        seen = json.loads((d / "cuda.json").read_text())
        assert seen["imported_before"] and seen["devices"] == 1
        assert seen["matmul_err"] < 1e-9 and seen["lora_finite"] and seen["grad_nonzero"]
    finally:
        z.close()
        z.proc.wait(timeout=60)
