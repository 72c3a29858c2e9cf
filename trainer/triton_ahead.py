"""The load's background worker: Triton's one-time key (kernels.triton_warm) and the first calls of the step's
small torch ops, both while the executor loads its backbone, on the product's one background-thread primitive
(contract.background.BackgroundWorker): `start` when the executor has a CUDA device, `join` before its engine's
probes launch the first Triton kernel. The worker's one step does what is due and stops its loop; where nothing
is (a CPU device, a process that has the key and `FIRST_CALLS` off, no Triton) the worker is never started and
`join` returns at once.

First calls: a fresh process's first call of some ops costs tens of milliseconds of host time for microseconds
on the device (a module of kernels loaded lazily, a cuBLAS library set up), and the first training step paid
them. In session 66's profile of the 200-step task's step 0: the rotary embedding's fp32 `aten::bmm` 54-57 ms,
`aten::where` 17-24 ms, `aten::gather` 12 ms, a first `aten::sum` and `_foreach_norm` ~10 ms each; in a bare
process (bench/first_calls.py, session 67) the bmm 61 ms, where 23, gather 50, ge + sum 16. A module once
loaded serves every thread, so this thread loads them beside the weights' reads ($LORAPLEX_FIRST_CALLS=0: not)."""

from __future__ import annotations

import logging
import os
import time

import torch

from contract.background import BackgroundWorker
from kernels import triton_warm

log = logging.getLogger(__name__)

FIRST_CALLS = os.environ.get("LORAPLEX_FIRST_CALLS", "1") != "0"
MADE: list[float] = []  # seconds of each `first_calls` a worker of this process made (benchmarks read it)


def first_calls(device: torch.device, tokens: int = 256) -> None:
    """One small call of each op whose first call in a process is slow (the module docstring), on `device`;
    their shapes need not be the step's (a second shape costs ~0.2 ms: bench/first_calls.py)."""
    inv = torch.rand(1, 64, 1, device=device)
    pos = torch.arange(tokens, device=device, dtype=torch.float32)[None, None, :]
    freqs = (inv @ pos).transpose(1, 2)  # the rotary embedding's fp32 batched GEMM (autocast off)
    torch.cat((freqs, freqs), dim=-1).cos()
    ids = torch.randint(0, 1000, (tokens,), device=device)
    mask = ids >= 500
    torch.where(mask, ids, -100)
    losses = torch.rand(tokens, device=device)
    kept = torch.where(torch.isfinite(losses), losses, torch.zeros_like(losses))
    kept.sum()
    (ids >= 3).sum()
    torch.gather(losses[:, None].expand(tokens, 8).contiguous(), 1, (ids % 8)[:, None])
    torch._foreach_norm([losses, kept])
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # their launches done before the thread ends


def start(wanted: bool, device: torch.device | None = None) -> BackgroundWorker:
    """A worker computing Triton's key (where `wanted` and the process lacks it) and making the first calls on a
    CUDA `device` (where `wanted` and FIRST_CALLS), started where either is due."""
    key = wanted and triton_warm.available() and not triton_warm.cached()
    calls = wanted and FIRST_CALLS and device is not None and device.type == "cuda"

    def once() -> None:
        try:
            if key:
                triton_warm.compute()
            if calls:
                try:
                    began = time.perf_counter()
                    first_calls(device)
                    MADE.append(round(time.perf_counter() - began, 4))
                except Exception as err:  # noqa: BLE001 - a warm-up only: the step makes these calls anyway
                    log.info("first calls not made ahead: %s", err)
        finally:
            worker.stop()  # from inside its step: the loop ends after it

    worker = BackgroundWorker("loraplex-triton-key", once, logger=log)
    if key or calls:
        worker.start()
    return worker
