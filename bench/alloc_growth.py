"""What the caching allocator's growth costs a step: the 200-step task's first steps made 57 and 143 new device
segments (cudaMallocs) and its first captures 226 and 122 (bench/results/session65_h200.md, section 3), and those
steps ran 0.1-0.5 s over their peers. This times the same bytes taken as many segments against one: each form in a
fresh allocator state (its cache emptied, the device synced), the host's time of the allocations, the device synced
after, medians over repeats. If one segment of the bytes costs far less than many, reserving a step's predicted
peak (or a capture pool's) in one piece off the critical path is worth building; if the cost follows the bytes, it
is not.

    python3 bench/alloc_growth.py [--segments 143] [--mib 100] [--repeats 5] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _timed(sizes: list[int], device: torch.device, reserve: int = 0) -> tuple[float, float, int]:
    """Seconds to allocate tensors of `sizes` bytes from an empty cache (each kept until all are made), the
    seconds of a `reserve`-byte block taken and freed to the cache first (0: none), and the device segments the
    allocator made for the tensors."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    if reserve:
        block = torch.empty(reserve, dtype=torch.uint8, device=device)
        del block
        torch.cuda.synchronize(device)
    reserved = time.perf_counter() - t0
    before = torch.cuda.memory_stats(device).get("segment.all.allocated", 0)
    t0 = time.perf_counter()
    held = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    made = torch.cuda.memory_stats(device).get("segment.all.allocated", 0) - before
    del held
    return seconds, reserved, made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--segments", type=int, default=143)
    ap.add_argument("--mib", type=int, default=100, help="each segment's size in MiB (over the 20 MiB large-block bound)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    device = torch.device("cuda")
    one = args.mib << 20
    pieces = [one] * args.segments
    forms = {  # name: (sizes, reserved first)
        f"{args.segments} segments of {args.mib} MiB": (pieces, 0),
        f"1 segment of {args.segments * args.mib} MiB": ([one * args.segments], 0),
        f"{args.segments} x {args.mib} MiB split from 1 reserved segment": (pieces, one * args.segments),
    }
    rows = []
    for name, (sizes, reserve) in forms.items():
        runs = [_timed(sizes, device, reserve) for _ in range(args.repeats + 1)][1:]  # the first warms the driver
        rows.append((name, statistics.median(r[0] for r in runs) * 1e3, statistics.median(r[1] for r in runs) * 1e3,
                     runs[-1][2]))
    torch.cuda.empty_cache()
    lines = [f"# The allocator's growth ({torch.cuda.get_device_name(device)}, torch {torch.__version__}; medians of "
             f"{args.repeats})", "", "| form | allocation ms | reservation ms (apart) | new segments |", "|---|---|---|---|"]
    lines += [f"| {n} | {a:.2f} | {r:.2f} | {m} |" for n, a, r, m in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
