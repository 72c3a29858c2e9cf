"""Nsight Compute probe of a small step's LoRA passes (issue 40): why they run at 3-7x their bytes.

At the 200-step task's 2-job layout (rank 16 x 290 rows + rank 64 x 1,160 rows, padded to the 1,536-row graph
key), each pass the engine runs for one projection is launched once inside a profiler range, named by an NVTX
range "<pass> <d_in>x<d_out>": the forward shrink, the backward's one-pass dS + dB, the dA pass (the table's
configurations, as the engine picks them) and the "cublas" variant's store pass, forward (s S B^T, d_out wide)
and backward (dS A, d_in wide). Sessions 52 and 57 timed them apart (bench/lora_sweep.py): 5-20 us for 0.7-3 us
of bytes, no tile or configuration much better. This run asks the hardware why (occupancy, registers, warp
stall reasons, achieved bandwidth).

Usage (GPU): ncu --profile-from-start off --set full --nvtx -o REPORT python3 bench/ncu_passes.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_op_paths import stage_inputs  # noqa: E402
from lora_op_stages import arena_inputs  # noqa: E402
from ncu_epilogue import profile_once  # noqa: E402

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))
COUNTS, RANKS, PAD = [290, 1160], [16, 64], 86


def passes(d_in: int, d_out: int) -> dict:
    from kernels import fused_lora as fl

    torch.manual_seed(0)
    si = stage_inputs(d_in, d_out, len(COUNTS), 0, RANKS, counts=COUNTS, pad_rows=PAD)
    ai = arena_inputs(si)
    ai.ds.copy_(torch.randn_like(ai.ds))  # never profile on zeros
    c, x, dy = si.c, si.x, si.dy
    y = torch.empty(x.shape[0], d_out, dtype=x.dtype, device=x.device)
    dx = torch.empty_like(x)
    return {
        "fwd shrink": lambda: fl._shrink_launch(c, x, ai.arena, ai.sa, ai.ao, si.s_buf, ai.mode),
        "dS+dB": lambda: fl._shrink_launch(c, dy, ai.arena, ai.sb, ai.bo, ai.ds, ai.mode,
                                           wgrad=(si.s_buf, ai.grad, ai.bo)),
        "dA": lambda: fl._wgrad_launch(c, ai.ds, x, ai.grad, ai.sa, ai.ao, ai.mode),
        "store fwd": lambda: fl.store_launch(c, x, si.w.t(), y, None, si.s_buf, ai.arena, ai.sb, ai.bo, ai.mode),
        "store bwd": lambda: fl.store_launch(c, dy, si.w, dx, None, ai.ds, ai.arena, ai.sa, ai.ao, ai.mode),
    }


def main() -> None:
    runs = {}
    for d_in, d_out in SHAPES:
        for name, fn in passes(d_in, d_out).items():
            runs[f"{name} {d_in}x{d_out}"] = fn
    profile_once(runs)


if __name__ == "__main__":
    main()
