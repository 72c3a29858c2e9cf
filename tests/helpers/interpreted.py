"""Kernel checks under Triton's interpreter in a child process (TRITON_INTERPRET=1 there alone, so
neither the flag nor a process-wide swap leaks into other tests): `run_interpreted(body)` runs
PREAMBLE + body from the repository root and returns the dict the body leaves in `out`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# what every worker starts with: torch seeded, `out` for its results, `rel` (relative error in float64)
PREAMBLE = r"""
import json
import torch
torch.manual_seed(0)
out = {}
def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item() if b.numel() else 0.0
"""
EPILOGUE = '\nprint("RESULT" + json.dumps(out))\n'


def run_interpreted(body: str, timeout_s: float = 600) -> dict[str, Any]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", PREAMBLE + body + EPILOGUE], capture_output=True, text=True,
                          env=env, timeout=timeout_s, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])
