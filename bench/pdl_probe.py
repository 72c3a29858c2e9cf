"""What programmatic dependent launch (PDL) would save a replayed step's small kernels (issue 40, next lever).

A replayed 2-job step at 32 layers is ~3,000 graph nodes, most of them small kernels: the LoRA passes run at
5-20 us a kernel against a bytes floor of 0.7-10 us (bench/lora_sweep.py, session 52), and a replay's wall
exceeds the summed kernel time by ~5 ms. On Hopper, a kernel launched with PDL may start while the kernel
before it drains: its programs run up to `griddepcontrol.wait` (Triton: `tl.extra.cuda.gdc_wait()`), which
returns once the previous grid has finished and its writes are visible; the previous grid may let it start
early with `gdc_launch_dependents()`.

This probe captures a chain of dependent kernels (each reads what the one before wrote: y = a * x + b) into
one CUDA graph, with and without PDL, at a step's sizes (a [1536, 4096] bf16 activation, 12.6 MB; a
[1536, 64] fp32 LoRA buffer; a 4 KB one), and reports the replay's microseconds per kernel, the
saving, and whether both chains end with the values torch's own ops give (fp32 math, stored in the tensor's dtype).

    python3 bench/pdl_probe.py [--kernels 400] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # an older Triton: the probe reports it and times the plain chain only
    HAS_GDC = False

    @triton.jit
    def gdc_wait() -> None:
        pass

    @triton.jit
    def gdc_launch_dependents() -> None:
        pass


@triton.jit
def _affine(x_ptr, y_ptr, n, a, b, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()  # the next kernel's programs may start; they wait below before reading
        gdc_wait()  # the previous kernel's writes (this kernel's input) are complete and visible
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, (x.to(tl.float32) * a + b).to(y_ptr.dtype.element_ty), mask=mask)


def _coefs(i: int) -> tuple[float, float]:
    """Kernel i's (a, b): two steps, (0.5 x + 1) then (2 y - 2), restore x exactly in binary floats."""
    return (0.5, 1.0) if i % 2 == 0 else (2.0, -2.0)


def _chain(x: torch.Tensor, y: torch.Tensor, kernels: int, pdl: bool, block: int) -> None:
    n = x.numel()
    grid = (triton.cdiv(n, block),)
    src, dst = x, y
    for i in range(kernels):
        a, b = _coefs(i)
        kw = {"launch_pdl": True} if pdl else {}
        _affine[grid](src, dst, n, a, b, BLOCK=block, PDL=pdl, **kw)
        src, dst = dst, src


def _graph_us(x0: torch.Tensor, kernels: int, pdl: bool, block: int, reps: int = 20) -> tuple[float, torch.Tensor]:
    x, y = x0.clone(), torch.empty_like(x0)
    _chain(x, y, 2, pdl, block)  # compile outside the capture
    torch.cuda.synchronize()
    x.copy_(x0)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        _chain(x, y, kernels, pdl, block)
    x.copy_(x0)
    graph.replay()  # the values: kernels is even, so the chain ends in x
    torch.cuda.synchronize()
    out = x.clone()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / kernels)
    return sorted(times)[len(times) // 2], out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=400, help="kernels in the chain (even)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernels = args.kernels + args.kernels % 2
    cases = [("activation [1536, 4096] bf16 (12.6 MB)", (1536, 4096), torch.bfloat16, 4096),
             ("LoRA buffer [1536, 64] fp32 (393 KB)", (1536, 64), torch.float32, 1024),
             ("metadata [1024] fp32 (4 KB)", (1024,), torch.float32, 1024)]
    lines = [f"# Programmatic dependent launch on a chain of {kernels} dependent kernels in one CUDA graph "
             f"({torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__})", "",
             f"Triton has gdc_wait / gdc_launch_dependents: {HAS_GDC}. Medians of 20 replays.", "",
             "| tensor | plain us a kernel | PDL us a kernel | saved us a kernel | plain = torch's chain | PDL = torch's chain |",
             "|---|---|---|---|---|---|"]
    for name, shape, dtype, block in cases:
        torch.manual_seed(0)
        x0 = torch.randn(shape, device="cuda").to(dtype)
        plain, out_plain = _graph_us(x0, kernels, False, block)
        ref = x0.clone()
        for i in range(kernels):
            a, b = _coefs(i)
            ref = (ref.float() * a + b).to(dtype)
        ok_plain = bool(torch.equal(out_plain, ref))
        if HAS_GDC:
            pdl, out_pdl = _graph_us(x0, kernels, True, block)
            lines.append(f"| {name} | {plain:.2f} | {pdl:.2f} | {plain - pdl:.2f} | {ok_plain} | "
                         f"{bool(torch.equal(out_pdl, ref))} |")
        else:
            lines.append(f"| {name} | {plain:.2f} | - | - | {ok_plain} | - |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    sys.exit(main())
