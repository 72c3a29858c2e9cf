"""A graphed small step's host pieces on the CPU (issue 40): the packing, the fill and the update launch.

The engine on a tiny random Llama (tests.helpers.engine_ref) with its step graphs on the CPU's stand-in
(`graph_parts.Replay`: a replay runs the captured body again), 2 jobs (rank 16 batch 1, rank 64 batch 4) on
samples of 145-435 tokens (~1.4-1.7k tokens a step, as the 200-step task's 2-job steps). The host's pieces do
not depend on the model's size: `graph_parts.step_key` (the packing), `StepGraphs._fill` (the pinned mirror and its
copy), `update_jobs` (the updates decided on the host) and `_report`, medians over `--steps` steps after a warm-up.
On a GPU, `bench/step_gap.py` times the same pieces beside the graph's launch and the sync.

    python3 bench/step_host_cpu.py [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=15)
    args = ap.parse_args()
    from host_profile import attach_pair, samples
    from step_gap import Clock, _wrap
    from transformers import AutoModelForCausalLM

    import trainer.step_update as step_update
    from tests.helpers.engine_ref import tiny_model_dir
    from trainer import graph_parts, graph_thread
    from trainer.engine import MultiLoraEngine

    torch.set_num_threads(1)
    graph_thread.ON = False  # captures inline: the thread's timing is the GPU's question
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", Path(tempfile.mkdtemp())), dtype=torch.float32)
    eng = MultiLoraEngine(model, samples(64, 145, 435, 3, 250), 0, gradient_checkpointing=False, attention="varlen",
                          step_graphs=True)
    attach_pair(eng)
    for _ in range(args.warmup):
        eng.step()
    clock = Clock()
    pieces = ((graph_parts, "step_key"), (eng.step_graphs, "_fill"), (step_update, "update_jobs"), (eng, "_report"))
    for owner, name in pieces:
        _wrap(owner, name, f"{name}_start", f"{name}_end", clock)
    tokens = []
    for _ in range(args.steps):
        tokens.append(eng.step().tokens)
        clock.close()
    print(f"{args.steps} steps, tokens a step median {statistics.median(tokens):.0f}; graphs {eng.step_graphs.stats()}")
    for _, name in pieces:
        ms = [(m[f"{name}_end"] - m[f"{name}_start"]) * 1e3 for m in clock.steps if f"{name}_end" in m]
        print(f"{name}: {statistics.median(ms):.3f} ms (median)")


if __name__ == "__main__":
    main()
