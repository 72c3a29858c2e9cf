"""The overlapped LoRA term (LORAPLEX_LORA_OVERLAP=1: kernels.fused_lora's overlap paths and kernels/lora_add.py)
under Triton's interpreter, where no side stream exists and the passes run in order on one stream: the forward and
backward of the GEMMs cuBLAS takes equal the float64 oracle (stacked and arena forms, bias, padding, tiles of one
adapter and of several, ranks of several rank blocks, empty adapters), the add kernel runs only where cuBLAS takes
the GEMM and TMA can load the output, and `takes_cublas` gives "auto"'s own choice before any launch.

Each case runs in a subprocess so the interpreter flag and the overlap switch never leak into other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_WORKER = r"""
import json, torch
import kernels.fused_lora as fl
import kernels.lora_add as la
from kernels.fused_lora import multilora_linear_arena_fused, multilora_linear_fused
from kernels.testing import make_case, oracle_fp64, rel_errors, run_arena, run_op

assert fl.LORA_OVERLAP
adds, stores = [], []
_jit, _store = la._lora_add_tma_jit, fl._lora_store.launch


class Counted:  # counts the add kernel's launches
    def __getitem__(self, grid):
        adds.append(1)
        return _jit[grid]


la._lora_add_tma_jit = Counted()
fl._lora_store.launch = lambda *a, **k: (stores.append(1), _store(*a, **k))[1]
out = []


def record(name, c, got, stray=0):
    out.append({"case": name + " " + c.describe(), "errs": rel_errors(got, oracle_fp64(c)), "stray": stray,
                "adds": len(adds), "stores": len(stores)})


cases = [
    # counts, ranks, d_in, d_out, dtype, bias, pad rows
    ([40, 33], [16, 64], 32, 48, torch.float32, False, 11),
    ([5, 0, 17, 30, 3, 21], [8, 64, 24, 16, 64, 17], 40, 56, torch.float32, True, 0),
    ([20, 12], [80, 8], 24, 40, torch.float32, True, 5),
    ([9, 4], [16, 8], 24, 40, torch.float64, True, 3),     # float64: no TMA, the passes in order (the store)
]
for counts, ranks, d_in, d_out, dtype, bias, pad in cases:
    c = make_case(counts, ranks, d_in, d_out, dtype=dtype, bias=bias, pad_rows=pad)
    record("stacked cublas", c, run_op(c, multilora_linear_fused, gemm="cublas"))
    fl.GEMM_DEFAULT = "cublas"
    got, stray = run_arena(c, multilora_linear_arena_fused)
    fl.GEMM_DEFAULT = None
    record("arena cublas", c, got, stray)
c = make_case([40, 33], [16, 64], 32, 48, dtype=torch.float32)
record("stacked ptr", c, run_op(c, multilora_linear_fused, gemm="ptr"))  # no GEMM to cuBLAS: no add
# "auto"'s choice asked before the launch, against the one the launch makes (4 SMs under the interpreter): a
# 13 x 80 forward is 5 tiles of 16 x 16 (cuBLAS), its 13 x 40 dX 3 tiles (persist)
c = make_case([5, 8], [8, 16], 40, 80, dtype=torch.float32)
ctx = fl._Ctx(c.x, 2, 16, c.offsets, c.ranks, c.scales)
fwd = fl.takes_cublas(ctx, c.x, c.weight.t(), c.x.new_zeros(13, 16), c.lora_b, fl._stacked_b(c.lora_b), c.offsets,
                      False, "auto")
dx = fl.takes_cublas(ctx, c.dy, c.weight, c.x.new_zeros(13, 16), c.lora_a, fl._stacked_a(c.lora_a), c.offsets, False,
                     "auto")
n0 = len(adds)
record("stacked auto", c, run_op(c, multilora_linear_fused, gemm="auto"))
print("RESULT" + json.dumps({"results": out, "auto": [fwd, dx], "auto_adds": len(adds) - n0}))
"""


@pytest.mark.parametrize("tile", ["16,16,1", "32,16,1"])
def test_overlapped_lora_term_under_interpreter(tile: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", LORAPLEX_LORA_OVERLAP="1", LORAPLEX_LORA_ADD_TILE=tile,
               PYTHONPATH=ROOT)
    for k in ("LORAPLEX_LORA_FORM", "LORAPLEX_FUSED_GEMM", "LORAPLEX_FUSED_TMA"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True, env=env, timeout=900,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    adds = stores = 0
    for r in res["results"]:
        tol = 1e-12 if "float64" in r["case"] else 1e-5
        for name, err in r["errs"].items():
            assert err < tol, (r["case"], name, err)
        assert r["stray"] == 0, r["case"]
        new_adds, new_stores = r["adds"] - adds, r["stores"] - stores
        adds, stores = r["adds"], r["stores"]
        if "ptr" in r["case"] or "auto" in r["case"]:
            continue
        if "float64" in r["case"]:
            assert (new_adds, new_stores) == (0, 2), r["case"]   # no TMA for float64: the store and cuBLAS
        else:
            assert (new_adds, new_stores) == (2, 0), r["case"]   # forward and dX: the add, no store
    ptr = next(r for r in res["results"] if "ptr" in r["case"])
    before = res["results"][res["results"].index(ptr) - 1]
    assert ptr["adds"] == before["adds"] and ptr["stores"] == before["stores"]
    assert res["auto"] == [True, False]
    assert res["auto_adds"] == 1  # the forward overlapped, the dX on the persistent kernel


def test_lora_add_configuration() -> None:
    code = (
        "import torch\n"
        "import kernels.lora_add as la\n"
        "assert la.parse_tile('64,256,4') == [64, 256, 4]\n"
        "for bad in ('64,256', '64,x,8', '64,96,8', '0,256,8'):\n"
        "    try:\n"
        "        la.parse_tile(bad)\n"
        "    except ValueError as e:\n"
        "        assert 'LoRA add tile' in str(e)\n"
        "    else:\n"
        "        raise SystemExit(bad)\n"
        "assert la.tma_ok(torch.empty(8, 64, dtype=torch.bfloat16))\n"
        "assert not la.tma_ok(torch.empty(8, 63, dtype=torch.bfloat16))\n"
        "assert not la.tma_ok(torch.empty(64, 8, dtype=torch.bfloat16).t())\n"
        "assert not la.tma_ok(torch.empty(8, 64, dtype=torch.float64))\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
