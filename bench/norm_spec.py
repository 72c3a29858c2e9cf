"""The RMSNorm kernels without their row count's specialisation (session 74's form) against the same source
specialised on it (the form before), side by side on one device: forward and backward at the 2-job step's
row counts, each launch timed as a CUDA graph of 64 launches (the step replays its norms in a graph;
bench/graph_timing.replay_ms), medians of 20 replays. Both forms are checked equal to each other bit for bit.

    python bench/norm_spec.py [--width 4096] [--rows 939,1164,1418,1664,1920] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402
from graph_timing import replay_ms  # noqa: E402

from kernels import norm_act  # noqa: E402
from kernels.norm_act import _rows_per_program, _warps  # noqa: E402

LAUNCHES, REPLAYS = 64, 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--rows", default="939,1164,1418,1664,1920")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, d = torch.device("cuda"), args.width
    forms = {"session 74 (rows not specialised)": (norm_act._rms_fwd, norm_act._rms_bwd),
             "before (rows specialised)": (triton.jit(norm_act._rms_fwd.fn), triton.jit(norm_act._rms_bwd.fn))}
    block, per = _rows_per_program(d)
    meta = {"BLOCK_D": block, "ROWS": per, "num_warps": _warps(block, per)}
    lines = [f"# RMSNorm kernels, row count specialised or not ({torch.cuda.get_device_name()}, width {d}, bf16)", "",
             f"One launch's device time, us (a graph of {LAUNCHES} launches, median of {REPLAYS} replays).", "",
             "| rows | form | forward us | backward us | equal |", "|---|---|---|---|---|"]
    for n in (int(r) for r in args.rows.split(",")):
        g = torch.Generator(device="cpu").manual_seed(n)
        x = torch.randn(n, d, generator=g).to(dev, torch.bfloat16)
        w = (1 + 0.1 * torch.randn(d, generator=g)).to(dev, torch.bfloat16)
        dy = torch.randn(n, d, generator=g).to(dev, torch.bfloat16)
        outs = {}
        for name, (fwd, bwd) in forms.items():
            y, rstd, dx = torch.empty_like(x), torch.empty(n, device=dev), torch.empty_like(x)
            grid = (triton.cdiv(n, per),)
            f_ms = replay_ms(lambda: fwd[grid](x, w, y, rstd, n, d, 1e-6, **meta), REPLAYS, launches=LAUNCHES)  # noqa: B023
            b_ms = replay_ms(lambda: bwd[grid](dy, x, w, rstd, dx, n, d, **meta), REPLAYS, launches=LAUNCHES)  # noqa: B023
            outs[name] = (y.clone(), dx.clone(), f_ms, b_ms)
        (y0, dx0, *_), (y1, dx1, *_) = outs.values()
        same = bool(torch.equal(y0, y1) and torch.equal(dx0, dx1))
        for name, (_, _, f_ms, b_ms) in outs.items():
            lines.append(f"| {n} | {name} | {f_ms * 1e3:.2f} | {b_ms * 1e3:.2f} | {same} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
