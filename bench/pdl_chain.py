"""What Programmatic Dependent Launch (PDL) saves at a kernel boundary inside a CUDA graph, on this GPU.

A replayed 2-job step is ~2,600 graph nodes, most of them small dependent kernels (the LoRA passes, norms, rope).
Each boundary costs the device a drain of one grid and the ramp of the next. With PDL (sm_90+) the next grid is
launched before the previous one ends; its programs wait in `griddepcontrol.wait` until the previous grid's writes
are visible, so what it does before the wait (a prologue that reads no output of the previous kernel) and the
launch itself overlap the previous grid's tail.

This script times a chain of L dependent Triton kernels (each reads the previous one's output, so a missed wait
shows as a wrong result), captured in one CUDA graph, with and without PDL, at three sizes a kernel. A prologue of
metadata reads (the work-list search our LoRA passes run first: offsets, ranks, a cumulative sum) precedes the wait.
Every chain's output is checked against its input + L (each link adds 1, exact in float32).

    python3 bench/pdl_chain.py [--launches 400] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _link(x_ptr, y_ptr, meta_ptr, n, N_META: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """y = x + 1 (+ the program's work-list index from the prologue, times 0): exact in float32 for integer x, so a
    link that read its input before the previous link wrote it leaves the chain's sum short."""
    pid = tl.program_id(0)
    idx = tl.arange(0, N_META)
    ends = tl.cumsum(tl.load(meta_ptr + idx), 0)  # the prologue: reads nothing the previous grid writes
    item = tl.sum((ends <= pid).to(tl.int32), 0)
    if GDC:
        gdc_wait()
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if GDC:
        gdc_launch_dependents()
    tl.store(y_ptr + offs, x + (item * 0).to(tl.float32) + 1.0, mask=mask)


def chain(bufs, meta, n: int, launches: int, pdl: bool, block: int = 1024) -> None:
    grid = (triton.cdiv(n, block),)
    for i in range(launches):
        src, dst = bufs[i % 2], bufs[(i + 1) % 2]
        kw = {"launch_pdl": True} if pdl else {}
        _link[grid](src, dst, meta, n, N_META=meta.numel(), BLOCK=block, GDC=pdl, **kw)


def timed(n: int, launches: int, pdl: bool, reps: int = 20) -> tuple[float, bool]:
    """Median µs a kernel over `reps` replays of one graph of `launches` links, and whether a replay's output is
    exactly its input + launches."""
    dev = torch.device("cuda")
    meta = torch.full((16,), 64, dtype=torch.int32, device=dev)
    bufs = [torch.randint(0, 1000, (n,), device=dev).float(), torch.empty(n, device=dev)]
    start = bufs[0].clone()
    chain(bufs, meta, n, 4, pdl)  # compile outside the capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        bufs[0].copy_(start)
        with torch.cuda.graph(g, stream=s):
            chain(bufs, meta, n, launches, pdl)
    torch.cuda.synchronize()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / launches)
    bufs[0].copy_(start)
    g.replay()
    torch.cuda.synchronize()
    return statistics.median(times), bool(torch.equal(bufs[launches % 2], start + launches))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=400)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("pdl_chain: needs an sm_90+ GPU")
    rows = []
    print(f"{torch.cuda.get_device_name()}: {args.launches} dependent links in one CUDA graph, median of 20 replays")
    print("| floats a link (MB read + written) | plain us a link | PDL us a link | saved us a link | exact (plain / PDL) |")
    print("|---|---|---|---|---|")
    for n in (1 << 16, 1 << 20, 1 << 22):
        plain, plain_ok = timed(n, args.launches, False)
        pdl, pdl_ok = timed(n, args.launches, True)
        rows.append(dict(n=n, plain_us=plain, pdl_us=pdl, plain_exact=plain_ok, pdl_exact=pdl_ok))
        print(f"| {n} ({8 * n / 1e6:.1f}) | {plain:.2f} | {pdl:.2f} | {plain - pdl:.2f} | {plain_ok} / {pdl_ok} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), launches=args.launches, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
