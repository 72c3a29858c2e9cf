"""`kernels.triton_lora.launch_restoring`: a composition kernel that adds into caller-owned
gradients may run tuning trials on its first call per key; the gradients must end up holding
exactly one call's sum. (The fused form never tunes at run time: tests/unit/test_kernels_tables.py.)"""

from __future__ import annotations

import torch

from kernels import fused_lora as fl
from kernels import triton_lora as tlr


class _Tuner:
    """Stands in for a triton.autotune object: its first launch runs `trials` extra launches (the
    tuning trials), each adding into the adapter's block of g like the real one."""

    def __init__(self, configs: int, trials: int) -> None:
        self.configs = list(range(configs))
        self.trials = trials
        self.launches = 0

    def __getitem__(self, grid: object):  # noqa: ANN204
        def run(g: torch.Tensor, lo: int, hi: int, **_meta: object) -> None:
            extra = self.trials if self.launches == 0 else 0
            self.launches += 1 + extra
            g[lo:hi] += 1.0 + extra  # the trials' garbage, then the real sum (1 per launch)
        return run


def test_launch_restoring_restores_every_span() -> None:
    """The composition's arena backward adds into dx and into the gradient arena: both restored."""
    tlr._TUNED.clear()
    dx0, arena0 = torch.randn(6), torch.randn(30)
    dx, arena = dx0.clone(), arena0.clone()
    aoff, boff = torch.tensor([4, 12]), torch.tensor([8, 16])
    span = tlr.arena_span(arena, (aoff, boff), (4, 6))
    assert span[1:] == (4, 22)  # lowest offset to the end of the highest block (16 + 6)

    class Tuner:
        configs = [0, 1, 2]
        launches = 0

        def __getitem__(self, grid: object):  # noqa: ANN204
            def run(**_meta: object) -> None:
                trials = 3 if Tuner.launches == 0 else 0
                Tuner.launches += 1 + trials
                dx.add_(1.0 + trials)
                arena[4:22].add_(1.0 + trials)
            return run

    tlr.launch_restoring(Tuner(), None, ("k",), lambda: [span, (dx, 0, 6)], (), {})
    assert torch.equal(dx, dx0 + 1.0) and torch.equal(arena[4:22], arena0[4:22] + 1.0)
    assert torch.equal(arena[:4], arena0[:4]) and torch.equal(arena[22:], arena0[22:])
    assert Tuner.launches == 5


_TRIALS_WORKER = r"""
import json, torch
from kernels import fused_lora as fl, triton_lora as tlr
from kernels.fused_lora import multilora_linear_arena_fused, multilora_linear_fused
from kernels.triton_lora import multilora_linear_arena_triton, multilora_linear_triton
from kernels.testing import make_case, oracle_fp64, rel_errors, run_arena, run_op


class Trials:
    # A tuner with two configs whose first launch also runs two tuning trials: two more REAL
    # launches of the kernel, adding into the caller's tensors like Triton's trials do.
    def __init__(self, real):
        self.real, self.configs, self.first = real, [0, 1], True

    def __getitem__(self, grid):
        def run(*args, **kw):
            for _ in range(3 if self.first else 1):
                self.real[grid](*args, **kw)
            self.first = False
        return run


for mod, name in ((tlr, "_fwd_kernel"), (tlr, "_bwd_kernel"), (tlr, "_bwd_kernel_arena")):
    setattr(mod, name, Trials(getattr(mod, name)))
out = []
for form, stacked, arena in (("compose", multilora_linear_triton, multilora_linear_arena_triton),
                             ("fused", multilora_linear_fused, multilora_linear_arena_fused)):
    for counts, ranks in (([5, 0, 17, 33], [8, 16, 64, 8]), ([9, 4], [16, 32])):
        for fn in (stacked, arena):
            tlr._TUNED.clear()
            for t in (tlr._fwd_kernel, tlr._bwd_kernel, tlr._bwd_kernel_arena):
                t.first = True
            c = make_case(counts, ranks, 24, 40, dtype=torch.float64, bias=True)
            kw = {"onepass": False} if fn is multilora_linear_fused else {}  # the two-pass dB uses _wgrad too
            got, stray = (run_op(c, fn, **kw), 0) if fn in (stacked,) else run_arena(c, fn)
            out.append({"case": f"{form} {fn.__name__} {counts}", "err": max(rel_errors(got, oracle_fp64(c)).values()),
                        "stray": stray})
print("RESULT" + json.dumps(out))
"""


def test_tuning_trials_leave_no_trace_under_the_interpreter() -> None:
    """Every kernel that adds into caller-owned tensors, with simulated tuning trials that really
    launch the kernel (twice more, adding into y, dx, dA/dB and the gradient arena): the results
    still match the fp64 oracle, and no arena element outside the adapters' blocks changed."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", _TRIALS_WORKER], capture_output=True, text=True, env=env,
                          timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert len(res) == 8
    for r in res:
        assert r["err"] < 1e-12 and r["stray"] == 0, r


def test_wide_dtypes_run_one_small_config_and_16_bit_ones_tune(monkeypatch) -> None:  # noqa: ANN001
    """fp32/fp64 calls on a GPU skip tuning (each large tile compiles for seconds as FMA code) and
    run the kernel's small config; bf16/fp16 calls keep the list, rank tiles pruned to the call."""
    monkeypatch.setattr(tlr, "_INTERPRET", False)  # the GPU's behaviour (the interpreter keeps its list)
    wide = tlr._cfg(BLOCK_M=32, BLOCK_K=64, BLOCK_R=16, SPLIT_C=1)
    listed = [tlr._cfg(BLOCK_M=64, BLOCK_K=128, BLOCK_R=r, SPLIT_C=1) for r in (16, 32, 64)]
    prune = tlr.wide_dtype_pruner(wide, fl._prune_rank_tiles)
    for dtype in (torch.float32, torch.float64):
        assert prune(listed, {"m_ptr": torch.empty(2, dtype=dtype), "R_MAX": 64}) == [wide]
    for dtype in (torch.bfloat16, torch.float16):
        assert prune(listed, {"m_ptr": torch.empty(2, dtype=dtype), "R_MAX": 64}) == listed
        assert prune(listed, {"m_ptr": torch.empty(2, dtype=dtype), "R_MAX": 16}) == listed[:1]
    compose = tlr.wide_dtype_pruner(wide)  # the composition's kernels: no rank-tile pruning
    assert compose(listed, {"x_ptr": torch.empty(2, dtype=torch.float32)}) == [wide]
    assert compose(listed, {"x_ptr": torch.empty(2, dtype=torch.bfloat16)}) == listed
    monkeypatch.setattr(tlr, "_INTERPRET", True)
    assert prune(listed, {"m_ptr": torch.empty(2, dtype=torch.float32), "R_MAX": 64}) == listed
