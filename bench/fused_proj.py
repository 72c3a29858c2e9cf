"""What one GEMM for the sibling projections would save a training step (issue 40): q/k/v as one [6144, 4096] weight
and gate/up as one [28672, 4096], against today's one GEMM per projection, the backbone's part only (no LoRA).

Today every target linear is its own GEMM: forward, q, k and v of the same normed rows (k and v are 1024 wide, so at
~1,500 rows they fill under half of the H200's SMs), and in the backward each projection's dX is its own GEMM,
summed by autograd's adds (two for q/k/v, one for gate/up: ~9 us each at these sizes). With the siblings' weights
as row blocks of one buffer, the forward is one GEMM whose output's column slices are the projections, and the
backward one GEMM over the siblings' gradients side by side (K = 6144 or 28672), with no adds. Where the gradients
come as separate tensors, they must first be put side by side (`cat`); a backward whose kernels write them into one
buffer (the SiLU-gate's backward can) needs no copy, so both are timed.

Forms, each a CUDA graph of `--layers` layers (each its own weights), median of `--iters` replays
(graph_timing.replay_ms), at each row count:

- apart: forward F.linear per projection; backward dX = sum of each projection's dY @ W (mm, then adds);
- fused: forward one F.linear on the joined weight; backward cat of the gradients, one mm;
- fused, no cat: the backward's gradients already side by side, one mm.

The fused forms' outputs are checked against the apart forms' in the same run (the same GEMMs' sums in another
order: bf16 rounding apart). CUDA only.

    python3 bench/fused_proj.py [--rows 1024,1536,2048] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.nn import functional as F  # noqa: N812

sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timing import replay_ms  # noqa: E402

HIDDEN = 4096
GROUPS = {"q/k/v": (4096, 1024, 1024), "gate/up": (14336, 14336)}


def forms(x: torch.Tensor, ws: list[torch.Tensor], joined: torch.Tensor, widths: tuple[int, ...]) -> dict:
    """Each form's forward and backward over the layers' weights (ws: each layer's joined weight; joined: the
    siblings' output gradients side by side, whose column blocks, copied apart, are the gradients as they come)."""
    cuts = [sum(widths[:i]) for i in range(len(widths) + 1)]
    grads = [joined[:, a:b].contiguous() for a, b in zip(cuts[:-1], cuts[1:], strict=True)]

    def apart_fwd() -> list:
        return [F.linear(x, w[a:b]) for w in ws for a, b in zip(cuts[:-1], cuts[1:], strict=True)]

    def fused_fwd() -> list:
        return [F.linear(x, w) for w in ws]

    def apart_bwd() -> list:
        outs = []
        for w in ws:
            parts = [g @ w[a:b] for g, a, b in zip(grads, cuts[:-1], cuts[1:], strict=True)]
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            outs.append(total)
        return outs

    def fused_bwd() -> list:
        return [torch.cat(grads, dim=1) @ w for w in ws]

    def fused_nocat_bwd() -> list:
        return [joined @ w for w in ws]

    return {"apart": (apart_fwd, apart_bwd), "fused": (fused_fwd, fused_bwd), "fused, no cat": (fused_fwd,
                                                                                                 fused_nocat_bwd)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1024,1536,2048")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows_out = [f"# Sibling projections as one GEMM, {torch.cuda.get_device_name()}, torch {torch.__version__}: "
                f"{args.layers} layers a graph (each its own weights, bf16, scaled 0.02), median of {args.iters} "
                "replays; the backbone's GEMMs only (no LoRA); ms for all layers", "",
                "| group | rows | form | forward ms | backward ms | fwd + bwd ms | saved ms a step | worst diff vs apart |",
                "|---|---|---|---|---|---|---|---|"]
    for name, widths in GROUPS.items():
        width = sum(widths)
        ws = [(torch.randn(width, HIDDEN, device=dev, dtype=dt, generator=g) * 0.02) for _ in range(args.layers)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, HIDDEN, device=dev, dtype=dt, generator=g)
            joined = torch.randn(m, width, device=dev, dtype=dt, generator=g)
            fs = forms(x, ws, joined, widths)
            ref_f, ref_b = (torch.cat(fs["apart"][0]()[: len(widths)], 1), fs["apart"][1]()[0])
            base = None
            for form, (fwd, bwd) in fs.items():
                outs = fwd()
                out_f, out_b = torch.cat(outs[: len(widths)], 1) if form == "apart" else outs[0], bwd()[0]
                diff = max(float((out_f - ref_f).abs().max()), float((out_b.float() - ref_b.float()).abs().max()))
                f_ms, b_ms = replay_ms(fwd, args.iters), replay_ms(bwd, args.iters)
                base = base if base is not None else f_ms + b_ms
                rows_out.append(f"| {name} | {m} | {form} | {f_ms:.2f} | {b_ms:.2f} | {f_ms + b_ms:.2f} | "
                                f"{base - f_ms - b_ms:.2f} | {diff:.1e} |")
                print(rows_out[-1], flush=True)
        del ws
        torch.cuda.empty_cache()
    text = "\n".join(rows_out) + "\n"
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
