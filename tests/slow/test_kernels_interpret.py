"""The Triton kernels themselves on CPU, run by Triton's interpreter (TRITON_INTERPRET=1).

Each test starts a subprocess so the interpreter flag never leaks into other tests' triton use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# Runs inside the subprocess: every case through backend="triton", errors vs the fp64 oracle.
_WORKER = r"""
import json, random, torch
from kernels import multilora_linear
from kernels.testing import (make_case, oracle_fp64, run_op, rel_errors, padding_grad_nonzero,
                             empty_adapter_grad_nonzero)
random.seed()
n64 = 64
cases = [
    ([5, 0, 17, 33, 1], [8, 16, 64, 8, 16], 40, 24, torch.float32, True),
    ([37], [16], 24, 40, torch.float64, False),
    ([0, 0, 9, 0], [64, 8, 16, 8], 33, 17, torch.float32, True),
    ([random.choice([0, 1, 2, 5]) for _ in range(n64)], [random.choice([8, 16, 64]) for _ in range(n64)],
     20, 36, torch.float32, True),
    ([3, 18, 0, 7], [16, 8, 8, 64], 50, 19, torch.float64, True),
]
out = []
for counts, ranks, d_in, d_out, dtype, bias in cases:
    c = make_case(counts, ranks, d_in, d_out, dtype=dtype, bias=bias)
    got = run_op(c, multilora_linear, backend="triton")
    out.append({"case": c.describe(), "dtype": str(dtype), "errs": rel_errors(got, oracle_fp64(c)),
                "pad_nonzero": padding_grad_nonzero(got, c.ranks),
                "empty_nonzero": empty_adapter_grad_nonzero(got, c.offsets)})
# Partial gradient needs: x frozen (no dX pass), B frozen (no dB reduction).
c = make_case([6, 0, 11], [16, 8, 64], 21, 18, dtype=torch.float64)
want = oracle_fp64(c)
x = c.x.clone()
a = c.lora_a.clone().requires_grad_()
b = c.lora_b.clone()
multilora_linear(x, c.weight, c.bias, a, b, c.scales, c.ranks, c.offsets, backend="triton").backward(c.dy)
ea = ((a.grad - want["dA"]).norm() / want["dA"].norm()).item()
x = c.x.clone().requires_grad_()
a = c.lora_a.clone()
multilora_linear(x, c.weight, c.bias, a, b, c.scales, c.ranks, c.offsets, backend="triton").backward(c.dy)
ex = ((x.grad - want["dx"]).norm() / want["dx"].norm()).item()
out.append({"case": "partial " + c.describe(), "dtype": "torch.float64", "errs": {"dA": ea, "dx": ex},
            "pad_nonzero": 0, "empty_nonzero": 0})
# Non-contiguous x (column-major) and lora_a (transposed storage): strides are honoured.
c = make_case([9, 4, 0, 20], [16, 64, 8, 8], 26, 30, dtype=torch.float64)
c.x = c.x.t().contiguous().t()
c.lora_a = c.lora_a.transpose(1, 2).contiguous().transpose(1, 2)
got = run_op(c, multilora_linear, backend="triton")
out.append({"case": "strided " + c.describe(), "dtype": "torch.float64", "errs": rel_errors(got, oracle_fp64(c)),
            "pad_nonzero": padding_grad_nonzero(got, c.ranks), "empty_nonzero": 0})
# Poisoned outputs: the shrink buffer starts as NaN and every element must be overwritten.
from kernels.triton_lora import lora_forward
c = make_case([7, 0, 19, 2], [8, 64, 16, 16], 23, 29, dtype=torch.float64, nan_padding=False)
t = c.x.shape[0]
s_buf = torch.full((t, 64), float("nan"), dtype=torch.float64)
y = torch.zeros(t, 29, dtype=torch.float64)
lora_forward(c.x, c.lora_a, c.lora_b, c.scales, c.ranks, c.offsets, y, s_out=s_buf)
want_s = torch.zeros(t, 64, dtype=torch.float64)
bounds = c.offsets.tolist()
for i, r in enumerate(c.ranks.tolist()):
    lo, hi = bounds[i], bounds[i + 1]
    want_s[lo:hi, :r] = c.x[lo:hi] @ c.lora_a[i, :, :r]
want_y = torch.cat([float(c.scales[i]) * want_s[bounds[i]:bounds[i + 1], :r] @ c.lora_b[i, :r]
                    for i, r in enumerate(c.ranks.tolist())])
poison = {"s": ((s_buf - want_s).norm() / want_s.norm()).item() if torch.isfinite(s_buf).all() else float("inf"),
          "y": ((y - want_y).norm() / want_y.norm()).item() if torch.isfinite(y).all() else float("inf")}
out.append({"case": "poisoned S " + c.describe(), "dtype": "torch.float64", "errs": poison,
            "pad_nonzero": 0, "empty_nonzero": 0})
# Arena form (what the engine calls): shuffled blocks with NaN gaps, gradients added to prior sums.
from kernels import multilora_linear_arena
from kernels.testing import run_arena
for counts, ranks, d_in, d_out, dtype, x_grad in [
    ([5, 0, 17, 33, 1], [8, 16, 64, 8, 16], 40, 24, torch.float32, True),
    ([0, 0, 9, 0], [64, 8, 16, 8], 33, 17, torch.float64, False),
    ([random.choice([0, 1, 2, 5]) for _ in range(20)], [random.choice([8, 16, 64]) for _ in range(20)],
     20, 36, torch.float64, True),
]:
    c = make_case(counts, ranks, d_in, d_out, dtype=dtype)
    got, stray = run_arena(c, multilora_linear_arena, x_grad=x_grad, backend="triton")
    want = oracle_fp64(c)
    if not x_grad:
        got["dx"] = want["dx"]
    out.append({"case": "arena " + c.describe(), "dtype": str(dtype), "errs": rel_errors(got, want),
                "pad_nonzero": 0, "empty_nonzero": empty_adapter_grad_nonzero(got, c.offsets) + stray})
print("RESULT" + json.dumps(out))
"""

TOL = {"torch.float32": 2e-6, "torch.float64": 1e-12}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block_m", ["16", "32"])
def test_triton_kernels_under_interpreter(block_m: str) -> None:
    """Two row-tile heights, so adapters end at different places inside tiles."""
    env = dict(os.environ, TRITON_INTERPRET="1", LORAPLEX_INTERPRET_BLOCK_M=block_m)
    proc = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True, env=env, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert len(results) == 11
    for r in results:
        tol = TOL[r["dtype"]]
        assert all(e <= tol for e in r["errs"].values()), f"{r['errs']} > {tol}: {r['case']}"
        assert r["pad_nonzero"] == 0 and r["empty_nonzero"] == 0, r["case"]
