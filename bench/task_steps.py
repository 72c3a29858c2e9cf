"""Where a 200-step task's training time goes, by kind of step, from `bench/executor_task.py --json` files (one
table row a file): the first job set's eager steps, the steps that captured at their start, the steps that
replayed a larger key's capture padded (covered), the plain replays; each kind's steps and seconds, and the
graphs' counts (captures, those the thread made, graphs kept), and the task's evaluation seconds (a lever that
moves work into the evaluations shows there: session 73's capture ahead). "covered over own" sums each covered
step's wall over the median replay of the key it would have run itself (of the same run's plain replays;
`--per-octave`, the run's graph sizes an octave, LORAPLEX_GRAPH_BUCKETS: 4 unless the run set it).

`--first N` prints the first N steps' walls of each file instead (with the first job set's eager steps' sum, the
load worker's first calls (`first_calls_s`, session 67) and the pinner's registrations made in the loop's device
waits, `pool_quiet_pins`).

    python3 bench/task_steps.py [--per-octave 4] [--first N] FILE.json [FILE.json ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from executor_task import mfu_of

from trainer.packing import bucket_up

KINDS = ("eager", "capture", "covered", "replay")


def kind_of(how: str) -> str:
    """A step's kind from the trace's how ("eager_runs", "captures+covered+replays", ...): eager before all,
    then a capture at the step's start, then covered. A step where a capture on the thread began
    ("ahead_thread_started", since session 66; earlier files count those as captures at the start) is the
    kind it is without."""
    thread = "ahead_thread_started" in how
    for word, kind in (("eager", "eager"), ("captures", "capture"), ("covered", "covered")):
        if word in how and not (thread and kind == "capture"):
            return kind
    return "replay"


def covered_over_own(steps: dict[str, list], per_octave: int) -> float:
    """Seconds the covered steps ran over their own keys' median replay (keys with no plain replay left out)."""
    walls: dict[tuple[int, int], list[float]] = {}
    for s in steps["replay"]:
        walls.setdefault((s[1], bucket_up(s[0], per_octave)), []).append(s[3])
    own = {k: statistics.median(v) for k, v in walls.items()}
    return sum(s[3] - own[k] for s in steps["covered"] if (k := (s[1], bucket_up(s[0], per_octave))) in own)


def row(path: str, per_octave: int = 4) -> str:
    res = json.loads(Path(path).read_text())
    run = res["runs"]["cold"]
    steps: dict[str, list] = {k: [] for k in KINDS}
    for s in run["step_trace"]:  # [tokens, jobs, recompute, wall s, ., how, ...]
        steps[kind_of(s[5])].append(s)
    train, tokens, g = run["phases"]["train"], run["train_tokens"], run["graphs"]
    kinds = [f"{len(steps[k])}, {sum(s[3] for s in steps[k]):.2f}" for k in KINDS]
    cells = [os.path.basename(path), f"{tokens / train / 1e3:.2f}k", f"{100 * mfu_of(run, res['args']['layers']):.1f}%",
             f"{train:.2f}", *kinds[:3], f"{covered_over_own(steps, per_octave):.2f}", kinds[3],
             str(g.get("captures", 0)), str(g.get("ahead_thread_made", 0)), str(g.get("graphs", 0)),
             f"{run['phases'].get('eval', 0.0):.2f}"]
    return "| " + " | ".join(cells) + " |"


def first_row(path: str, n: int) -> str:
    """One file's first `n` step walls, its eager steps' seconds, the first calls' seconds and the quiet pins."""
    run = json.loads(Path(path).read_text())["runs"]["cold"]
    trace = run["step_trace"]
    eager = sum(t[3] for t in trace if kind_of(t[5]) == "eager")
    made = ", ".join(f"{s:.2f}" for s in run.get("first_calls_s") or []) or "-"
    cells = [os.path.basename(path), *(f"{t[3]:.3f}" for t in trace[:n]), f"{eager:.2f}", made,
             str((run.get("timings") or {}).get("pool_quiet_pins", "-"))]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-octave", type=int, default=4)
    ap.add_argument("--first", type=int, default=0, help="the first N steps' walls instead")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    if args.first:
        print("| run | " + " | ".join(f"step {i} s" for i in range(args.first))
              + " | eager steps s | first calls s | quiet pins |")
        print("|---|" + "---|" * (args.first + 3))
        for path in args.files:
            print(first_row(path, args.first))
        return
    print("| run | tok/s | MFU | train s | eager: steps, s | captured at start: steps, s | covered: steps, s "
          "| covered over own s | replays: steps, s | captures | the thread's | graphs | evaluation s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in args.files:
        print(row(path, args.per_octave))


if __name__ == "__main__":
    main()
