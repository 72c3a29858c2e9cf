"""A 200-step task's replayed steps by size, from `bench/executor_task.py --json` files: per range of step tokens
(the graph keys' 256-row steps), how many replayed steps and their median wall, to set beside the same keys'
replays back to back (`bench/host_profile.py`, `bench/step_gap.py`): what a step spends beyond its graph.

    python3 bench/replay_walls.py FILE.json [FILE.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys


def main() -> None:
    for path in sys.argv[1:]:
        run = json.load(open(path))["runs"]["cold"]  # noqa: SIM115
        replays = [s for s in run["step_trace"] if s[5] == "replays"]  # [tokens, jobs, ., wall s, ., how, ...]
        by: dict[int, list] = {}
        for s in replays:
            by.setdefault(-(-s[0] // 256) * 256, []).append(s)
        cells = [f"{k - 255}-{k} tokens: {len(v)} steps, median {statistics.median(x[3] for x in v) * 1e3:.1f} ms "
                 f"(median {statistics.median(x[0] for x in v):.0f} tokens)" for k, v in sorted(by.items())]
        print(f"{path}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
