"""Unit: where torch's deterministic algorithms are on (a repeatable decode, trainer.sampling),
the fused forward's shrink runs its tuned tile without column splits (whose float atomics add
partial sums in a run-dependent order: seeded 8B decodes on an H200 did not repeat), and gives
the same result. Under the Triton interpreter with a split configuration (SPLIT_C = 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_WORKER = r"""
import json
import torch
import kernels.fused_lora as fl
from kernels.multilora import multilora_linear

splits = []
run = fl._shrink._run
fl._shrink._run = lambda cfg, *a: (splits.append(cfg.kwargs["SPLIT_C"]), run(cfg, *a))[1]
g = torch.Generator().manual_seed(0)
d_in, d_out, ranks = 40, 24, [8, 16]
x = torch.randn(12, d_in, generator=g, dtype=torch.float64)
w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
a = torch.randn(2, d_in, 16, generator=g, dtype=torch.float64)
b = torch.randn(2, 16, d_out, generator=g, dtype=torch.float64)
scales = torch.tensor([0.5, 2.0], dtype=torch.float64)
rk = torch.tensor(ranks)
offsets = torch.tensor([0, 5, 12])
want = x @ w.T
for i, (lo, hi) in enumerate([(0, 5), (5, 12)]):
    r = ranks[i]
    want[lo:hi] += scales[i] * (x[lo:hi] @ a[i, :, :r]) @ b[i, :r]
out = {}
with torch.no_grad():
    for det in (False, True):
        torch.use_deterministic_algorithms(det)
        got = multilora_linear(x, w, None, a, b, scales, rk, offsets, backend="triton", form="fused")
        out[str(det)] = float((got - want).abs().max())
print("RESULT" + json.dumps({"errs": out, "splits": splits}))
"""


def test_deterministic_mode_runs_the_shrink_unsplit() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", LORAPLEX_INTERPRET_SPLIT_C="3", PYTHONPATH=str(ROOT))
    for k in ("LORAPLEX_LORA_FORM", "LORAPLEX_LORA_TIMINGS", "LORAPLEX_FUSED_TMA", "LORAPLEX_FUSED_GEMM"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert res["splits"] and set(res["splits"][: len(res["splits"]) // 2]) == {3}  # tuned: split
    assert set(res["splits"][len(res["splits"]) // 2:]) == {1}  # deterministic: whole sweeps
    assert all(e < 1e-9 for e in res["errs"].values()), res["errs"]
