"""The small pieces a task on an executor is made of: the engine's pool of every hosted task's
examples, a job's data stream at its task's offset, a started job as every rank knows it, and
what one step measured; and what a task may use of the executor that hosts it (`TaskExecutor`)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from trainer.data import JobDataStream

if TYPE_CHECKING:  # the executor's parts as a task sees them (no import at run time)
    import torch

    from trainer.admission import AdmissionController, MemoryModel
    from trainer.checkpoint import FileWriter
    from trainer.engine import MultiLoraEngine
    from trainer.sft import Sft
    from trainer.strategy import Strategy


class ExamplePool(Sequence):
    """The engine's train examples: every hosted task's examples, each task's at its own base
    index (bases are never reused, so a stale index can never read another task's example)."""

    def __init__(self) -> None:
        self._bases: list[int] = []
        self._parts: list[Sequence[Any]] = []
        self._end = 0

    def add(self, examples: Sequence[Any]) -> int:
        base = self._end
        self._bases.append(base)
        self._parts.append(list(examples))
        self._end += len(examples)
        return base

    def remove(self, base: int) -> None:
        k = self._bases.index(base)
        del self._bases[k], self._parts[k]

    def __len__(self) -> int:
        return self._end

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        k = bisect.bisect_right(self._bases, i) - 1
        if k < 0 or i - self._bases[k] >= len(self._parts[k]):
            raise IndexError(f"example {i} belongs to no hosted task")
        return self._parts[k][i - self._bases[k]]


class TaskStream:
    """A job's data order over its own task's examples (the JobDataStream of a job trained alone,
    so the order and the checkpointed position are the same), read at the task's base."""

    def __init__(self, inner: JobDataStream, base: int) -> None:
        self.inner, self.base = inner, base

    def next_indices(self, batch_size: int) -> list[int]:
        return [self.base + i for i in self.inner.next_indices(batch_size)]

    def state_dict(self) -> dict[str, int]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.inner.load_state_dict(state)


@dataclass
class JobSlot:
    """A started job as every rank knows it: its owner rank and its step count (the JobRun
    itself lives on the owner only)."""

    job_id: str
    owner: int
    batch_size: int
    step: int
    total_steps: int

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps


def fresh(queue: Sequence[Any]) -> list[Any]:
    """A task's queue's configurations that never started (TrainJob), not its started jobs'
    slots: what admission places first and what a park may make room for."""
    return [q for q in queue if not isinstance(q, JobSlot)]


@dataclass
class StepNumbers:
    """What one executor step measured (all hosted jobs): its seconds, real tokens, samples, the
    padded fraction and the batch mix."""

    seconds: float
    tokens: int
    samples: int
    padded: float
    batch_sizes: list[int]
    # usage: the executor's GPU-seconds since its previous step (wall time x GPUs, loading and
    # evaluations included, idle waits not), split between the step's jobs by their tokens
    gpu_seconds: float = 0.0
    job_tokens: int = 0  # all jobs' sequence tokens of the step (the split's denominator)


@dataclass
class ThroughputWindow:
    """Training throughput since the last report: steps, seconds, real tokens, samples."""

    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    samples: int = 0
    padded: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)  # the mix trained at the last step

    def add(self, n: StepNumbers) -> None:
        self.steps += 1
        self.seconds += n.seconds
        self.tokens += n.tokens
        self.samples += n.samples
        self.batch_sizes = n.batch_sizes
        self.padded.append(n.padded)


class TaskExecutor(Protocol):
    """What a task (trainer.colocate.TaskRun, and its files, trainer.task_files.TaskFiles) uses
    of the executor hosting it (trainer.executor.Executor): nothing else, so a change on either
    side shows here."""

    engine: MultiLoraEngine  # attach, detach, slots.park_target, evaluation
    objective: Sft  # the method's objective (trainer.objectives): data, validation, checkpointed numbers
    strategy: Strategy  # gather, contain, collect_parts
    writer: FileWriter | None  # the writes off the loop (one rank)
    pool: ExamplePool  # every hosted task's train examples
    admission: AdmissionController
    memory_model: MemoryModel | None
    device: torch.device
    rank: int
    world: int

    def phase(self, name: str) -> AbstractContextManager[None]: ...

    def rank_batch(self, rank: int) -> int: ...

    def eval_shape(self, n_jobs: int, n_examples: int | None = None, floor: int | None = None,
                   lengths: Sequence[int] | None = None) -> tuple[int, int]: ...

    def eval_room(self, tokens: int) -> None: ...

    def evaluation(self, run: Callable[[], tuple[Any, int]]) -> Any: ...

    def log_state(self, task_id: str, job_id: str, state: str, details: dict) -> None: ...


