"""The RMSNorm kernels compiled for every row width a backbone uses, into $TRITON_CACHE_DIR (issue 41: the
shipped archive, kernels/triton_cache, must hold every norm a task launches).

Since session 74 the norm kernels do not specialise on their row count (`do_not_specialize=["n_rows"]`), so
one compiled kernel serves a width (its power-of-two block) and dtype at any token count: this script
compiles each of them once, on an empty cache, checks it against the float64 reference (forward and
backward, at a row count that 16 divides and one it does not), and prints a line per kernel. Then
`tar -C DIR -czf grown.tar.gz triton` and `python -m kernels.shipped_cache --merge grown.tar.gz` add them
to the archive (their earlier entries are dropped as stale).

    TRITON_CACHE_DIR=/tmp/nc/triton python bench/norm_cache.py [--widths 256,...,8192] [--dtypes bf16,fp16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.norm_act import rms_norm, rms_norm_reference  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# one width per block the norms take (kernels.norm_act._rows_per_program), the common hidden sizes among them
WIDTHS = (128, 256, 896, 1024, 1536, 2048, 3072, 3584, 4096, 5120, 8192)


def check(width: int, dtype: torch.dtype, rows: int, device: torch.device) -> float:
    """The fused norm's forward and x-gradient at [rows, width] against the reference in float64: the worst
    absolute difference over both, relative to the reference's largest value (raises where it exceeds 2^-5: the kernels round where the
    module rounds, ~3 bfloat16 ulps of the largest value on the CPU's interpreter)."""
    g = torch.Generator(device="cpu").manual_seed(width * 31 + rows)
    x = torch.randn(rows, width, generator=g).to(device=device, dtype=dtype)
    w = (1.0 + 0.1 * torch.randn(width, generator=g)).to(device=device, dtype=dtype)
    dy = torch.randn(rows, width, generator=g).to(device=device, dtype=dtype)
    xg = x.clone().requires_grad_(True)
    y = rms_norm(xg, w, 1e-6)
    y.backward(dy)
    xr = x.double().requires_grad_(True)
    yr = rms_norm_reference(xr, w.double(), 1e-6)
    yr.backward(dy.double())
    worst = 0.0
    for got, want in ((y, yr), (xg.grad, xr.grad)):
        err = ((got.double() - want.detach()).abs().max() / want.detach().abs().max().clamp(min=1e-12)).item()
        worst = max(worst, err)
    if not worst <= 2.0 ** -5:
        raise SystemExit(f"width {width} {dtype} rows {rows}: relative error {worst:.3g} over 2^-5")
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    ap.add_argument("--dtypes", default="bf16,fp16")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name in args.dtypes.split(","):
        for width in (int(w) for w in args.widths.split(",")):
            t0 = time.perf_counter()
            worst = max(check(width, DTYPES[name], rows, device) for rows in (64, 1145))
            print(f"rms_norm {name} width {width}: worst relative error {worst:.2e}, "
                  f"{time.perf_counter() - t0:.2f} s (compiles included)", flush=True)


if __name__ == "__main__":
    main()
