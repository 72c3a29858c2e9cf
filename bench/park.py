"""Parking a job's state on the host (issue 33: (a) spent 23 s of 198 s parking adapters after
warmup at 32 layers): the old blocking copy into pageable memory against JobRun.to's copy into
pinned memory without waiting, on the Llama-3.1-8B shape's 32 layers (every linear adapted),
ranks 8 / 16 / 64, adapter and AdamW moments in float32 (what the engine holds).

    python bench/park.py --out bench/results/park_h100.md

Per rank: host seconds the loop is blocked (the executor's cost), seconds until the copies are
complete (settle), GB moved and GB/s; medians over --jobs jobs, after one warm-up park per rank.
Fresh: each parked state is kept (host memory newly allocated, as during warmup rotation);
reuse: parked states freed before the next (the host allocator's cache). Every parked copy is
checked equal to the GPU original.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.data import JobDataStream  # noqa: E402
from trainer.jobs import JobRun, TrainJob, make_optimizer  # noqa: E402
from trainer.multilora import JobAdapter  # noqa: E402

H, FF, KV = 4096, 14336, 1024
LAYER = {"q_proj": (H, H), "k_proj": (H, KV), "v_proj": (H, KV), "o_proj": (H, H),
         "gate_proj": (H, FF), "up_proj": (H, FF), "down_proj": (FF, H)}


def make_state(rank: int, seed: int, layers: int) -> JobRun:
    shapes = {f"model.layers.{i}.{n}": s for i in range(layers) for n, s in LAYER.items()}
    spec = TrainJob(f"r{rank}_{seed}", lora_rank=rank, lora_alpha=2 * rank, learning_rate=1e-3, batch_size=1, seed=seed)
    adapter = JobAdapter(shapes, rank, 2 * rank, seed, torch.float32, "cuda")
    opt, sched = make_optimizer(spec, [adapter.flat], 10)
    g = torch.Generator(device="cuda").manual_seed(seed)
    opt.state[adapter.flat] = {"step": torch.tensor(3.0),
                               "exp_avg": torch.randn(adapter.flat.shape, device="cuda", generator=g),
                               "exp_avg_sq": torch.rand(adapter.flat.shape, device="cuda", generator=g)}
    with torch.no_grad():
        adapter.flat.normal_(generator=g)  # never time on zeros
    return JobRun(spec, adapter, opt, sched, JobDataStream(128, seed), 10)


def tensors(st: JobRun) -> list[torch.Tensor]:
    return [st.adapter.flat.data] + [v for v in st.optimizer.state[st.adapter.flat].values() if v.dim() > 0]


def park_legacy(st: JobRun) -> None:
    """What JobRun.to did before: a blocking copy of each tensor into pageable memory."""
    st.adapter.flat.data = st.adapter.flat.data.to("cpu")
    mom = st.optimizer.state[st.adapter.flat]
    for k, v in list(mom.items()):
        if v.dim() > 0:
            mom[k] = v.to("cpu")


def run(way: str, rank: int, jobs: int, keep: bool, layers: int) -> dict:
    host, total, kept, ok = [], [], [], True
    for j in range(jobs + 1):
        st = make_state(rank, j, layers)
        want = [t.clone() for t in tensors(st)]
        nbytes = sum(t.numel() * t.element_size() for t in want)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if way == "legacy":
            park_legacy(st)
        else:
            st.to("cpu")
        t1 = time.perf_counter()
        st.settle()
        t2 = time.perf_counter()
        ok &= all(torch.equal(a.cpu(), b) for a, b in zip(want, tensors(st), strict=True))
        if j:  # the first is the warm-up
            host.append(t1 - t0)
            total.append(t2 - t0)
        del want
        if keep:
            kept.append(st)
        torch.cuda.empty_cache()
    return {"host_s": statistics.median(host), "total_s": statistics.median(total), "gb": nbytes / 1e9,
            "gbps": nbytes / 1e9 / statistics.median(total), "equal": ok}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ranks", default="8,16,64")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    for rank in (int(r) for r in args.ranks.split(",")):
        for way, keep in (("legacy", True), ("pinned async", True), ("pinned async", False)):
            r = run("legacy" if way == "legacy" else "new", rank, args.jobs, keep, args.layers)
            rows.append((rank, way, "fresh" if keep else "reuse", r))
            print(rank, way, keep, r, flush=True)
    lines = [f"# Parking a job's state on the host ({torch.cuda.get_device_name()}; torch {torch.__version__})", "",
             f"Llama-3.1-8B shape, {args.layers} layers, every linear adapted; adapter + AdamW moments in float32; "
             f"medians of {args.jobs} parks after a warm-up park (bench/park.py).", "",
             "| rank | way | host memory | GB | loop blocked s | copies complete s | GB/s | equal |",
             "|---|---|---|---|---|---|---|---|"]
    for rank, way, mem, r in rows:
        lines.append(f"| {rank} | {way} | {mem} | {r['gb']:.2f} | {r['host_s']:.3f} | {r['total_s']:.3f} | "
                     f"{r['gbps']:.1f} | {r['equal']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
