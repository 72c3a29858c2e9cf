"""Which of session 45's three changes lets a failed capture's eager step run (issue 40).

With captures that keep the caching allocator's blocks, session 44's GPU run failed StableLM's and
Nemotron's varlen tests (their layers drop the sequence bounds, so every capture fails and the step
runs eagerly; the eager step's recompute then saved other tensors than its forward). Session 45
landed three changes together and the tests passed: (guard) the positions' host read fails a
capture at once, keeping no bounds; (restore) the stream current before a capture is current
again after a failed one; (empty) a failed capture empties the cache before its eager step. This
runs the two tests (one process a run) with only the changes named in `--on` left in place.

    python bench/capture_failure_variants.py --on guard,restore
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import graph_parts, varlen  # noqa: E402

TESTS = ["tests/gpu/test_families_gpu.py", "-k", "varlen_on_cuda and (stablelm or nemotron)"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--on", default="", help="the changes kept: guard, restore, empty (comma-separated)")
    on = set(filter(None, ap.parse_args().on.split(",")))
    if "guard" not in on:
        varlen._in_capture = lambda t: False
    if "restore" not in on:
        graph_parts.capturing.__exit__ = lambda self, *exc: self._graph.__exit__(*exc)
    if "empty" not in on:  # the tests' device has room: no capture empties the cache but the failed one's
        torch.cuda.empty_cache = lambda: None
    print(f"changes kept: {sorted(on) or 'none'}", flush=True)
    sys.exit(pytest.main(["-q", "-rA", "--tb=line", "-p", "no:cacheprovider", *TESTS]))


if __name__ == "__main__":
    main()
