"""The tables of a `bench/ncu_passes.py` run from its two exported files: per pass, its launch (grid, block),
duration, registers, shared memory, occupancy, memory throughput and issue rate (from the details page), and its
warps' top stall reasons by PC sampling (from the raw page's `smsp__pcsamp_warps_issue_stalled_*` counts).

    python3 bench/ncu_passes_report.py DETAILS.txt RAW.csv.gz
"""

from __future__ import annotations

import csv
import gzip
import io
import re
import sys

HEAD = re.compile(r"  \S.*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")
FIELDS = ("Duration", "Registers Per Thread", "Dynamic Shared Memory Per Block", "Theoretical Occupancy",
          "Achieved Occupancy", "Memory Throughput", "Executed Ipc Active")


def _field(block: str, label: str) -> str:
    m = re.search(r"\n\s+" + re.escape(label) + r"\s+(\S+)\s+([\d,.]+)", block)
    return f"{m.group(2)} {m.group(1)}" if m else "?"


def main() -> None:
    details, raw = sys.argv[1], sys.argv[2]
    text = open(details).read()  # noqa: SIM115
    starts = [m.start() for m in HEAD.finditer(text)]
    blocks = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
    rows = list(csv.reader(io.TextIOWrapper(gzip.open(raw), encoding="utf-8", errors="replace")))
    hdr, data = rows[0], rows[2:]
    stall = [i for i, h in enumerate(hdr) if "pcsamp_warps_issue_stalled" in h and not h.endswith("not_issued")]
    print("| pass | kernel | grid x block | " + " | ".join(FIELDS) + " | top stalls (share of samples) |")
    print("|---|---|---|" + "---|" * len(FIELDS) + "---|")
    for block, r in zip(blocks, data, strict=True):
        head = block.split("\n")[0].strip()
        if "FillFunctor" in head:  # the split shrink's zero-fill of P (its pre_hook)
            continue
        name = head.split("/")[0].strip()
        kernel = re.search(r"/(\w+)", head).group(1)
        grid = re.search(r"\((\d+, \d+, \d+)\)x\((\d+)", head)
        vals = []
        for i in stall:
            try:
                vals.append((float(r[i].replace(",", "")), hdr[i].split("stalled_")[-1]))
            except ValueError:
                pass
        total = sum(v for v, _ in vals) or 1.0
        top = ", ".join(f"{n} {100 * v / total:.0f}%" for v, n in sorted(vals, reverse=True)[:4])
        print(f"| {name} | {kernel} | ({grid.group(1)}) x {grid.group(2)} | "
              + " | ".join(_field(block, f) for f in FIELDS) + f" | {top} |")


if __name__ == "__main__":
    main()
