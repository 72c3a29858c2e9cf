"""The first calls of a process's ops on the GPU, each timed twice (first, then again), after cuBLAS is set up by a
bf16 GEMM: session 66's profile of the 200-step task's first step (bench/results/session66_h200.md) had one fp32
`aten::bmm` of 54-57 ms of host time for 3 us on the device, `aten::where` 17-24 ms, and slow first `aten::mm`
calls, none of them in a later step's top ops. This says which first calls cost that much in a fresh process (a
module loaded lazily, a cuBLAS setup) and whether a second call of another shape pays again: what a warm-up on a
thread during the load would have to run.

    python3 bench/first_calls.py [--tokens 4752] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import task_e2e_data as te  # noqa: E402


def timed(fn: Callable[[], object]) -> float:
    """Seconds of one call, the device synced before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4752)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev, t = torch.device("cuda"), args.tokens
    x = torch.randn(t, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    setup = timed(lambda: x @ w.t())  # cuBLAS's handle and workspace, a bf16 GEMM's module
    inv = torch.rand(1, 64, 1, device=dev)
    pos = torch.arange(t, device=dev, dtype=torch.float32)[None, None, :]
    pos2 = torch.arange(t + 128, device=dev, dtype=torch.float32)[None, None, :]
    ids = torch.randint(0, 1000, (t,), device=dev)
    mask = ids > 500
    head = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
    ops = [
        ("fp32 bmm [1,64,1] x [1,1,T] (the rotary embedding's)", lambda: inv @ pos, lambda: inv @ pos2),
        ("bf16 mm [T,4096] x [4096,8192]", lambda: x @ head.t(), lambda: x[:-128] @ head.t()),
        ("bf16 mm, x^T dY [4096,T] x [T,4096]", lambda: x.t() @ x, lambda: x[:-128].t() @ x[:-128]),
        ("where", lambda: torch.where(mask, ids, -100), lambda: torch.where(mask[:-128], ids[:-128], -100)),
        ("arange", lambda: torch.arange(t, device=dev), lambda: torch.arange(t + 1, device=dev)),
        ("gather", lambda: torch.gather(x.float()[:, :8], 1, ids[:, None] % 8),
         lambda: torch.gather(x.float()[:-1, :8], 1, ids[:-1, None] % 8)),
        ("ge + sum", lambda: (ids >= 3).sum(), lambda: (ids[:-1] >= 3).sum()),
    ]
    rows = [f"| {name} | {1e3 * timed(first):.2f} | {1e3 * timed(again):.2f} | {1e3 * timed(again):.2f} |"
            for name, first, again in ops]
    lines = [f"# First calls in a fresh process ({torch.cuda.get_device_name(dev)}, torch {torch.__version__}; T = {t})",
             "", f"cuBLAS set up first by a bf16 GEMM: {1e3 * setup:.1f} ms", "",
             "| op | first call ms | another shape ms | again ms |", "|---|---|---|---|", *rows]
    te.emit("\n".join(lines) + "\n", {}, args)


if __name__ == "__main__":
    main()
