"""Nsight Compute probe of the fused GEMM's LoRA epilogue (issue 20): one persistent fused forward
GEMM at an engine shape (8 adapters x 1024 tokens, ranks 16/32/64 cycled) launched twice inside a
profiler range, with its adapters (the epilogue's expand runs) and without them (the same binary,
the epilogue's adapter loop empty), so `ncu --profile-from-start off` reports both side by side.

Usage (GPU): ncu --profile-from-start off --set full -o REPORT python3 bench/ncu_epilogue.py [D_IN D_OUT]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_op_paths import stage_inputs  # noqa: E402

from kernels.fused_lora import _gemm_launch  # noqa: E402


def main() -> None:
    d_in, d_out = (int(v) for v in sys.argv[1:3]) if len(sys.argv) > 2 else (4096, 14336)
    si = stage_inputs(d_in, d_out, 8, 1024, [16, 32, 64])
    x, w, b, off, s_buf, sb = si.x, si.w, si.b, si.off, si.s_buf, si.sb
    runs = {"with LoRA": lambda: _gemm_launch(si.c, x, w.t(), None, s_buf, b, sb, off, False, x.dtype),
            "no LoRA": lambda: _gemm_launch(si.c0, x, w.t(), None, s_buf, b, sb, off, False, x.dtype)}
    profile_once(runs)


def profile_once(runs: dict) -> None:
    """Each run three times outside the profiler's range (tuned and compiled), then once inside it under an NVTX
    range of its name (`ncu --profile-from-start off --nvtx` reports the kernels it launched by that name)."""
    for fn in runs.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in runs.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", ", ".join(runs), flush=True)


if __name__ == "__main__":
    main()
