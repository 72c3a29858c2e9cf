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
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=15)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    import trainer.step_update as step_update
    from tests.helpers.engine_ref import tiny_model_dir
    from trainer import graph_parts, graph_thread
    from trainer.data import Example
    from trainer.engine import MultiLoraEngine
    from trainer.jobs import TrainJob

    torch.set_num_threads(1)
    graph_thread.ON = False  # captures inline: the thread's timing is the GPU's question
    gen = torch.Generator().manual_seed(1)
    data = []
    for _ in range(64):
        n = int(torch.randint(145, 435, (), generator=gen))
        ids = torch.randint(3, 250, (n,), generator=gen).tolist()
        data.append(Example(tuple(ids), tuple([-100] * (n // 3) + ids[n // 3:])))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", Path(tempfile.mkdtemp())), dtype=torch.float32)
    eng = MultiLoraEngine(model, data, 0, gradient_checkpointing=False, attention="varlen", step_graphs=True)
    eng.attach(TrainJob("a", lora_rank=16, lora_alpha=32, learning_rate=1e-4, batch_size=1, max_steps=10**6, seed=1))
    eng.attach(TrainJob("b", lora_rank=64, lora_alpha=128, learning_rate=1e-4, batch_size=4, max_steps=10**6, seed=2))
    for _ in range(args.warmup):
        eng.step()
    times: dict[str, list[float]] = {}

    def wrap(owner: object, name: str) -> None:
        own = getattr(owner, name)

        def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return own(*a, **k)
            finally:
                times.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)

        setattr(owner, name, timed)

    for owner, name in ((graph_parts, "step_key"), (eng.step_graphs, "_fill"), (step_update, "update_jobs"),
                        (eng, "_report")):
        wrap(owner, name)
    tokens = [eng.step().tokens for _ in range(args.steps)]
    print(f"{args.steps} steps, tokens a step median {statistics.median(tokens):.0f}; graphs {eng.step_graphs.stats()}")
    for name, v in times.items():
        print(f"{name}: {statistics.median(v):.3f} ms (median)")


if __name__ == "__main__":
    main()
