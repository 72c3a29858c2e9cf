"""The sequential baselines' bench (bench/task_e2e_baselines.py, issue 33) still runs end to end
at toy sizes on the CPU: every arm (loraplex's executor with and without early exit, PEFT
padded, PEFT packed, successive halving) on the same data, and its own checks hold (each
baseline's step-0 loss equals the engine's, c3 keeps what (a)'s ranking keeps). A GPU re-run
of the bench must not be the first to find it broken."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_baselines_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "task_e2e_baselines.py"), "--smoke", "--no-liger",
         "--work", str(tmp_path / "work"), "--json", str(out), "--out", str(tmp_path / "smoke.md")],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    q = res["quality"]["0"]
    assert q["check"]["ok"] and res["timing"]["check"]["ok"]
    assert {"a", "b", "c3"} <= set(q) and q["c3"]["keep_same_as_a"] is True
    table = (tmp_path / "smoke.md").read_text()
    for row in ("| (a) loraplex executor, early exit |", "| (c1) PEFT, padded, one at a time |",
                "| (c2) PEFT packed + varlen + Liger + fused AdamW |"):
        assert row in table
