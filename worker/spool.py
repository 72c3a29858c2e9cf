"""The spool: a JSON-lines file in a placement's folder that its executor appends reports to
and the daemon forwards from (worker.forwarder). Only complete lines count, so a writer killed
mid-line loses at most that line.

Records, one JSON object per line, in the order the executor produced them:
  {"type": "event", "event": EventIn fields (no client_key: the forwarder sets one)}
  {"type": "metric", "point": MetricPointIn fields}
  {"type": "job_state", "job_id": ..., "update": JobStateUpdate fields but placement_id}
  {"type": "artifact", "dir": "<dir under the placement dir>", "meta": ArtifactMeta fields but
   placement_id}
  {"type": <kind>, "report": fields of REPORTS[kind].message but placement_id (the
   forwarder's)}: throughput, timings, finished, failed (contract.protocol.REPORTS; a record
   of an older writer may carry finished/failed fields beside "type")
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from contract.protocol import REPORTS

SPOOL_NAME = "spool.jsonl"
TERMINAL_TYPES = ("finished", "failed")


class SpoolWriter:
    """Executor side: append one record per line and flush+fsync, so a record the executor
    wrote survives the executor's death (the daemon forwards it later)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "ab")
        if self._fh.tell() > 0 and not _ends_with_newline(path):
            self._fh.write(b"\n")  # a torn line of a killed writer: close it, it is skipped

    def write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":"), default=str)
        self._fh.write(line.encode() + b"\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def event(self, type_: str, message: str = "", job_id: str | None = None,
              level: str = "info", data: dict | None = None) -> None:
        self.write({"type": "event", "event": {"type": type_, "message": message,
                                               "job_id": job_id, "level": level, "data": data}})

    def metric(self, job_id: str, step: int, split: str, loss: float,
               data: dict | None = None, usage: tuple[int, float] | None = None) -> None:
        """usage: a train point's (tokens, GPU-seconds); its fields are left out without it."""
        point = {"job_id": job_id, "step": step, "split": split, "loss": loss, "data": data}
        if usage is not None:
            point["tokens"], point["gpu_seconds"] = usage
        self.write({"type": "metric", "point": point})

    def job_state(self, job_id: str, **update: Any) -> None:
        self.write({"type": "job_state", "job_id": job_id, "update": update})

    def artifact(self, directory: str, **meta: Any) -> None:
        self.write({"type": "artifact", "dir": directory, "meta": meta})

    def throughput(self, *, gpus: int, seq_len: int, batch_sizes: Sequence[int],
                   tokens_per_s: float, samples_per_s: float | None = None,
                   memory_k0: float | None = None, memory_k1: float | None = None) -> None:
        """What the executor measured on its GPUs since its last report (ThroughputReport fields
        but placement_id). Numbers are made plain ints/floats here: the executor may hand over
        numpy or torch scalars, which JSON would otherwise turn into strings."""
        def number(x: float | None) -> float | None:
            return None if x is None else float(x)

        self.report("throughput", {
            "gpus": int(gpus), "seq_len": int(seq_len),
            "batch_sizes": [int(b) for b in batch_sizes], "tokens_per_s": float(tokens_per_s),
            "samples_per_s": number(samples_per_s), "memory_k0": number(memory_k0),
            "memory_k1": number(memory_k1)})

    def finished(self, best_job_id: str | None = None, summary: dict | None = None) -> None:
        self.report("finished", {"best_job_id": best_job_id, "summary": summary})

    def failed(self, error: str, retryable: bool = True, detail: str | None = None) -> None:
        """`error` is shown to the tenant (short, no paths); `detail` only to operators."""
        self.report("failed", {"error": error[:10_000], "retryable": retryable,
                               "detail": detail[-20_000:] if detail else None})

    def report(self, kind: str, fields: dict) -> None:
        """A one-message report (contract.protocol.REPORTS[kind]): its message's fields but
        placement_id (the forwarder's)."""
        if kind not in REPORTS:
            raise ValueError(f"unknown report {kind!r}")
        self.write({"type": kind, "report": fields})

    def close(self) -> None:
        self._fh.close()


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def read_complete_lines(path: Path, offset: int, max_lines: int = 1000
                        ) -> list[tuple[int, int, str]]:
    """(start offset, end offset, text) of complete lines from offset on."""
    if not path.exists():
        return []
    out: list[tuple[int, int, str]] = []
    with open(path, "rb") as fh:
        fh.seek(offset)
        pos = offset
        while len(out) < max_lines:
            line = fh.readline()
            if not line.endswith(b"\n"):
                break
            out.append((pos, pos + len(line), line.decode("utf-8", "replace").strip()))
            pos += len(line)
    return out

