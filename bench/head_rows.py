"""What the LM head over target rows only could give a graphed step (docs/step_levers.md, "What is left"): the
training head as the step graph runs it (trainer.head's fused path: logits, the cross-entropy kernel leaving their
gradient in place, the hidden states' gradient) over a step's rows, against the same over its target rows alone
(the bound: a graph whose head rows are the target count), and against a form a graph can run without a key per
target count: target rows first, the head's two GEMMs on the persistent fused GEMM (kernels.fused_lora, "persist")
with one rank-0 adapter spanning the target rows, so that its programs skip the row tiles past them.

Each form runs as a CUDA graph of 8 heads (bench/graph_timing.replay_ms), replayed 20 times (medians, ms per
head). Each form's losses and hidden-state gradient on the target rows are checked against the all-rows form (bf16
GEMMs in another order: the largest relative difference is printed). Llama-3.1-8B's head: 4096 x 128,256, bf16, random weights.

    python bench/head_rows.py [--rows 1418:1007,1920:1363] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timing import replay_ms  # noqa: E402

from kernels import fused_lora  # noqa: E402
from kernels.cross_entropy import IGNORE, cross_entropy_rows  # noqa: E402

HIDDEN, VOCAB = 4096, 128256
LAUNCHES, REPLAYS = 8, 20


def head_cublas(h: torch.Tensor, t: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """trainer.head._ChunkedHeadLoss's fused path for one chunk: the losses, and grad = d(sum losses)/dh."""
    logits = torch.nn.functional.linear(h, w)
    losses = cross_entropy_rows(logits, t, grad=True)[0]
    torch.matmul(logits, w, out=grad)
    return losses


class PersistHead:
    """The same head on the persistent fused GEMM over rows [0, live) (live in a device tensor: a graph replays it
    at any target count). Rows past `live` get zero logits (the kernel fills its wholly unowned row tiles with
    zeros, the rest of a partly owned tile is computed), IGNORE targets, zero loss and zero gradient."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.offsets = torch.zeros(2, dtype=torch.int32, device=device)
        self.ranks = torch.zeros(1, dtype=torch.int32, device=device)
        self.scales = torch.zeros(1, dtype=torch.float32, device=device)
        self.p = torch.zeros(rows, 16, dtype=torch.float32, device=device)
        self.w_fwd = torch.zeros(1, 16, VOCAB, dtype=torch.bfloat16, device=device)
        self.w_bwd = torch.zeros(1, 16, HIDDEN, dtype=torch.bfloat16, device=device)

    def gemm(self, a: torch.Tensor, b_kn: torch.Tensor, w_lora: torch.Tensor) -> torch.Tensor:
        c = fused_lora._Ctx(a, 1, 16, self.offsets, self.ranks, self.scales)
        strides = (w_lora.stride(0), w_lora.stride(1), w_lora.stride(2))
        return fused_lora._gemm_launch(c, a, b_kn, None, self.p, w_lora, strides, self.offsets, 0, a.dtype,
                                       gemm="persist")

    def __call__(self, h: torch.Tensor, t: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        logits = self.gemm(h, w.t(), self.w_fwd)
        losses = cross_entropy_rows(logits, t, grad=True)[0]
        grad.copy_(self.gemm(logits, w, self.w_bwd))
        return losses


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-12)).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1418:1007,1920:1363", help="ROWS:TARGETS pairs (a step's rows, its targets)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(VOCAB, HIDDEN, generator=gen) * HIDDEN ** -0.5).to(dev, torch.bfloat16)
    lines = [f"# The LM head over target rows only ({torch.cuda.get_device_name()}, {HIDDEN} x {VOCAB}, bf16)", "",
             f"ms per head (a graph of {LAUNCHES}, median of {REPLAYS} replays); rel: the largest difference from "
             "the all-rows form on the target rows (losses, gradient), relative to its largest value.", "",
             "| rows | targets | all rows (today) | target rows only (bound) | persistent GEMM, rows past the targets skipped | "
             "saved: bound / persistent | rel: persistent |", "|---|---|---|---|---|---|---|"]
    for pair in args.rows.split(","):
        rows, n_t = (int(v) for v in pair.split(":"))
        h = torch.randn(rows, HIDDEN, generator=gen).to(dev, torch.bfloat16)
        t = torch.randint(0, VOCAB, (rows,), generator=gen).to(dev)
        t[n_t:] = IGNORE  # the target rows first, as the graph would order them
        grad_all, grad_t, grad_p = (torch.empty(r, HIDDEN, dtype=torch.bfloat16, device=dev) for r in (rows, n_t, rows))
        persist = PersistHead(rows, dev)
        persist.offsets[1] = n_t
        ms_all = replay_ms(lambda: head_cublas(h, t, w, grad_all), REPLAYS, launches=LAUNCHES)  # noqa: B023
        ms_t = replay_ms(lambda: head_cublas(h[:n_t], t[:n_t], w, grad_t), REPLAYS, launches=LAUNCHES)  # noqa: B023
        ms_p = replay_ms(lambda: persist(h, t, w, grad_p), REPLAYS, launches=LAUNCHES)  # noqa: B023
        grad_p.fill_(float("nan"))  # the checked run must write every row
        loss_all, loss_p, loss_t = (head_cublas(h, t, w, grad_all), persist(h, t, w, grad_p),
                                    head_cublas(h[:n_t], t[:n_t], w, grad_t))
        torch.cuda.synchronize()
        r_p = max(rel(loss_p[:n_t], loss_all[:n_t]), rel(grad_p[:n_t], grad_all[:n_t]))
        r_t = max(rel(loss_t, loss_all[:n_t]), rel(grad_t, grad_all[:n_t]))
        tail_zero = bool(loss_p[n_t:].abs().max().item() == 0 and grad_p[n_t:].abs().max().item() == 0)
        lines.append(f"| {rows} | {n_t} | {ms_all:.3f} | {ms_t:.3f} (rel {r_t:.1e}) | {ms_p:.3f} (tail zero: "
                     f"{tail_zero}) | {ms_all - ms_t:.3f} / {ms_all - ms_p:.3f} | {r_p:.1e} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
