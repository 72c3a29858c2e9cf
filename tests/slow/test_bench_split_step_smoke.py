"""bench/split_step.py (issue 40: one pass with recompute against passes without, by pass size)
runs at toy sizes on the CPU in float64, and its own check holds: every arm's losses and gradient
norms from the same adapters and data equal the first arm's. A GPU run must not be the first to
find it broken."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_split_step_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "split.md"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "split_step.py"), "--smoke", "--jobs", "6", "--batch", "2",
         "--seq", "32", "--passes", "1r,1,2,3,6", "--warmup", "1", "--iters", "2", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = out.read_text()
    for row in ("| one pass, recompute | 384 |", "| 2 passes, no recompute | 192 |", "| 6 passes, no recompute | 64 |"):
        assert row in table
    assert "out of memory" not in table and table.count("vs the first arm: rel") == 5
