"""Intra-task admission: a peak-memory model M = k0 + k1*B*L fitted from a short profiling run,
and the policy that decides which pending jobs attach to the executor (torch only lazily, on CUDA).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol


class JobLike(Protocol):
    """What the policy needs to know about a job (pending or running)."""

    @property
    def job_id(self) -> str: ...

    @property
    def batch_size(self) -> int: ...


class ProfilePoint(NamedTuple):
    """One profiling measurement: peak bytes of one training step at this total batch."""

    total_batch: int
    seq_len: int
    peak_bytes: int


@dataclass(frozen=True)
class MemoryModel:
    """Peak memory of one training step: k0 (weights, states, workspace) + k1 bytes per token."""

    k0: float
    k1: float

    def predict(self, total_batch: int, seq_len: int) -> float:
        """Predicted peak bytes for `total_batch` sequences of `seq_len` tokens."""
        return self.k0 + self.k1 * total_batch * seq_len

    def max_total_batch(self, budget_bytes: float, seq_len: int) -> int:
        """Largest total batch whose predicted peak is <= budget_bytes (0 if none fits)."""
        if self.k1 <= 0:
            raise ValueError("k1 must be > 0 for a batch limit to exist")
        b = math.floor((budget_bytes - self.k0) / (self.k1 * seq_len))
        # Guard the float division at the boundary: the predicate is what admission checks.
        while b > 0 and self.predict(b, seq_len) > budget_bytes:
            b -= 1
        while self.predict(b + 1, seq_len) <= budget_bytes:
            b += 1
        return max(b, 0)


def fit_memory_model(points: Sequence[tuple[int, int, float]]) -> MemoryModel:
    """Least-squares fit of peak = k0 + k1 * (B * L) over (total_batch, seq_len, peak_bytes)."""
    xs = [float(b) * float(seq) for b, seq, _ in points]
    ys = [float(peak) for _, _, peak in points]
    if len(set(xs)) < 2:
        raise ValueError("need measurements at two or more distinct B*L to fit a memory model")
    mx = math.fsum(xs) / len(xs)
    my = math.fsum(ys) / len(ys)
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    k1 = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    if k1 <= 0:
        raise ValueError(f"peak memory does not grow with the batch (k1={k1:.3g}): bad profile")
    return MemoryModel(k0=my - k1 * mx, k1=k1)


def profile_memory(
    step_fn: Callable[[int], Any],
    batches: Iterable[int],
    seq_len: int,
    *,
    device: Any = None,
    repeats: int = 2,
) -> list[ProfilePoint]:
    """Run `step_fn(total_batch)` (one full training step) at each total batch on a CUDA device
    and record the peak of `torch.cuda.max_memory_allocated`.

    Each batch runs `repeats` times and keeps the largest peak, so lazily created optimizer
    state is counted. Stops at the first out-of-memory error and returns what it measured.
    On a machine without CUDA it raises RuntimeError: use a configured budget there.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("profile_memory needs CUDA; on CPU use AdmissionController.from_token_budget")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    points: list[ProfilePoint] = []
    for total_batch in batches:
        peak = 0
        try:
            for _ in range(repeats):
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                step_fn(total_batch)
                torch.cuda.synchronize(device)
                peak = max(peak, torch.cuda.max_memory_allocated(device))
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            break
        points.append(ProfilePoint(int(total_batch), int(seq_len), int(peak)))
    return points


class AdmissionController:
    """Decides which pending jobs of a task attach to the executor, under a memory budget.

    Policy (docs/architecture.md, "Hierarchical scheduling"):
    - Memory depends on the *total* batch B of all co-resident jobs (one backbone forward/backward
      over the concatenated batch) and the sequence length L; adapter weights and their optimizer
      state are small against activations and are part of the fit's noise, so rank is ignored.
    - `admit` is first-fit decreasing: pending jobs whose batch size is already running go first
      (co-location of equal batch sizes keeps the grouped LoRA kernels on their bmm path), then the
      other sizes by decreasing batch size (equal sizes stay together); a job that does not fit is
      skipped and smaller ones are still tried. Input order breaks ties, so the result is
      deterministic.
    - `backfill` after an exit tries pending jobs of the exited job's batch size first, then the
      others in the same order as `admit`.
    - The predicted peak must stay <= safety * budget; the margin (default 0.9) covers allocator
      fragmentation (the fit is on `max_memory_allocated`, not reserved memory) and fit error.
    - On a CPU nothing is profiled: `AdmissionController.from_token_budget` runs the same policy
      against a configured number of tokens per step (k0 = 0, k1 = 1 "byte" per token).
    """

    def __init__(
        self,
        model: MemoryModel,
        budget_bytes: float,
        seq_len: int,
        safety: float = 0.9,
        max_jobs: int | None = None,
        resident: Callable[[], float] | None = None,
        state_bytes: Callable[[JobLike], float] | None = None,
    ) -> None:
        if not (0.0 < safety <= 1.0):
            raise ValueError(f"safety must be in (0, 1], got {safety}")
        if budget_bytes <= 0 or seq_len < 1:
            raise ValueError("budget_bytes must be > 0 and seq_len >= 1")
        if max_jobs is not None and max_jobs < 1:
            raise ValueError("max_jobs must be >= 1 when set")
        self.model = model
        self.budget_bytes = float(budget_bytes)
        self.seq_len = int(seq_len)
        self.safety = float(safety)
        self.max_jobs = max_jobs
        # live form (one GPU, trainer.memory_model): what is resident now (the backbone, attached
        # and device-parked states) is read at each decision, each job adds its state, and the
        # model's k0 is the step's fixed transient only
        self.resident = resident
        self.state_bytes = state_bytes

    @classmethod
    def from_token_budget(
        cls, max_tokens: int, seq_len: int, max_jobs: int | None = None
    ) -> AdmissionController:
        """CPU form: at most `max_tokens` = total_batch * seq_len tokens per step."""
        return cls(MemoryModel(k0=0.0, k1=1.0), float(max_tokens), seq_len, 1.0, max_jobs)

    @property
    def limit_bytes(self) -> float:
        return self.safety * self.budget_bytes

    @property
    def headroom(self) -> float:
        """The limit less what is resident now (live form; the whole limit otherwise)."""
        return self.limit_bytes - (self.resident() if self.resident is not None else 0.0)

    def max_total_batch(self) -> int:
        """The largest total batch (sequences of seq_len) a training step may hold."""
        return self.model.max_total_batch(self.headroom, self.seq_len)

    def fits(self, total_batch: int, added_bytes: float = 0.0) -> bool:
        """Whether a step over this total batch (with `added_bytes` of new jobs' states) is
        predicted to stay under the safety limit."""
        return self.model.predict(total_batch, self.seq_len) + added_bytes <= self.headroom

    def _state(self, job: JobLike) -> float:
        return self.state_bytes(job) if self.state_bytes is not None else 0.0

    def unschedulable(self, pending: Iterable[JobLike]) -> list[str]:
        """Pending jobs that would not fit even alone on an empty executor."""
        return [j.job_id for j in pending if not self.fits(j.batch_size, self._state(j))]

    def admit(self, pending: Sequence[JobLike], running: Sequence[JobLike]) -> list[str]:
        """Job ids to attach now, in attach order (see the module docstring for the order)."""
        running_sizes = {j.batch_size for j in running}
        return self._fill(pending, running, lambda b: (b not in running_sizes, -b))

    def backfill(
        self, exited_batch_size: int, pending: Sequence[JobLike], running: Sequence[JobLike]
    ) -> list[str]:
        """Job ids to attach after a job of `exited_batch_size` left (`running` excludes it)."""
        running_sizes = {j.batch_size for j in running}
        return self._fill(
            pending, running,
            lambda b: (b != exited_batch_size, b not in running_sizes, -b),
        )

    def _fill(
        self,
        pending: Sequence[JobLike],
        running: Sequence[JobLike],
        priority: Callable[[int], tuple[Any, ...]],
    ) -> list[str]:
        total = sum(j.batch_size for j in running)
        slots = math.inf if self.max_jobs is None else self.max_jobs - len(running)
        order = sorted(enumerate(pending), key=lambda item: (*priority(item[1].batch_size), item[0]))
        chosen: list[str] = []
        added = 0.0
        headroom = self.headroom  # read once: the decision is about now
        for _, job in order:
            if len(chosen) >= slots:
                break
            if job.batch_size < 1:
                raise ValueError(f"job {job.job_id} has batch_size {job.batch_size}")
            state = self._state(job)
            if self.model.predict(total + job.batch_size, self.seq_len) + added + state <= headroom:
                chosen.append(job.job_id)
                total += job.batch_size
                added += state
        return chosen


# ----- stored memory profiles: measured once per model, sequence length and GPU kind -----------
def profile_key(**parts: Any) -> str:
    """The identity of a memory profile: every input its peaks depend on (the model directory
    and its config file's content, max_seq_len, GPU name, torch version, method, targets, ...),
    as one canonical JSON string; any difference is another profile."""
    import json

    return json.dumps(parts, sort_keys=True, default=str)


def load_profile(path: str | Path | None, key: str) -> MemoryModel | None:
    """The stored memory model under `key` in the JSON file at `path`, or None (no file, no such
    key, or an unreadable file: a profile is only a cache, the executor then measures again)."""
    import json

    if path is None:
        return None
    try:
        entry = json.loads(Path(path).read_text()).get(key)
        if entry is None or not float(entry["k1"]) > 0 or not float(entry["k0"]) >= 0:
            return None  # none, or no model (a slope of 0 admits any batch): built again
        return MemoryModel(float(entry["k0"]), float(entry["k1"]))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def store_profile(path: str | Path | None, key: str, model: MemoryModel) -> None:
    """Add (or replace) one profile in the JSON file at `path`, keeping the others; written to a
    temporary file and renamed, so a concurrent reader sees the old or the new file, never half."""
    import json
    import os
    import tempfile
    import time

    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        table = json.loads(path.read_text())
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    table[key] = {"k0": model.k0, "k1": model.k1, "measured_at": time.time()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".profiles-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


# a step split into passes without recompute (RecomputePolicy.passes): no pass under this many
# tokens (a smaller one leaves the GPU waiting on the host's launches) and at most this many passes
MIN_PASS_TOKENS = 4096
MAX_PASSES = 16


_PREDICTING = threading.local()


@contextmanager
def predicting() -> Iterator[None]:
    """While this thread works out a coming step's key (trainer.graph_ahead._step_key, for the captures made ahead):
    no RecomputePolicy releases the parked states, whatever hook asks it (a prediction is about a step that may
    never run; the step itself decides again). Such a step is predicted to recompute or split."""
    was = getattr(_PREDICTING, "on", False)
    _PREDICTING.on = True
    try:
        yield
    finally:
        _PREDICTING.on = was


@dataclass(frozen=True)
class RecomputePolicy:
    """Activation recompute only where it is needed: a step runs without it when the memory model
    measured without recompute predicts its total batch fits under the limit; admission still
    sizes the executor by the model with recompute (the wider one), so choosing never costs a
    job its place. With one GPU only (ranks of adapter parallelism must make the same passes)."""

    without: MemoryModel  # measured (or built, trainer.memory_model) with recompute off
    limit_bytes: float
    seq_len: int
    resident: Callable[[], float] | None = None  # the live form: what is resident now
    # of that, bytes that can leave on demand (states parked on the device while they wait for a
    # ranking), and what sends them to the host (whether any moved): a step that fits without
    # recompute only without them has them moved first (session 33: the search's warmup steps
    # recomputed beside 10.6 GB of them, 7.5-9.4k tok/s against 13k for its steps that did not)
    spare: Callable[[], float] | None = None
    release: Callable[[], bool] | None = None

    def recompute(self, total_batch: int) -> bool:
        """Whether a step over `total_batch` sequences of seq_len tokens needs recompute."""
        return self.recompute_tokens(total_batch * self.seq_len)

    def recompute_tokens(self, tokens: int, padding: float = 1.25) -> bool:
        """Whether a step of `tokens` sequence tokens needs recompute (its row padded by up to
        `padding`: the packing's buckets and a replayed larger capture)."""
        if tokens <= self.room_tokens(padding):
            return False
        return not self._released_for(tokens, padding)

    def room_tokens(self, padding: float = 1.25, spare: bool = False) -> float:
        """The most sequence tokens one pass without recompute fits now (padded by `padding`;
        with `spare`: were the spare bytes gone)."""
        now = self.resident() if self.resident is not None else 0.0
        if spare and self.spare is not None:
            now -= self.spare()
        return (self.limit_bytes - now - self.without.k0) / max(self.without.k1 * padding, 1e-9)

    def _released_for(self, tokens: int, padding: float) -> bool:
        """Whether the spare bytes were released so that one pass of `tokens` fits without recompute
        (they are only where it would then fit, and for a step of MIN_PASS_TOKENS or more: a
        smaller one recomputes for less than the states' trip to the host and back costs; an H200
        search's 1.7k-token step sent 31 GB of them there, pinning memory for 9.7 s). Never while this
        thread predicts a coming step (`predicting`)."""
        if (self.release is None or self.spare is None or tokens < MIN_PASS_TOKENS or getattr(_PREDICTING, "on", False)
                or not self.spare()):
            return False
        return tokens <= self.room_tokens(padding, spare=True) and self.release()

    def passes(self, job_tokens: Sequence[int], padding: float = 1.25) -> list[list[int]] | None:
        """Where one pass over a step's jobs (their sequence tokens) needs recompute: the jobs
        (indices) in passes that each fit without it, run one after another (a pass keeps only its
        own activations; recompute repeats every layer's forward, a third more compute). First
        fit by size, so the passes are few and even. None: one pass (it fits; or a job alone does
        not, or passes would be under MIN_PASS_TOKENS each or over MAX_PASSES: recompute then)."""
        room = self.room_tokens(padding)
        if not job_tokens or sum(job_tokens) <= room:  # one pass fits (recompute_tokens' rule)
            return None
        if self._released_for(sum(job_tokens), padding):  # one pass fits once the spare bytes left
            return None
        if room < MIN_PASS_TOKENS or max(job_tokens) > room:
            return None
        groups: list[list[int]] = []
        sizes: list[int] = []
        for i in sorted(range(len(job_tokens)), key=lambda i: -job_tokens[i]):
            k = next((k for k, n in enumerate(sizes) if n + job_tokens[i] <= room), None)
            if k is None:
                groups.append([])
                sizes.append(0)
                k = len(groups) - 1
            groups[k].append(i)
            sizes[k] += job_tokens[i]
        if len(groups) > MAX_PASSES:
            return None
        return [sorted(g) for g in groups]
