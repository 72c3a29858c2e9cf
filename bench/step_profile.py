"""Chosen training steps of a task under torch.profiler (`bench/executor_task.py --profile-steps 0,1,10,11`): where
a step's host time goes when it runs over its peers' pace. Session 66 measured the 200-step task's first two steps
~0.5 s and its two steps after the ranking (each a capture at its start) ~0.8 s over the pace of the steps around
them, and the allocator's growth at ~20 ms of it (bench/alloc_growth.py). Each profiled step writes one text
file: its host seconds (the step as the product runs it) and with the device synced after it, then the ops by
their own CPU time and the kernels by their device time. The profiler's recording slows the host a little.

    PROFILE["steps"] = {0, 1}; PROFILE["prefix"] = "/out/profile"   (bench/executor_task.py sets them)
    out = profiled(index, step_call)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PROFILE: dict[str, Any] = {"steps": set(), "prefix": "", "rows": 30}


def profiled(index: int, call: Callable[[], Any]) -> Any:  # noqa: ANN401
    """`call()` (a training step), under torch.profiler when `index` is one of PROFILE["steps"]."""
    if index not in PROFILE["steps"] or not PROFILE["prefix"]:
        return call()
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        out = call()
        host = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
        synced = time.perf_counter() - t0
    table = prof.key_averages()
    rows = PROFILE["rows"]
    text = [f"# training step {index}: host {host:.4f} s, with the device synced after it {synced:.4f} s", "",
            "## ops by their own CPU time", "", table.table(sort_by="self_cpu_time_total", row_limit=rows)]
    if cuda:
        text += ["## kernels by their device time", "", table.table(sort_by="self_cuda_time_total", row_limit=rows)]
    Path(f"{PROFILE['prefix']}_step{index}.txt").write_text("\n".join(text) + "\n")
    return out
