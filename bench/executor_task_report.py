"""A short reading of `bench/executor_task.py --json` files: per run the phases, the step graphs' stats (the
capture ahead's counters included), the captured and eager steps, the evaluations and, with --sync-probe,
each evaluation group's host time, module loads, allocator counts and where its host stalled (the largest
gap between the probe's marks: decoder layers, the final norm, the group's end).

    python bench/executor_task_report.py FILE.json [FILE.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from executor_task import mfu_of  # noqa: E402


def stall(marks: list) -> str:
    """The largest gap between consecutive marks: 'L3 -> L4 0.912 s' (host seconds)."""
    if len(marks) < 2:
        return "-"
    gaps = [(b[1] - a[1], a[0], b[0]) for a, b in zip(marks, marks[1:], strict=False)]
    gap, a, b = max(gaps)
    return f"{a} -> {b} {gap:.3f} s (first mark {marks[0][0]} at {marks[0][1]:.3f} s)"


def report(path: str) -> None:
    data = json.loads(Path(path).read_text())
    layers = data["args"]["layers"]
    for name, r in data["runs"].items():
        ph, g = r["phases"], r.get("graphs") or {}
        steps = r["step_trace"]
        busy = {k: round(v, 2) for k, v in ph.items() if v > 0.05}
        print(f"{Path(path).name} [{name}] wall {r['wall_s']:.2f} s, first step {r['first_step_s']:.2f} s, "
              f"{r['train_tokens'] / ph['train'] / 1e3:.2f}k tok/s (MFU {mfu_of(r, layers):.1%}); phases {busy}")
        print(f"  graphs {g}")
        odd = [(i, s[1], s[3], s[5]) for i, s in enumerate(steps) if "capture" in s[5] or "eager" in s[5]]
        print(f"  captured / eager steps (index, jobs, s, how): {odd}")
        kinds: dict[str, list[float]] = {}  # a step with a capture (its own, or the next one's) counts as one
        for s in steps:
            kind = "captures" if "capture" in s[5] else s[5]
            kinds.setdefault(kind, []).append(s[3])
        sums = ", ".join(f"{k} {len(v)} steps {sum(v):.2f} s" for k, v in sorted(kinds.items()))
        print(f"  steps by kind: {sums}; all {len(steps)} steps {sum(s[3] for s in steps):.2f} s")
        print(f"  evaluations (jobs, step, s): {[(e['jobs'], e['step'], e['s']) for e in r.get('eval_calls', [])]}")
        for p in r.get("eval_probe") or []:
            print(f"  probe: {p['jobs']} jobs x {p['examples']}: host {p['host_s']} s, busy after {p['busy_after']}, "
                  f"loads {p['loads']}, syncs {p['n_syncs']}, allocator {p.get('allocator')}; "
                  f"stall {stall(p.get('marks') or [])}")
            for line in p.get("syncs", [])[:3]:
                print(f"    sync: {line}")


if __name__ == "__main__":
    for f in sys.argv[1:]:
        report(f)
