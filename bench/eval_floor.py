"""The least time a task's evaluations can take on the device, from a bench/executor_task.py result (issue 41).

Every evaluation is a no-grad forward of each job's adapter over the shared validation subset: 2 FLOPs per matmul
parameter and token at the least (the LoRA terms and attention add to it). At the device's dense bf16 peak the
task's evaluation tokens take at least `floor` seconds; this prints it beside the training time, the measured
evaluation time and what the 60-step target (wall <= 1.15x training) leaves for everything that is not training.

    python bench/eval_floor.py bench/results/raw/executor_task60_s61_call2_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines import config_matmul_params  # noqa: E402
from engine_step import llama8b_config  # noqa: E402

PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16 (bench/executor_task.py's)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a bench/executor_task.py --json file")
    ap.add_argument("--ratio", type=float, default=1.15, help="the wall / training target")
    args = ap.parse_args()
    res = json.loads(Path(args.result).read_text())
    layers = res["args"]["layers"]
    params = config_matmul_params(llama8b_config(layers))
    for name, run in res["runs"].items():
        calls = run.get("eval_calls") or []
        tokens = sum(c["tokens"] for c in calls)
        floor = 2.0 * params * tokens / (PEAK_TFLOPS * 1e12)
        train = run["phases"]["train"]
        print(f"{name}: {len(calls)} evaluations, {tokens:,} tokens (training: {run['train_tokens']:,}); "
              f"{params / 1e9:.2f}B matmul parameters; at {PEAK_TFLOPS:.0f} TFLOP/s the evaluations take at least "
              f"{floor:.2f} s (measured {run['phases']['eval']:.2f} s) = {floor / train:.1%} of the {train:.2f} s of "
              f"training, against the {args.ratio - 1:.0%} that wall <= {args.ratio}x training leaves for all else")


if __name__ == "__main__":
    main()
