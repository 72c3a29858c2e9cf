"""The store pass's TMA-stored form (kernels/lora_store.py) under Triton's interpreter: the "cublas" variant's
forward and backward against the float64 oracle (float32 inputs: TMA stores no float64), and its output against
the tile form's, on tiles of one adapter and of several, ranks over the rank tile (several rank blocks), empty
adapters, padding rows, a bias, and row and column counts that are not multiples of the tile.

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
import kernels.lora_store as sl
from kernels.fused_lora import multilora_linear_fused
from kernels.testing import make_case, oracle_fp64, run_op, rel_errors

assert sl.FORM == "tma", sl.FORM
launches = []
_jit = sl._lora_store_tma_jit


class Counted:  # counts the TMA store kernel's launches
    def __getitem__(self, grid):
        def run(*args, **kw):
            launches.append(grid)
            return _jit[grid](*args, **kw)
        return run


sl._lora_store_tma_jit = Counted()
out = []
cases = [
    # counts, ranks, d_in, d_out, bias, pad rows: one-adapter tiles (16-row tiles inside 40- and 33-row jobs),
    # tiles of two or three adapters, ranks of one rank block and of several (80: three of 32), empty adapters,
    # padding, widths that are not multiples of the tile
    ([40, 33], [16, 64], 32, 48, False, 11),
    ([5, 0, 17, 30, 3, 21], [8, 64, 24, 16, 64, 17], 40, 56, True, 0),
    ([20, 12], [80, 8], 24, 40, True, 5),
    ([0, 0, 0], [8, 16, 64], 21, 13, False, 0),
]
for counts, ranks, d_in, d_out, bias, pad in cases:
    c = make_case(counts, ranks, d_in, d_out, dtype=torch.float32, bias=bias, pad_rows=pad)
    got = run_op(c, multilora_linear_fused, gemm="cublas")
    out.append({"case": c.describe(), "errs": rel_errors(got, oracle_fp64(c))})
# the TMA form's output against the tile form's, for one store call (s P B^T): equal up to the sum's order
c = make_case([40, 33], [16, 64], 32, 40, dtype=torch.float32, pad_rows=11)
ctx = fl._Ctx(c.x, 2, 64, c.offsets, c.ranks, c.scales)
p = torch.randn(c.x.shape[0], 64, dtype=torch.float32)
b_kn = c.weight.t()
tma_out = torch.full((c.x.shape[0], 40), float("nan"), dtype=torch.float32)
assert sl.tma_store_ok(tma_out)
sl.store_tma_launch(ctx, tma_out, None, p, c.lora_b, fl._stacked_b(c.lora_b), c.offsets, False)
sl.FORM = "tile"
tile_out = torch.full_like(tma_out, float("nan"))
fl.store_launch(ctx, c.x, b_kn, tile_out, None, p, c.lora_b, fl._stacked_b(c.lora_b), c.offsets, False)
diff = ((tma_out - tile_out).abs().max() / tile_out.abs().max()).item()
print("RESULT" + json.dumps({"results": out, "launches": len(launches), "tma_vs_tile": diff,
                             "nan_left": bool(tma_out.isnan().any()), "pad_rows_zero": bool((tma_out[73:] == 0).all())}))
"""


@pytest.mark.parametrize("tile", ["16,16,1", "32,16,1"])
def test_tma_store_under_interpreter(tile: str) -> None:
    """16-row tiles: most inside one job; 32-row tiles: more of them meet two or three adapters."""
    env = dict(os.environ, TRITON_INTERPRET="1", LORAPLEX_LORA_STORE_FORM="tma", LORAPLEX_LORA_STORE_TMA=tile,
               PYTHONPATH=ROOT)
    for k in ("LORAPLEX_LORA_FORM", "LORAPLEX_FUSED_GEMM", "LORAPLEX_FUSED_TMA"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    for r in res["results"]:
        for name, err in r["errs"].items():
            assert err < 1e-5, (r["case"], name, err)
    # the forward's and the backward's dX stores of every case but the empty one (T = 0 runs no GEMM)
    assert res["launches"] >= 6
    assert res["tma_vs_tile"] < 1e-6
    assert not res["nan_left"] and res["pad_rows_zero"]


def test_tma_store_configuration() -> None:
    """The tile string is checked, an output TMA cannot store is refused (the tile form takes it), and a bad
    form name stops the import with a message naming the variable."""
    code = (
        "import torch\n"
        "import kernels.lora_store as ls\n"
        "assert ls.parse_tile('64,256,8') == [64, 256, 8]\n"
        "for bad in ('64,256', '64,x,8', '64,96,8', '0,256,8'):\n"
        "    try:\n"
        "        ls.parse_tile(bad)\n"
        "    except ValueError as e:\n"
        "        assert 'TMA store tile' in str(e)\n"
        "    else:\n"
        "        raise SystemExit(bad)\n"
        "assert ls.tma_store_ok(torch.empty(8, 64, dtype=torch.bfloat16))\n"
        "assert not ls.tma_store_ok(torch.empty(8, 63, dtype=torch.bfloat16))\n"        # row stride 126 bytes
        "assert not ls.tma_store_ok(torch.empty(64, 8, dtype=torch.bfloat16).t())\n"    # column stride 64
        "assert not ls.tma_store_ok(torch.empty(8, 64, dtype=torch.float64))\n"
        "assert ls.rank_tile(16) == 16 and ls.rank_tile(17) == 32 and ls.rank_tile(64) == 32\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-c", "import kernels.lora_store"], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, LORAPLEX_LORA_STORE_FORM="wide"), timeout=120)
    assert bad.returncode != 0 and "LORAPLEX_LORA_STORE_FORM" in bad.stderr
