"""Timing a piece of work as a CUDA graph replays it, for the probes that measure one part of a step (the attention:
bench/attention_varlen.py; the LoRA passes: bench/lora_concat.py)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def replay_ms(fn: Callable[[], object], iters: int, same_stream: bool = False, launches: int = 1) -> float:
    """Median ms of `iters` replays of fn captured as one graph: three warmup runs on a side stream first (what a
    capture of autograd work needs), CUDA events around each replay. `same_stream`: the capture runs on that side
    stream too (a library that keeps per-stream state, such as cuDNN's workspace, then sets it up before the capture).
    `launches`: the graph holds that many calls of fn, and the result is per call (a kernel of a few microseconds
    timed among its own launches, as a step graph runs it, not against the replay's own overhead)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local", **({"stream": side} if same_stream else {})):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times) / launches
