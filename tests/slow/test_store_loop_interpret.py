"""The store pass's column-loop form (kernels/store_loop.py) under Triton's interpreter: the "cublas" variant's
forward and backward against the float64 oracle, and the loop's own output against the tile form's, on row
tiles it holds one adapter's P for (the fast path) and on tiles of several adapters, ranks over its rank tile,
padding rows and a bias (the general path).

Each case runs in a subprocess so the interpreter flag and the store form never leak into other tests.
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
import kernels.store_loop as sl
from kernels.fused_lora import multilora_linear_fused
from kernels.testing import make_case, oracle_fp64, run_op, rel_errors

assert sl.FORM == "loop", sl.FORM
launches, fast = [], []
_jit = sl._store_loop_jit


class Counted:  # counts the loop kernel's launches, and how many of its row tiles take the one-adapter path
    def __getitem__(self, grid):
        def run(*args, **kw):
            launches.append(grid)
            return _jit[grid](*args, **kw)
        return run


sl._store_loop_jit = Counted()
out = []
cases = [
    # counts, ranks, d_in, d_out, bias, pad rows: one-adapter tiles (16-row tiles inside 40- and 33-row jobs),
    # tiles of two or three adapters, ranks up to the cap and over it (80 > 64), empty adapters, padding
    ([40, 33], [16, 64], 32, 48, False, 11),
    ([5, 0, 17, 30, 3, 21], [8, 64, 24, 16, 64, 17], 40, 56, True, 0),
    ([20, 12], [80, 8], 24, 40, True, 5),
    ([0, 0, 0], [8, 16, 64], 21, 13, False, 0),
]
for counts, ranks, d_in, d_out, bias, pad in cases:
    c = make_case(counts, ranks, d_in, d_out, dtype=torch.float64, bias=bias, pad_rows=pad)
    got = run_op(c, multilora_linear_fused, gemm="cublas")
    out.append({"case": c.describe(), "errs": rel_errors(got, oracle_fp64(c))})
# the loop's output against the tile form's, for one store call (s P B^T): equal up to the sum's order
c = make_case([40, 33], [16, 64], 32, 48, dtype=torch.float64, pad_rows=11)
ctx = fl._Ctx(c.x, 2, 64, c.offsets, c.ranks, c.scales)
p = torch.randn(c.x.shape[0], 64, dtype=torch.float64)
b_kn = c.weight.t()
loop_out = torch.full((c.x.shape[0], 48), float("nan"), dtype=torch.float64)
sl.store_loop_launch(ctx, loop_out, None, p, c.lora_b, fl._stacked_b(c.lora_b), c.offsets, False)
sl.FORM = "tile"
tile_out = torch.full_like(loop_out, float("nan"))
fl.store_launch(ctx, c.x, b_kn, tile_out, None, p, c.lora_b, fl._stacked_b(c.lora_b), c.offsets, False)
diff = (loop_out - tile_out).abs().max().item()
print("RESULT" + json.dumps({"results": out, "launches": len(launches), "loop_vs_tile": diff,
                             "nan_left": bool(loop_out.isnan().any()), "pad_rows_zero": bool((loop_out[73:] == 0).all())}))
"""


@pytest.mark.parametrize("cap", ["64", "16"])
def test_store_loop_under_interpreter(cap: str) -> None:
    """cap 64: the 16-row tiles inside one job take the one-adapter path; cap 16: only rank-16 tiles do."""
    env = dict(os.environ, TRITON_INTERPRET="1", LORAPLEX_LORA_STORE_FORM="loop",
               LORAPLEX_LORA_STORE_LOOP=f"16,16,1,1,1,{cap}", PYTHONPATH=ROOT)
    for k in ("LORAPLEX_LORA_FORM", "LORAPLEX_FUSED_GEMM", "LORAPLEX_FUSED_TMA"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    for r in res["results"]:
        for name, err in r["errs"].items():
            assert err < 1e-12, (r["case"], name, err)
    # the forward's and the backward's dX stores of every case but the empty one (T = 0 runs no GEMM)
    assert res["launches"] >= 6
    assert res["loop_vs_tile"] < 1e-12
    assert not res["nan_left"] and res["pad_rows_zero"]


def test_store_loop_configuration_and_split() -> None:
    """The loop's configuration string is checked, and the column split aims at the programs asked for."""
    code = (
        "import kernels.store_loop as sl\n"
        "assert sl.parse_tile('64,128,4,3,2') == [64, 128, 4, 3, 2]\n"
        "for bad in ('64,128,4', '64,x,4,3,2', '64,128,4,0,2'):\n"
        "    try:\n"
        "        sl.parse_tile(bad)\n"
        "    except ValueError as e:\n"
        "        assert 'store loop tile' in str(e)\n"
        "    else:\n"
        "        raise SystemExit(bad)\n"
        "assert sl.columns_per_program(1536, 4096, 64, 128, 264) == 384\n"     # 24 row tiles x 11 splits
        "assert sl.columns_per_program(1536, 1024, 64, 128, 264) == 128\n"     # no more splits than column tiles
        "assert sl.columns_per_program(8000, 4096, 64, 128, 132) == 4096\n"    # 125 row tiles: one split
        "assert sl.rank_tile(8) == 16 and sl.rank_tile(33) == 64 and sl.rank_tile(128) == 64\n"
        "assert sl.rank_tile(128, 128) == 128\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-c", "import kernels.store_loop"], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, LORAPLEX_LORA_STORE_FORM="wide"), timeout=120)
    assert bad.returncode != 0 and "LORAPLEX_LORA_STORE_FORM" in bad.stderr
