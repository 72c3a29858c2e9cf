"""Triton's one-time key (kernels.triton_warm) computed while the executor loads its backbone, on the
product's one background-thread primitive (contract.background.BackgroundWorker): `start` when the
executor has a CUDA device, `join` before its engine's probes launch the first Triton kernel. The
worker's one step computes the key and stops its loop; where nothing is to be done (a CPU device, a
process that has the key, no Triton) the worker is never started and `join` returns at once."""

from __future__ import annotations

import logging

from contract.background import BackgroundWorker
from kernels import triton_warm

log = logging.getLogger(__name__)


def start(wanted: bool) -> BackgroundWorker:
    """A worker computing Triton's key, started where `wanted` and the process lacks the key."""
    def once() -> None:
        try:
            triton_warm.compute()
        finally:
            worker.stop()  # from inside its step: the loop ends after it

    worker = BackgroundWorker("loraplex-triton-key", once, logger=log)
    if wanted and triton_warm.available() and not triton_warm.cached():
        worker.start()
    return worker
