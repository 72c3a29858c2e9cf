"""Where a process's first Triton kernels spend their host time (issue 41): the fused blocks' probe
kernels (RMSNorm, SiLU-gate, rotary) as a new executor launches them before its first step.

In session 51's tasks the node's first executor process spent 0.27 s in `_rope_kernel`'s JIT that a
second process on the same seeded cache did not (bench/executor_task.py's kernel loads). This script
does what the executor does before its probes (the shipped archive seeded into `TRITON_CACHE_DIR`,
Triton's key computed ahead: kernels.triton_warm), then launches each kernel once on the probes'
shapes under cProfile and prints, per kernel, its seconds and the 15 functions with the most
cumulative time inside its launch, and the modules its launch imported. Run it twice in fresh processes on the same cache: the first
process's extra is what a node's first executor pays.

    python bench/first_kernels.py [--hidden 4096] [--inter 14336] [--head-dim 128] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import triton_warm  # noqa: E402
from kernels.norm_act import rms_norm, silu_mul  # noqa: E402
from kernels.rope import rope  # noqa: E402
from kernels.shipped_cache import seed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    seed()
    seeded = time.perf_counter() - t0
    key_s = triton_warm.compute()
    dev, dt, d = torch.device("cuda"), torch.bfloat16, args.head_dim
    x = torch.randn(5, args.hidden, device=dev, dtype=dt)
    w = torch.ones(args.hidden, device=dev, dtype=dt)
    g, u = (torch.randn(5, args.inter, device=dev, dtype=dt) for _ in range(2))
    q, k = (torch.randn(1, 5, h * d, device=dev, dtype=dt).view(1, 5, h, d).transpose(1, 2) for h in (3, 2))
    cos, sin = (torch.randn(1, 5, d, device=dev, dtype=dt) for _ in range(2))
    torch.cuda.synchronize()
    lines = [f"# First Triton kernels of a process ({torch.cuda.get_device_name()})", "",
             f"Archive seeded in {seeded:.3f} s; Triton's key computed ahead in {key_s:.3f} s.", ""]
    for name, call in (("rms_norm", lambda: rms_norm(x, w, 1e-5)), ("silu_mul", lambda: silu_mul(g, u)),
                       ("rope", lambda: rope(q, k, cos, sin))):
        prof = cProfile.Profile()
        before = set(sys.modules)
        t1 = time.perf_counter()
        prof.enable()
        call()
        torch.cuda.synchronize()
        prof.disable()
        took = time.perf_counter() - t1
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(15)
        new = sorted(set(sys.modules) - before)  # what its launch imported
        lines += [f"## {name}: {took:.3f} s", "", f"Imported by it ({len(new)}): {', '.join(new) or 'nothing'}", "",
                  "```", buf.getvalue().strip()[-4000:], "```", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
