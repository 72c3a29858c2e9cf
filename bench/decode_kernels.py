"""The kernels of one graphed decode token step (issues 40, 41: the samples' token steps, ~10.6-12 ms
each at 32 rows and 32 layers, are most of a task's samples phase).

On a Llama-3.1-8B-shaped model with random bf16 weights and `--layers` layers, 3 adapters of rank
16/32/64 (B non-zero) and the base over 8 prompts of ~`--prompt-len` tokens (32 rows, as the
executor's samples): `trainer.sampling.generate` twice with `--new` tokens (the second timed, in
parts), then under torch.profiler; the kernel table (by GPU time) divided into token steps, and the
kernels a token step launches by kind. No EOS: every row decodes `--new` tokens.

    python bench/decode_kernels.py [--layers 32] [--new 48] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_probe import three_adapters  # noqa: E402
from engine_step import llama8b_config  # noqa: E402
from task_e2e_data import emit  # noqa: E402

from trainer.sampling import generate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as a node's GPU processes get it
    _, eng, rows = three_adapters(llama8b_config(args.layers), torch.device("cuda"), args.prompt_len)

    def run(parts: dict | None = None) -> list[list[int]]:
        return generate(eng, [p for p, _ in rows], [c for _, c in rows], max_new_tokens=args.new, pad_id=0,
                        parts=parts)

    first = run()
    parts: dict[str, float] = {}
    again = run(parts)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    events = [e for e in prof.events() if e.device_type == cuda]
    # per token step: the whole decode's kernels (the prefill's few large ones included) over its token steps
    steps = max(1, int(parts.get("token_steps", args.new)))
    by_name: Counter[str] = Counter()
    time_us: Counter[str] = Counter()
    for e in events:
        by_name[e.name] += 1
        time_us[e.name] += e.time_range.end - e.time_range.start
    total = sum(time_us.values())
    lines = [f"# One graphed decode token step's kernels ({torch.cuda.get_device_name()}, {args.layers} layers of the "
             f"Llama-3.1-8B shape, random bf16 weights, 32 rows: base + adapters r16/r32/r64 x 8 prompts of "
             f"{args.prompt_len} tokens, {args.new} new tokens)", "",
             f"Greedy rows repeat: {first == again}. Timed decode (second run), parts: "
             + ", ".join(f"{k} {v:.3f}" for k, v in sorted(parts.items())) + ".",
             f"Profiled decode (third run): {len(events)} kernels, {total / 1e3:.1f} ms of kernel time; per token step "
             f"(of {steps}, the prefill's kernels included in the totals): {len(events) / steps:.0f} kernels, "
             f"{total / 1e3 / steps:.2f} ms.", "",
             "| kernel | calls | calls a token step | GPU ms in all | us a call |", "|---|---|---|---|---|"]
    for name, t in time_us.most_common(30):
        n = by_name[name]
        lines.append(f"| {name[:90]} | {n} | {n / steps:.1f} | {t / 1e3:.2f} | {t / n:.1f} |")
    emit("\n".join(lines) + "\n", {}, args)


if __name__ == "__main__":
    main()
