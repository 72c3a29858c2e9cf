"""The fused shrinks on a step's zeroed slab (kernels.zero_slab) under Triton's interpreter, with the shrink's
column sweep split in 3 (atomics into S, the configuration's pre_hook zeroing S before each launch): the arena
operator's y, dX, dA and dB equal the run without a slab and the fp64 oracle; with the slab no shrink zeroes its
S (two slab fills serve a forward and a backward); where a call tunes, the launch keeps its zeroing.

A subprocess keeps the interpreter flag out of other tests' triton use.
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
from kernels import fused_lora, tuned
from kernels.fused_lora import multilora_linear_arena_fused
from kernels.testing import make_case, oracle_fp64, rel_errors, run_arena
from kernels.zero_slab import ZeroSlab

hooks = []
for cfg in {id(c): c for k in (fused_lora._shrink, fused_lora._shrink_wgrad) for c in k.configs}.values():
    assert cfg.kwargs["SPLIT_C"] == 3 and cfg.pre_hook is not None  # (the two kernels share their configurations)
    cfg.pre_hook = (lambda h: lambda nargs: (hooks.append(1), h(nargs)))(cfg.pre_hook)
out = {}
c = make_case([5, 0, 17, 9], [8, 16, 32, 8], 40, 24, dtype=torch.float32, bias=True)
want = oracle_fp64(c)
plain, _ = run_arena(c, multilora_linear_arena_fused)
out["plain_hooks"] = len(hooks)
hooks.clear()
slab = ZeroSlab()
got, stray = run_arena(c, lambda *a, **k: multilora_linear_arena_fused(*a, slab=slab, **k))
out["slab_hooks"], out["fills"], out["taken"], out["stray"] = len(hooks), slab.fills, slab.taken, stray
out["errs"] = rel_errors(got, want)
out["same"] = {k: bool(torch.equal(got[k], plain[k])) for k in got if got[k] is not None}

# a call that tunes (its trials wrote S): the launch zeroes S as before
hooks.clear()
real = fused_lora._shrink.choose
def tuning_choose(grid, args, meta):
    tuned.BENCHMARKS.append(("shrink", (0,)))
    return real(grid, args, meta)
fused_lora._shrink.choose = tuning_choose
slab2 = ZeroSlab()
got2, _ = run_arena(c, lambda *a, **k: multilora_linear_arena_fused(*a, slab=slab2, **k))
fused_lora._shrink.choose = real
out["tuned_hooks"] = len(hooks)
out["tuned_errs"] = rel_errors(got2, want)
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_split_shrinks_on_a_zeroed_slab_skip_their_zeroing_and_match() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", LORAPLEX_INTERPRET_SPLIT_C="3", PYTHONPATH=ROOT)
    for name in ("LORAPLEX_LORA_FORM", "LORAPLEX_LORA_TIMINGS", "LORAPLEX_FUSED_TMA", "LORAPLEX_FUSED_GEMM"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert res["plain_hooks"] == 2  # the forward's shrink and the backward's dS + dB each zeroed their S
    assert res["slab_hooks"] == 0 and res["fills"] == 1 and res["taken"] == 2  # one fill for both
    assert res["stray"] == 0
    assert all(e <= 3e-6 for e in res["errs"].values()), res["errs"]
    assert all(res["same"].values()), res["same"]  # the slab's zeros are the pre_hook's zeros
    assert res["tuned_hooks"] == 1  # the tuning forward kept its zeroing; the backward's shrink_wgrad did not tune
    assert all(e <= 3e-6 for e in res["tuned_errs"].values()), res["tuned_errs"]
