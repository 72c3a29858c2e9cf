"""The executor's own host time per step, outside the engine's step (issue 40): what the loop's
bookkeeping (admission checks, each task's events and curves, due evaluations, the warmup policy,
checkpoints due, the writer's flush) costs while the GPU waits for the next step's launch.

On the CPU with executor_task's toy sizes (2 layers, 8 jobs of ranks 16/32/64, the product's
defaults): each loop iteration's wall between the clock's step ends, minus the engine's step inside
it (`MemoryPlan.train_step`). Python's bookkeeping costs about what it costs beside a GPU, so a
median of a fraction of a millisecond means a step launched ahead of it (the next step's replay
before the bookkeeping) could hide at most that: the idle of a graphed 2-job step (~5 ms of ~125 ms on
an H200, bench/step_gaps.py) is elsewhere. Iterations that evaluated or admitted are reported apart.

    python bench/executor_host.py [--steps 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import executor_task as et  # noqa: E402
import task_e2e_data as te  # noqa: E402

from trainer.memory_plan import MemoryPlan  # noqa: E402
from trainer.phase_clock import PhaseClock  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--work", default="/tmp/executor_host")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    te.SMOKE["on"] = True
    root = Path(args.work)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    model_dir = te.large_model(root / "model", 2, te.make_tokenizer())
    train, val = et.write_data(root / "train.jsonl", 200, 1), et.write_data(root / "val.jsonl", 16, 2)
    inside: list[float] = []  # the engine's step, per iteration
    ends: list[float] = []  # the clock's step ends
    train_step, step_ended = MemoryPlan.train_step, PhaseClock.step_ended

    def timed(self):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        try:
            return train_step(self)
        finally:
            inside.append(time.perf_counter() - t0)

    def ended(self, now: float):  # noqa: ANN001, ANN202
        ends.append(now)
        return step_ended(self, now)

    MemoryPlan.train_step, PhaseClock.step_ended = timed, ended
    t0 = time.perf_counter()
    res = et.run(model_dir, train, val, root / "out", args.steps, root / "profiles.json", graphs=True,
                 evaluation="product")
    wall = time.perf_counter() - t0
    outside = [(b - a) - t for a, b, t in zip(ends[:-1], ends[1:], inside[1:], strict=False)]
    plain = sorted(outside)[: max(1, len(outside) * 3 // 4)]  # the iterations that neither evaluated nor admitted
    lines = ["# The executor's host time per step outside the engine (CPU, executor_task's toy sizes: 2 layers, "
             "8 jobs)", "",
             f"{len(inside)} steps in {wall:.1f} s; phases {({k: round(v, 2) for k, v in res['phases'].items()})}.", "",
             "| iterations | median ms | p90 ms |", "|---|---|---|",
             f"| the engine's step (`MemoryPlan.train_step`) | {statistics.median(inside) * 1e3:.2f} | "
             f"{sorted(inside)[int(0.9 * (len(inside) - 1))] * 1e3:.2f} |",
             f"| outside it, every iteration | {statistics.median(outside) * 1e3:.2f} | "
             f"{sorted(outside)[int(0.9 * (len(outside) - 1))] * 1e3:.2f} |",
             f"| outside it, the lower three quarters | {statistics.median(plain) * 1e3:.2f} | "
             f"{max(plain) * 1e3:.2f} |"]
    te.emit("\n".join(lines) + "\n", {}, args)


if __name__ == "__main__":
    main()
