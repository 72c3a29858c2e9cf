"""Where an executor's wall time goes (`PhaseClock`): seconds by phase (load, train, eval,
checkpoint, ...), each phase without the phases nested in it, "idle" the rest; the writer
thread's seconds beside them; the first step's time; and a task's own split since it joined a
warm executor (its phases counted from the clock's readings at its arrival).

A component of trainer.executor.Executor (`executor.clock`): it knows nothing of tasks beyond
the two marks a task carries (`joined_at`, `phases_at_join`) and its first step, nothing of the
device; the executor adds its own numbers (the step count, the memory plan's details) to the
report (Executor.timings)."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from trainer.checkpoint import FileWriter

PHASES = ("load", "profile", "train", "eval", "checkpoint", "export", "admit", "init", "park", "resume",
          "samples")


class Joined(Protocol):
    """What the clock reads and marks of a task (trainer.colocate.TaskRun)."""

    joined_at: float | None
    phases_at_join: dict[str, float]
    first_step_s: float | None


class PhaseClock:
    """One executor's wall time by phase (see the module docstring)."""

    def __init__(self, writer: FileWriter | None) -> None:
        self.writer = writer  # the executor's writer thread, whose busy seconds are reported
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._nested: list[float] = []
        self.started_at: float | None = None
        self.first_step_s: float | None = None  # executor start -> end of the first step
        self.parts: dict[str, float] = {}  # a phase's parts: "<phase>_part_<part>" -> seconds (or a count)

    def start(self) -> float:
        """The executor's loop begins now (its wall counts from here); the time."""
        self.started_at = time.perf_counter()
        return self.started_at

    def step_ended(self, now: float) -> None:
        """A step ended at `now` (perf_counter): the first one's time is kept."""
        if self.first_step_s is None and self.started_at is not None:
            self.first_step_s = now - self.started_at

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self._nested.append(0.0)
        try:
            yield
        finally:
            inner = self._nested.pop()
            elapsed = time.perf_counter() - t0
            self.phases[name] += elapsed - inner
            if self._nested:
                self._nested[-1] += elapsed

    def add_parts(self, phase: str, parts: dict[str, float]) -> None:
        """A phase's own split (e.g. the samples' attach, prefill and token steps), reported beside
        the phases as details: "<phase>_part_<name>"."""
        for name, value in parts.items():
            key = f"{phase}_part_{name}"
            self.parts[key] = self.parts.get(key, 0.0) + value

    def writer_busy(self) -> dict[str, float]:
        return dict(self.writer.busy) if self.writer else dict.fromkeys(("checkpoint", "export"), 0.0)

    def mark_joined(self, task: Joined, at_start: bool) -> None:
        """Where a task's own timings count from: the executor's start for the tasks it started
        with (their wall includes the load), else now (a task that joins a warm host)."""
        task.joined_at = self.started_at if at_start else time.perf_counter()
        task.phases_at_join = {} if at_start else {**self.phases, **self.parts, **{
            f"writer_{k}": v for k, v in self.writer_busy().items()}}

    def split(self, task: Joined | None = None) -> dict[str, Any]:
        """Wall seconds since the start, split by phase (idle: everything else: bookkeeping,
        callbacks, admission), the writer's seconds and the first step's time. With a task: the
        same since that task joined, its own first step, and the host's wall beside it."""
        now = time.perf_counter()
        host_wall = 0.0 if self.started_at is None else now - self.started_at
        since = {} if task is None else task.phases_at_join
        phases = {k: v - since.get(k, 0.0) for k, v in self.phases.items()}
        writer = {k: v - since.get(f"writer_{k}", 0.0) for k, v in self.writer_busy().items()}
        wall = host_wall if task is None or task.joined_at is None else now - task.joined_at
        first = self.first_step_s if task is None else task.first_step_s
        busy = sum(phases.values())
        extra = {} if task is None else {"host_wall": host_wall}  # seconds; a detail, not a phase
        # the phases' parts (details: no "_s" suffix), since the task joined
        extra.update({k: round(v - since.get(k, 0.0), 4) for k, v in self.parts.items()})
        return {"wall_s": wall, **{f"{k}_s": v for k, v in phases.items()},
                "idle_s": max(0.0, wall - busy), "first_step_s": first, **extra,
                # the writer thread's seconds (beside the loop's: checkpoint_s / export_s are
                # the loop's snapshots and waits for the writer)
                **{f"writer_{k}_s": v for k, v in writer.items()}}


@contextmanager
def collecting(parts: dict[str, float]) -> Iterator[None]:
    """parts["gc"] gains the seconds Python's garbage collector ran in the block (any thread's
    collections: the host is one process)."""
    started: list[float] = []

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            parts["gc"] = parts.get("gc", 0.0) + time.perf_counter() - started.pop()

    gc.callbacks.append(timer)
    try:
        yield
    finally:
        gc.callbacks.remove(timer)
