"""Fuzz the co-location path of the scheduler on many random states (a developer tool; CI runs a
few hundred through tests/unit/test_colocation_fuzz.py). The states, the call sequence and the
invariants are tests/helpers/colocation_fuzz.py's.

usage: python scripts/dev/fuzz_colocation.py [N] [SEED] [--weird] [--dup-reports] [--stop-first]
       [--verbose]     (--stop-first re-runs the first failing state and shows its traceback)
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.colocation_fuzz import check, options, replan, run, state  # noqa: E402


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0]) if args else 200
    seed0 = int(args[1]) if len(args) > 1 else 0
    weird, dup = "--weird" in sys.argv, "--dup-reports" in sys.argv
    stop, verbose = "--stop-first" in sys.argv, "--verbose" in sys.argv

    def on_fail(seed: int, kind: str) -> bool:
        if stop or verbose:
            print("seed", seed, kind)
        return stop

    report = run(n, seed0, weird, dup, on_fail)
    print(f"{report.states} states from seed {seed0} in {report.seconds:.0f}s weird={weird}")
    print("failures:", dict(report.fails))
    print("first seed per failure:", report.examples)
    print("info:", dict(report.info))
    if stop and report.examples:  # the first failure again, raising: its traceback
        w, unit = state(min(report.examples.values()), weird, dup)
        check(w, replan(w, options(unit)), Counter(), unit)


if __name__ == "__main__":
    main()
