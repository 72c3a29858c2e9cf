"""The memory model's online correction replayed on recorded device steps (issue 41), on the CPU.

Each recorded run (`bench/executor_task.py --json`, `bench/task_e2e_baselines.py`'s search (a), or a
test trace under tests/unit/data) keeps the steps the allocator saw: token cells, recompute, resident
bytes, peak bytes, the predicted bytes, and the arena's elements. This script starts from the analytic
model that a node with no stored model builds for the 8B shape (fused blocks and head, key/value
unexpanded, no recompute, 7 targets, rank tile 64, the arena's bf16 copy counted). It replays
`trainer.memory_model.OnlineCorrection` over the steps with each `--settle` value (the steps before the
envelope fit may replace the line). For each run it prints the largest and smallest relative error
(prediction - peak) / peak; a negative one is an under-prediction.

A run that started from a stored model (a `--reuse` process) does not replay its device's predictions;
the first column says whether the replay matched them.

    python bench/memory_replay.py [--settle 8,4] [FILES...]   (default: the 8B runs under bench/results/raw)
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import LlamaConfig  # noqa: E402

from trainer.head import default_chunk  # noqa: E402
from trainer.memory_model import OnlineCorrection, Shapes, analytic_model, head_bytes  # noqa: E402

CONFIG = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=8)  # Llama-3.1-8B's shape
MB = 1 << 20


def steps_of(path: str) -> list[list]:
    """A run's steps as [cells, recompute, resident, peak, predicted (bytes), arena elements]."""
    d = json.loads(Path(path).read_text())
    if "runs" in d:  # executor_task: bytes
        return [list(s) for run in d["runs"].values() for s in run.get("memory_trace") or []][:10**6]
    rows = (d["timing"].get("a") or {}).get("memory_trace") or [] if "timing" in d else d.get("steps") or []
    # MB, the arena in millions of elements
    if any(len(r) != 6 for r in rows):  # sessions before 39 kept no arena size: not replayed
        return []
    return [[c, r, a * MB, b * MB, p * MB, int(e * 1e6)] for c, r, a, b, p, e in rows]


def replay(steps: list[list], settle: int, margin: float = 1.05) -> list[float]:
    config = LlamaConfig(**CONFIG)
    chunk = default_chunk(config.vocab_size)
    model = analytic_model(config, head_chunk=chunk, max_rank=64, n_targets=7, recompute=False, fused=True,
                           fused_head=True, kv_expanded=False)
    corr = OnlineCorrection(model, head_bytes(Shapes.of(config), 1, True), chunk, floor_of=model.k1,
                            copy_per_param=2.0, settle=settle, margin=margin)
    for i, (cells, recompute, resident, peak, _, arena) in enumerate(steps):
        # what stayed allocated after a step, read from the next one's start (a first step's AdamW moments)
        nxt = steps[i + 1][2] if i + 1 < len(steps) else resident
        corr.observe(cells, bool(recompute), resident, peak, arena, nxt if nxt - resident > 256 * MB else resident)
    return [(p.predicted - p.peak) / p.peak for p in corr.trace]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--settle", default="8,4")
    args = ap.parse_args()
    raw = Path(__file__).resolve().parent / "results" / "raw"
    files = args.files or sorted(glob.glob(str(raw / "search_a_s*_h200.json"))
                                 + glob.glob(str(raw / "executor_task*_s5*_h200.json")))
    settles = [int(v) for v in args.settle.split(",")]
    print("| run | steps | device's max | replay = device | " + " | ".join(f"settle {s}: max / min" for s in settles) + " |")
    print("|---|---|---|---|" + "---|" * len(settles))
    for f in files:
        steps = steps_of(f)
        if not steps:
            continue
        device = [(s[4] - s[3]) / s[3] for s in steps]
        base = replay(steps, 8)
        same = all(abs(a - b) < 5e-4 for a, b in zip(base, device, strict=True))  # MB-rounded traces
        cells = [f"{max(e):.2%} / {min(e):.2%}" for e in (replay(steps, s) for s in settles)]
        print(f"| {Path(f).name} | {len(steps)} | {max(device):.2%} | {'yes' if same else 'no'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
