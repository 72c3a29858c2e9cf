"""The step graphs' parts (trainer.step_graphs): a capture's key, its device buffers, its entry, and
whether the device has the memory a capture needs. A capture's private pool takes memory the device
has free or the graphs' pool already holds; the blocks the caching allocator keeps for eager steps
are not its, and empty_cache cannot give back a segment a live tensor still splits. Session 34's
search (a) on an H100 tried three captures with 0.2 GB free on the device (45 GB allocated): each ran
out of memory, and their keys ran eagerly for the rest of the search (21 eager steps where 6 had)."""
from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

# a capture deferred for want of free device memory is tried again after this many steps
CAPTURE_RETRY_STEPS = 8
# a capture keeps the caching allocator's blocks where the device's free memory holds its pool's
# estimated need this many times over (`has_room`; LORAPLEX_CAPTURE_ROOM=inf: never, as torch does)
ROOM_FACTOR = float(os.environ.get("LORAPLEX_CAPTURE_ROOM", "2"))
# A graph's padding tail belongs to no job (its device offsets end at the step's real tokens): the LoRA
# passes skip its rows and the persistent fused GEMM its row tiles, a padded row a third of the cost it had as
# the last job's (bench/results/session47_h200.md). LORAPLEX_FREE_PADDING=0: the padding is the last job's rows
FREE_PADDING = os.environ.get("LORAPLEX_FREE_PADDING", "1") != "0"
# a graph's row lengths per doubling of its tokens (StepGraphs.per_octave): fewer keys (captures, ~0.3 s each)
# for more padding, which FREE_PADDING makes cheaper; LORAPLEX_GRAPH_BUCKETS (a power of two) to measure it
GRAPH_BUCKETS = max(1, int(os.environ.get("LORAPLEX_GRAPH_BUCKETS", "4")))
# a key's step inputs reach the device from a pinned host mirror kept with its buffers (`Static.load`);
# LORAPLEX_PINNED_STAGING=0: from a fresh pinned copy each step (torch's pin_memory), as before session 51
PINNED_STAGING = os.environ.get("LORAPLEX_PINNED_STAGING", "1") != "0"


def has_room(device: torch.device | int, need: float | None) -> bool:
    return need is not None and torch.cuda.mem_get_info(device)[0] >= ROOM_FACTOR * need


def make_room(device: torch.device, need: float | None) -> None:
    """Before a capture: the caching allocator's blocks go back to the device (the capture's private
    pool can then take that memory) unless it `has_room` for the pool's estimated `need`. Emptied
    before every capture (torch.cuda.graph's own habit), the eager steps after it allocate them all
    again: an H200's capture at 32 layers of the 8B shape spent ~110 ms of its ~300 ms over a replay
    in 740 cudaFree and 392 cudaMalloc calls (bench/capture_anatomy.py, session 44)."""
    torch.cuda.synchronize(device)
    if not has_room(device, need):
        torch.cuda.empty_cache()


def _nothing() -> None:
    return None


class capturing:  # noqa: N801 - a context manager, named as torch.cuda.graph is
    """torch.cuda.graph's capture as it is (its capture stream, pool and error mode), except that
    - where the device `has_room` for `need`, its emptying of the caches on entry is skipped;
    - with sync=False its entry neither syncs, empties nor collects: only the capture stream and
      capture_begin (no process-wide function is swapped: another thread may sync meanwhile);
    - the stream current before it is current again after it, a failed capture included:
      torch.cuda.graph's exit ends the capture before it leaves its stream, so when that end
      raises (a capture invalidated inside) its capture stream stays the thread's current one.
    A class, not a generator: a failed capture's exception then holds no frame of ours.
    `body_s` and `end_s`: the seconds of the captured host pass and of the capture's end (the graph's
    instantiation), for the step graphs' stats."""

    def __init__(self, graph: torch.cuda.CUDAGraph, pool: Any = None, mode: str = "thread_local",
                 need: float | None = None, sync: bool = True) -> None:
        self._graph = torch.cuda.graph(graph, pool=pool, capture_error_mode=mode)
        self._need = need
        self._sync = sync  # False: no device sync on entry (a capture ahead, beside queued work: trainer.graph_ahead)
        self._stream: torch.cuda.Stream | None = None
        self.body_s = self.end_s = self._entered = 0.0

    def __enter__(self) -> None:
        self._stream = torch.cuda.current_stream()
        if not self._sync:  # torch.cuda.graph's entry without its sync, emptying and collection
            g = self._graph
            g.stream_ctx.__enter__()
            try:
                g.cuda_graph.capture_begin(*g.pool, capture_error_mode=g.capture_error_mode)
            except BaseException:
                g.stream_ctx.__exit__(None, None, None)
                raise
            self._entered = time.perf_counter()
            return
        saved = torch.cuda.empty_cache, torch._C._host_emptyCache
        if has_room(self._stream.device, self._need):
            torch.cuda.empty_cache = torch._C._host_emptyCache = _nothing
        try:
            self._graph.__enter__()
        finally:
            torch.cuda.empty_cache, torch._C._host_emptyCache = saved
        self._entered = time.perf_counter()

    def __exit__(self, *exc: Any) -> bool | None:
        started = time.perf_counter()
        self.body_s = started - self._entered
        try:
            return self._graph.__exit__(*exc)
        finally:
            torch.cuda.set_stream(self._stream)
            self.end_s = time.perf_counter() - started


def pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def step_key(eng: Any, per_octave: int, states: Sequence[Any], per_job: Sequence[Sequence[Any]], train: bool,
             seq_cap: int | None = None) -> tuple[GraphKey, Any, list[int]]:
    """The key a step of these jobs over these examples runs (before its recompute decision), its host
    batch packed as the step packs it and the jobs' arena offsets. The key's max_len is the longest
    sequence so far: `seq_cap` (default the engine's) grown to this step's longest."""
    from trainer.packing import pack_flat

    lengths = [len(e.input_ids) for seqs in per_job for e in seqs]
    cap = max(eng.seq_cap if seq_cap is None else seq_cap, max(lengths, default=1))
    cpu = pack_flat(per_job, eng.pad_id, per_octave=per_octave, max_cells=len(lengths) * cap, max_len=cap)
    ints = eng.slots.layout_offsets(states)
    return shaped_key(eng, states, ints, cpu.input_ids.shape[1], len(cpu.cu_seqlens) - 1, cap, train), cpu, ints


def lengths_key(eng: Any, per_octave: int, states: Sequence[Any], ints: Sequence[int], lengths: Sequence[int],
                train: bool, seq_cap: int) -> GraphKey:
    """`step_key`'s key from the step's sequence lengths alone (no batch packed: trainer.graph_ahead's
    many steps), `ints` the jobs' arena offsets."""
    from trainer.packing import flat_length, flat_sequences

    cap, total = max(seq_cap, max(lengths, default=1)), sum(lengths)
    tokens = flat_length(total, per_octave, len(lengths) * cap)
    return shaped_key(eng, states, ints, tokens, flat_sequences(len(lengths), total, tokens, cap), cap, train)


def shaped_key(eng: Any, states: Sequence[Any], ints: Sequence[int], tokens: int, n_seqs: int, cap: int,
               train: bool) -> GraphKey:
    return GraphKey(tokens=tokens, seq_slots=pow2(n_seqs, 16), job_slots=pow2(len(states), 8),
                    rank=pow2(max(s.adapter.rank for s in states), 16), max_len=cap,
                    aligned=all(v % 16 == 0 for v in ints), recompute=eng.gradient_checkpointing and train, train=train)


@dataclass(frozen=True)
class GraphKey:
    """What one capture fixes: shapes and the constants its kernels were specialised for."""

    tokens: int        # T of the flat row
    seq_slots: int     # sequence bounds (cu_seqlens has seq_slots + 1 entries)
    job_slots: int     # job slots (empty ones own no tokens)
    rank: int          # the rank tile r_max (>= every job's rank)
    max_len: int       # longest sequence the attention is launched for
    aligned: bool      # every arena offset a multiple of 16 elements (vector loads)
    recompute: bool    # activation recompute on
    train: bool = True  # the training step (forward and backward); False: an evaluation forward

    @property
    def warm_class(self) -> tuple:
        """Keys of one class launch the same kernels (other token and sequence counts): once one
        of them ran eagerly (compiling, loading and looking up every kernel, creating the
        backward's handles), any other is captured at its first step."""
        return (self.job_slots, self.rank, self.max_len, self.aligned, self.recompute, self.train)


class Static:
    """One key's device buffers: the step's inputs (refilled by one copy per step) and the
    graph's outputs per job slot (training: [mean loss, -]; evaluation: [loss sum, hit sum])."""

    def __init__(self, key: GraphKey, n_layers: int, device: torch.device) -> None:
        t, s, n = key.tokens, key.seq_slots, key.job_slots
        self.sizes = [t, t, t, t, s + 1, n_layers * n, n_layers * n, n, n + 1]
        self.ints = torch.zeros(sum(self.sizes), dtype=torch.int64, device=device)
        ids, pos, tgt, job, cu, aoff, boff, ranks, offsets = self.ints.split(self.sizes)
        self.input_ids, self.position_ids = ids.view(1, t), pos.view(1, t)
        self.targets, self.job_of_token, self.offsets = tgt, job, offsets
        self.cu, self.ranks = cu, ranks
        self.a_off, self.b_off = aoff.view(n_layers, n), boff.view(n_layers, n)
        self.floats = torch.zeros(2 * n, dtype=torch.float32, device=device)  # scalings, target counts
        self.scales, self.counts = self.floats[:n], self.floats[n:]
        self.out = torch.zeros(n, 2, dtype=torch.float32, device=device)
        staged = device.type == "cuda" and PINNED_STAGING
        self._host = (torch.empty(sum(self.sizes), dtype=torch.int64, pin_memory=True),
                      torch.empty(2 * n, dtype=torch.float32, pin_memory=True)) if staged else None
        self._copied = torch.cuda.Event() if staged else None

    def load(self, ints: list[torch.Tensor], floats: list[torch.Tensor]) -> None:
        """The step's inputs (host parts, in `sizes` order; the floats: scalings, target counts) into
        the buffers, by one asynchronous copy each on the current stream. On CUDA the parts are
        concatenated straight into the pinned mirror, once the last copy out of it has run."""
        if self._host is None:
            cuda = self.ints.device.type == "cuda"
            for dst, parts in ((self.ints, ints), (self.floats, floats)):
                host = torch.cat(parts)
                dst.copy_(host.pin_memory() if cuda else host, non_blocking=True)
            return
        self._copied.synchronize()  # the previous step's copies out of the mirror (long done, as a rule)
        host_ints, host_floats = self._host
        torch.cat(ints, out=host_ints)
        torch.cat(floats, out=host_floats)
        self.ints.copy_(host_ints, non_blocking=True)
        self.floats.copy_(host_floats, non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self.ints.device))  # the copies' stream, whatever device is current


class Replay:
    """The stand-in where CUDA graphs do not exist: replay runs the body again."""

    def __init__(self, body) -> None:  # noqa: ANN001
        self.body = body

    def replay(self) -> None:
        self.body()


@dataclass
class Entry:
    static: Static
    graph: torch.cuda.CUDAGraph | Replay | None = None
    failed: bool = False  # its capture failed: the key runs eagerly (or replays a larger capture)
    deferred: int = -1  # the step whose capture found too little free memory (tried again later)
    pool: int = 0  # the pool's bytes its capture took
    last: int = 0  # the step (StepGraphs.calls) that last ran it


def unmade(graphs: Any, key: GraphKey, entry: Entry, counts: tuple[int, int], new: bool) -> None:  # noqa: ANN401
    """A capture made before its step (trainer.graph_ahead, trainer.graph_thread) that made nothing (it failed, or
    the device lacked room): the key's own step tries again as it would have, and counts it there. The entry
    neither failed nor deferred, the graphs' failures and deferrals as `counts` held them, and an entry made
    for the capture (`new`) dropped with its buffers."""
    entry.failed, entry.deferred = False, -1
    graphs.failures, graphs.deferrals = counts
    if new and graphs.entries.get(key) is entry:
        graphs.entries.pop(key)


def capture_short(device: torch.device, need: float | None, pool_bytes: int, sync: bool = True) -> str | None:
    """Why a capture whose pool needs `need` bytes would not fit now (None: it fits, or no need is
    known): it has the device's free memory, once `make_room` made it (not with sync=False: no
    device sync, nothing emptied), and the graphs' pool (a capture reuses the pool)."""
    if device.type == "cuda" and sync:
        make_room(device, need)
    if need is None or device.type != "cuda":
        return None
    free = torch.cuda.mem_get_info(device)[0]
    if need <= free + pool_bytes:
        return None
    return f"needs {need / 2**30:.1f} GiB, pool {pool_bytes / 2**30:.1f} GiB; {memory_report(device)}"


def memory_report(device: torch.device) -> str:
    """The device's memory in one line: what is free, what PyTorch reserved and allocated, the free
    bytes of its segments that live tensors split, and what is outside PyTorch."""
    stats = torch.cuda.memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    reserved = stats.get("reserved_bytes.all.current", 0)
    def gib(b: float) -> str:
        return f"{b / 2**30:.2f}"
    return (f"free {gib(free)} of {gib(total)} GiB; PyTorch reserved {gib(reserved)}, allocated "
            f"{gib(stats.get('allocated_bytes.all.current', 0))}, split free "
            f"{gib(stats.get('inactive_split_bytes.all.current', 0))} in {stats.get('segment.all.current', 0)} "
            f"segments; outside PyTorch {gib(total - free - reserved)}")


def steps_left(engine: Any, tasks: Iterable[Any]) -> int | None:
    """The steps the engine's attached jobs have left where no task has a job queued (StepGraphs.steps_left;
    None: one is queued or parked, and its steps will follow)."""
    if any(task.queue for task in tasks):
        return None
    return max((j.total_steps - j.step for j in engine.jobs.values()), default=0)


def set_lasts(engine: Any, tasks: Iterable[Any]) -> int | None:
    """The steps the engine's attached job set runs unchanged, the step now running included
    (StepGraphs.set_lasts): the fewest any attached job has to its last step or, while its task's
    warmup ranking waits for it, to its warmup's end (None: no job attached)."""
    left = []
    for task in tasks:
        for job_id, s in task.placed.items():
            if job_id in engine.jobs:
                n = s.total_steps - s.step
                left.append(min(n, task.warmup_len(s) - s.step) if task.in_warmup(job_id) else n)
    return min(left, default=None)


def holds_next(engine: Any, tasks: Iterable[Any]) -> bool:
    """Whether the attached job set runs the step after this one unchanged, as far as the executor knows now
    (trainer.step_pipeline launches that step before this one's sync only then): no job's last step or warmup
    end at this step (`set_lasts`), and no evaluation due after it (each task's cadence, which may exit a job)."""
    tasks = list(tasks)
    lasts = set_lasts(engine, tasks)
    if lasts is None or lasts < 2:
        return False
    return not any(task.cadence_due(replace(s, step=s.step + 1))
                   for task in tasks for job_id, s in task.placed.items() if job_id in engine.jobs)
