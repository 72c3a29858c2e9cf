"""The persistent fused GEMM's stream-K tail ($LORAPLEX_STREAM_K) on CPU, under Triton's interpreter: the last
round's tiles shared out by main-loop steps (pieces that cross from one tile into the next, with 16 programs),
summed by the second pass, against the fp64 oracle and the whole-tile kernel, stacked and arena forms; and a call
whose host shares out its last round while its live rows' round is full (padding past the last adapter)."""

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
from kernels.fused_lora import multilora_linear_arena_fused, multilora_linear_fused
from kernels.testing import make_case, oracle_fp64, rel_errors, run_arena, run_op

fixups = []
_real = fl._fixup_launch
fl._fixup_launch = lambda *a, **k: (fixups.append(a[-1]), _real(*a, **k))[1]
out = []
# (programs, counts, ranks, pad): 16 programs, 3 row tiles of 16 x one column tile, 16 steps each: runs of 3 steps
# (pieces cross tiles); 4 programs, 5 tiles on the host, 4 live (the padding's row tile): the device shares nothing
for programs, counts, ranks, pad in ((16, [20, 28], [16, 64], 0), (4, [30, 20], [8, 24], 30)):
    fl._num_sms = lambda _d, p=programs: p
    c = make_case(counts, ranks, 256, 16, dtype=torch.float64, bias=True, pad_rows=pad)
    want = oracle_fp64(c)
    live = int(c.offsets[-1])
    edge = -(-live // fl._IB) * fl._IB
    runs = {}
    for sk in (True, False):
        fl.STREAM_K = sk
        fl.GEMM_DEFAULT = "persist"
        n0 = len(fixups)
        for form, (got, stray) in (("stacked", (run_op(c, multilora_linear_fused, gemm="persist"), 0)),
                                   ("arena", run_arena(c, multilora_linear_arena_fused))):
            zeros = bool((got["y"][edge:] == 0).all())
            got["y"][edge:] = want["y"][edge:]
            runs[(sk, form)] = got
            out.append({"case": f"{programs} programs stream_k={sk} {form}", "errs": rel_errors(got, want),
                        "zeros_past": zeros, "stray": stray})
        out[-1]["fixups"] = len(fixups) - n0
    same = max((runs[(True, f)][k] - runs[(False, f)][k]).abs().max().item() for f in ("stacked", "arena")
               for k in ("y", "dx", "dA", "dB"))
    out.append({"case": f"{programs} programs: stream-K against whole tiles", "max_diff": same})
fl.GEMM_DEFAULT = None
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stream_k_tail_under_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    for k in ("LORAPLEX_LORA_FORM", "LORAPLEX_LORA_TIMINGS", "LORAPLEX_FUSED_TMA", "LORAPLEX_FUSED_GEMM",
              "LORAPLEX_INTERPRET_BLOCK_M"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    runs = [r for r in res if "errs" in r]
    assert len(runs) == 8
    for r in runs:
        assert all(e <= 1e-12 for e in r["errs"].values()), r
        assert r["zeros_past"] and r["stray"] == 0, r
    # stream-K on: the forward's tail shared out (stacked and arena: 2 second passes); off: none
    assert [r.get("fixups") for r in runs if "fixups" in r] == [2, 0, 2, 0]
    assert all(r["max_diff"] <= 1e-12 for r in res if "max_diff" in r), res
