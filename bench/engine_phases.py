"""Where an engine step's time goes: phases timed with a device sync between them (packing, layout,
backbone forward, per-job losses, backward, per-job update), plus a torch.profiler table of one
step, on N layers of the Llama-3.1-8B shape with J jobs at batch 1, seq 1024, ranks 16/32/64.

Usage (CUDA): python bench/engine_phases.py [N_LAYERS=8] [JOBS=8]
The before/after numbers quoted in bench/results/engine_step_h100.md came from this script.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_step import RANKS, SEQ, floor_step, llama8b_config  # noqa: E402

from trainer.data import Example  # noqa: E402
from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402
from trainer.packing import pack_step  # noqa: E402


def med(fn, iters: int = 5, warmup: int = 2) -> float:  # noqa: ANN001
    """Median wall seconds of fn() with a device sync after each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with dev:
        model = AutoModelForCausalLM.from_config(llama8b_config(layers), dtype=torch.bfloat16)
    model.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    data = torch.randint(0, 128256, (n, SEQ), generator=torch.Generator().manual_seed(0))
    ids = data.to(dev)
    print("floor", med(lambda: floor_step(model, ids)))
    examples = [Example(tuple(r.tolist()), tuple(r.tolist())) for r in data]
    eng = MultiLoraEngine(model, examples, pad_id=0, adapter_dtype=torch.bfloat16)
    for i in range(n):
        eng.attach(TrainJob(f"j{i}", lora_rank=RANKS[i % 3], lora_alpha=2 * RANKS[i % 3], learning_rate=1e-4, batch_size=1,
                           max_steps=10**6, seed=i))
    print("step", med(eng.step))
    states = list(eng.jobs.values())
    per_job = [[examples[i]] for i in range(n)]

    def phases() -> dict[str, float]:
        t: dict[str, float] = {}

        def mark(name: str, t0: float) -> float:
            torch.cuda.synchronize()
            now = time.perf_counter()
            t[name] = now - t0
            return now

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch = pack_step(per_job, 0, pack=True).to(dev)
        t0 = mark("pack", t0)
        length = batch.input_ids.shape[1]
        eng.slots.set_layout(states, [r * length for r in batch.row_offsets])
        t0 = mark("layout", t0)
        h = eng.hidden(batch)
        t0 = mark("fwd_backbone", t0)
        sums = [eng._job_loss_sum(h[i : i + 1], batch.targets[i : i + 1])[0] for i in range(n)]
        t0 = mark("loss", t0)
        torch.stack(sums).sum().backward()
        mark("backward", t0)
        eng.slots.clear_layout()
        t0 = time.perf_counter()
        eng._update(states, [1.0] * n, batch)
        mark("update", t0)
        return t

    for _ in range(2):
        phases()
    runs = [phases() for _ in range(5)]
    for k in runs[0]:
        print(k, round(statistics.median(r[k] for r in runs), 4))

    def nolora_forward() -> None:
        with torch.no_grad():
            batch = pack_step(per_job, 0, pack=True).to(dev)
            h = eng.hidden(batch)
            for i in range(n):
                eng._job_loss_sum(h[i : i + 1], batch.targets[i : i + 1])

    print("nolora fwd-only", med(nolora_forward))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
