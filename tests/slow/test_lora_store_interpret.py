"""The store pass's column-sweep form (kernels.lora_store, $LORAPLEX_LORA_STORE=sweep) on CPU under Triton's
interpreter: the "cublas" GEMM variant (the LoRA term stored, the base GEMM added onto it) through the whole
operator, forward and backward, stacked and arena, against the float64 oracle, at several sweep tiles: empty and
rank-0-sized adapters, ranks that are not powers of two, a bias, padding rows no adapter owns (they must hold the
base output, not garbage), a tile that holds two adapters in the tile form, and T = 0.

Each case runs in a subprocess so the interpreter flag never leaks into other tests' triton use.
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
import kernels.lora_store as ls
from kernels.fused_lora import multilora_linear_arena_fused, multilora_linear_fused
from kernels.testing import make_case, oracle_fp64, run_op, run_arena, rel_errors

calls = []
own = ls.sweep_store
ls.sweep_store = lambda *a, **k: (calls.append(1), own(*a, **k))[1]
out = []
for counts, ranks, d_in, d_out, dtype, bias, pad in [
        ([5, 0, 17, 33, 1], [8, 16, 64, 8, 16], 40, 24, torch.float32, True, 0),
        ([9, 20, 0, 3], [24, 40, 8, 17], 30, 35, torch.float64, True, 0),
        ([5, 0, 17, 3], [8, 64, 24, 16], 40, 56, torch.float64, True, 37),
        ([37], [16], 24, 40, torch.float64, False, 5),
        ([0, 0, 0], [8, 16, 64], 21, 13, torch.float64, False, 0)]:
    c = make_case(counts, ranks, d_in, d_out, dtype=dtype, bias=bias, pad_rows=pad)
    want = oracle_fp64(c)
    got = run_op(c, multilora_linear_fused, gemm="cublas")
    fl.GEMM_DEFAULT = "cublas"
    got_arena, stray = run_arena(c, multilora_linear_arena_fused)
    fl.GEMM_DEFAULT = None
    out.append({"case": c.describe(), "dtype": str(dtype), "pad": pad, "errs": rel_errors(got, want),
                "arena_errs": rel_errors(got_arena, want), "stray": stray,
                "pad_rows_ok": bool(torch.isfinite(got["y"]).all()) and bool(torch.isfinite(got_arena["y"]).all())})
print("RESULT" + json.dumps({"results": out, "calls": len(calls), "form": fl.STORE_FORM}))
"""

TOL = {"torch.float32": 3e-6, "torch.float64": 1e-12}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tile", ["32,128,4,4,3", "16,16,4,3,2", "64,16,4,2,2"])
def test_sweep_store_matches_the_oracle(tile: str) -> None:
    """BLOCK_M 16-64 (tiles clipped at each adapter's end; a 64-row tile holds a whole adapter and the padding),
    BLOCK_N 16 (several column steps a program) or 128, and 1-4 column splits (a split may hold no column)."""
    env = dict(os.environ, TRITON_INTERPRET="1", LORAPLEX_LORA_STORE="sweep", LORAPLEX_LORA_STORE_SWEEP=tile,
               PYTHONPATH=ROOT)
    for var in ("LORAPLEX_LORA_FORM", "LORAPLEX_LORA_TIMINGS", "LORAPLEX_FUSED_TMA", "LORAPLEX_FUSED_GEMM"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert res["form"] == "sweep"
    # every case but T = 0 stores twice a call (forward y, backward dX), stacked and arena: 4 x 4
    assert res["calls"] == 16, res["calls"]
    for r in res["results"]:
        tol = TOL[r["dtype"]]
        for name, errs in (("stacked", r["errs"]), ("arena", r["arena_errs"])):
            assert max(errs.values()) < tol, (name, r["case"], errs)
        assert r["stray"] == 0, r["case"]
        assert r["pad_rows_ok"], r["case"]
