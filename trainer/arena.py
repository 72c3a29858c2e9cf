"""The engine's job slots (`AdapterArena`, held as `engine.slots`): attached jobs' weights live in
one buffer (each job's flat parameter is a view of its own region, first fit, grown when full) and
their gradients in one float32 buffer of the same layout; attach copies a job in, detach copies it
out, and each step points every multi-LoRA layer at the regions of its jobs by offsets (the kernels
address the arena directly). A whole class: built from what it reads of the engine (its layers,
device, dtypes and kernel backend), it knows nothing else of it; a job's state (adapter, optimizer,
data order) is made by the engine (`MultiLoraEngine.new_job`) and handed in.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence

import torch

from trainer.jobs import JobRun
from trainer.multilora import MultiLoraLinear, StepLayout

# the share of device memory a job parked on the device leaves free: the steps' peak is already
# held by the allocator's cache, this is room for admission to grow the step and for fragmentation
DEFAULT_PARK_RESERVE = 0.15


def _park_reserve(value: str | None) -> float:
    """$LORAPLEX_PARK_RESERVE (a share of device memory in [0, 1)), else DEFAULT_PARK_RESERVE."""
    if value is None or value == "":
        return DEFAULT_PARK_RESERVE
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0.0 <= share < 1.0:
        raise ValueError(f"LORAPLEX_PARK_RESERVE={value!r}: a share of device memory in [0, 1)")
    return share


PARK_RESERVE = _park_reserve(os.environ.get("LORAPLEX_PARK_RESERVE"))


def state_bytes(state: JobRun) -> int:
    """Device bytes of a job's state: its adapter and its optimizer's moments."""
    tensors = [p.data for p in state.adapter.parameters()]
    tensors += [v for st in state.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors)


def park_room(free: int, total: int, reserve: float = PARK_RESERVE) -> float:
    """Bytes that parks may still take on the device: what is free beyond `reserve` of `total`."""
    return free - reserve * total


def park_target(need: int, free: int, total: int, reserve: float = PARK_RESERVE) -> str | None:
    """None (park on the device) when `need` bytes leave at least `reserve` of `total` free."""
    return None if need <= park_room(free, total, reserve) else "cpu"


def host_to_device(cpu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a sync (pinned, copied asynchronously)."""
    if device.type != "cuda":
        return cpu.to(device)
    return cpu.pin_memory().to(device, non_blocking=True)


class AdapterArena:
    """The jobs attached to an engine's multi-LoRA layers, in slot order, and their arenas (see
    the module docstring). `backend` is the kernels' choice every step layout carries."""

    def __init__(self, layers: Sequence[MultiLoraLinear], device: torch.device, adapter_dtype: torch.dtype,
                 compute_dtype: torch.dtype, backend: str = "auto") -> None:
        self.layers = list(layers)
        self.adapter_dtype = adapter_dtype
        self.compute_dtype = compute_dtype
        self.backend = backend
        self.jobs: dict[str, JobRun] = {}  # attached jobs in slot order
        self._accumulate = False  # set_layout keeps the gradient sums (a step's later passes)
        self._step: list[JobRun] | None = None  # within pass_of: the whole step's jobs
        # within compute_copy: its jobs' regions copied in the compute dtype, where each starts, and
        # a gradient arena of its shape that holds nothing
        self._copy: tuple[torch.Tensor, dict[str, tuple[int, int]], torch.Tensor] | None = None
        self.guard: Callable[[], None] | None = None  # while a step capture runs on a thread (`settle`)
        self.reset(device)

    def settle(self) -> None:
        """Wait for a step graph's capture under way on a thread (trainer.graph_thread), which reads the
        layers' layouts and the arenas as they are: every change of them (and of the layers) waits first."""
        if self.guard is not None:
            self.guard()

    @contextlib.contextmanager
    def pass_of(self, step: Sequence[JobRun], later: bool) -> Iterator[None]:
        """Within: set_layout lays out one pass of a step over `step`'s jobs (trainer.step_passes).
        A later pass adds to the gradient sums as they are rather than zeroing them first. Every
        pass launches the kernels with the whole step's jobs, the absent ones holding no rows, so
        each pass runs the kernels' specializations that the step's job count and largest rank
        chose (Triton compiles per constexpr N_P2, per R_MAX's tile and per integer argument's
        divisibility): a pass of other jobs or ranks compiles nothing new."""
        was = self._accumulate, self._step
        self._accumulate, self._step = later, list(step)
        try:
            yield
        finally:
            self._accumulate, self._step = was

    def _whole_step(self, states: Sequence[JobRun], token_offsets: list[int]
                    ) -> tuple[Sequence[JobRun], list[int]]:
        """Within pass_of: the step's jobs in its order and their token offsets, a job absent from
        this pass (`states`, in the step's order) an empty range where it would stand."""
        if self._step is None:
            return states, token_offsets
        ids = [s.job_id for s in states]
        where = {j: k for k, j in enumerate(ids)}
        order = [where[s.job_id] for s in self._step if s.job_id in where]
        if order != list(range(len(ids))):
            raise ValueError(f"the pass's jobs {ids} are not the step's, in its order")
        offsets, k = [], 0
        for s in self._step:
            offsets.append(token_offsets[k])
            k += s.job_id in where
        return self._step, offsets + [token_offsets[-1]]

    @contextlib.contextmanager
    def compute_copy(self, states: Sequence[JobRun]) -> Iterator[None]:
        """Within (an evaluation of these jobs: nothing updates the arena between its forwards),
        their regions alone, copied once into one buffer in the compute dtype, serve every no-grad
        layout (`copied`). Before, each forward copied the whole arena: 5.4 GB at 32 layers of 8B
        in a 48-configuration search, where an evaluation of 3 jobs reads 0.3 GB of it. Each
        region keeps its offset modulo 16 elements (the kernels' aligned loads stay aligned). Where
        the arena is in the compute dtype already, nothing is copied."""
        if self._copy is not None or self.arena.dtype == self.compute_dtype or not states:
            yield
            return
        self.settle()
        copy, regions = self._packed([s.job_id for s in states], self.compute_dtype)
        # the kernels take a gradient arena of the arena's shape; a no-grad forward never writes it
        grads = torch.zeros(1, dtype=self.grad_dtype, device=self.device).expand(copy.numel())
        self._copy = (copy, regions, grads)
        try:
            yield
        finally:
            self._copy = None

    @property
    def copied(self) -> bool:
        """Within compute_copy with a copy made: no-grad layouts read it (never a graph's capture,
        which would keep its address past the scope)."""
        return self._copy is not None

    def layout_arenas(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the arena as the kernels read it, a gradient arena of its shape) for a layout: the
        arena itself where it is in the compute dtype, else a copy of it made now; for a no-grad
        layout within compute_copy, the scope's copy of its jobs and a zero-stride stand-in for
        the gradients (nothing is written to it)."""
        if self._copy is not None and not torch.is_grad_enabled():
            return self._copy[0], self._copy[2]
        arena = self.arena if self.arena.dtype == self.compute_dtype else self.arena.to(self.compute_dtype)
        return arena, self.grad_arena

    def _regions_now(self, states: Sequence[JobRun]) -> list[int]:
        """Each job's first element in the arena the layout reads (layout_arenas)."""
        if self._copy is None or torch.is_grad_enabled():
            return [self.regions[s.job_id][0] for s in states]
        regions = self._copy[1]
        missing = [s.job_id for s in states if s.job_id not in regions]
        if missing:
            raise ValueError(f"jobs {missing} are not in the evaluation's arena copy")
        return [regions[s.job_id][0] for s in states]

    # ----- arena -----------------------------------------------------------------------
    def reset(self, device: torch.device) -> None:
        """Empty arenas on `device` (an engine whose backbone moved there calls it again)."""
        if self.jobs:
            raise RuntimeError("the arena is reset only while no job is attached")
        self.settle()
        self.device = device
        # job_id -> [lo, hi) element region; gradients in the accumulation dtype
        self.grad_dtype = torch.float64 if self.compute_dtype == torch.float64 else torch.float32
        self.arena = torch.zeros(0, dtype=self.adapter_dtype, device=self.device)
        self.grad_arena = torch.zeros(0, dtype=self.grad_dtype, device=self.device)
        self.regions: dict[str, tuple[int, int]] = {}
        # a scalar that requires grad: the backward reaches every layer (and the gradient arena)
        self.token = torch.zeros((), device=self.device, requires_grad=True)

    def _alloc(self, size: int) -> int:
        """First fit among the gaps between regions, else at the end (growing the arena by at
        least an eighth: few regrowths while jobs attach, little slack in device memory)."""
        pos = 0
        for lo, hi in sorted(self.regions.values()):
            if lo - pos >= size:
                return pos
            pos = max(pos, hi)
        if pos + size > self.arena.numel():
            self._grow(max(pos + size, self.arena.numel() + self.arena.numel() // 8))
        return pos

    def _grow(self, capacity: int) -> None:
        # the gradient sums are dead between steps: free them before allocating anything
        self.grad_arena = self.grad_arena.new_zeros(0)
        arena = torch.zeros(capacity, dtype=self.arena.dtype, device=self.device)
        arena[: self.arena.numel()] = self.arena
        self.arena = arena
        self.grad_arena = torch.zeros(capacity, dtype=self.grad_dtype, device=self.device)
        for job_id, (lo, hi) in self.regions.items():
            self.jobs[job_id].adapter.flat.data = arena[lo:hi]

    def storage(self) -> tuple[int, int, int]:
        """Where the arenas live now (weights' and gradients' addresses, their elements): a capture or a step
        launched ahead reads them there, and a grown or packed arena moves them (StepGraphs, StepPipeline)."""
        return self.arena.data_ptr(), self.grad_arena.data_ptr(), self.arena.numel()

    def free_bytes(self) -> int:
        """Device bytes the arenas (weights and gradient sums) hold for no attached job."""
        live = sum(hi - lo for lo, hi in self.regions.values())
        return (self.arena.numel() - live) * (self.arena.element_size() + self.grad_arena.element_size())

    def compact(self, min_free: int) -> int:
        """Between steps: where the arenas hold at least `min_free` bytes for no job, pack the
        attached jobs' regions into new arenas of their size (`_packed`, as compute_copy's: each
        keeps its offset modulo 16, so a layout stays as aligned as it was); the bytes freed (0: nothing
        moved). The arenas only grow otherwise: a search's first steps attach every configuration
        at once, and once its warmup ranking evicts three of four, an H100 held 11 GB of arena for
        no job, which pushed its later steps of 3.5k tokens into recompute. New storage: a step's
        captured graphs point at the old one (the caller drops them; trainer.step_graphs would)."""
        free = self.free_bytes()
        if free < max(1, min_free) or self._step is not None or self._copy is not None:
            return 0
        self.settle()
        self.grad_arena = self.grad_arena.new_zeros(0)  # the gradient sums are dead between steps
        self.arena, self.regions = self._packed(sorted(self.regions, key=lambda j: self.regions[j][0]),
                                                self.arena.dtype)
        for job_id, (lo, hi) in self.regions.items():
            self.jobs[job_id].adapter.flat.data = self.arena[lo:hi]
        self.grad_arena = torch.zeros(self.arena.numel(), dtype=self.grad_dtype, device=self.device)
        return free - self.free_bytes()

    def _packed(self, job_ids: Sequence[str], dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, tuple[int, int]]]:
        """These jobs' regions copied one after another, in this order, into a new buffer of
        `dtype`, each at its offset modulo 16 (the kernels' aligned loads stay aligned); the
        buffer and each job's region in it."""
        regions: dict[str, tuple[int, int]] = {}
        pos = 0
        for job_id in job_ids:
            lo, hi = self.regions[job_id]
            start = pos + (lo - pos) % 16
            regions[job_id] = (start, start + hi - lo)
            pos = start + hi - lo
        buffer = torch.zeros(pos, dtype=dtype, device=self.device)
        with torch.no_grad():
            for job_id, (start, end) in regions.items():
                lo = self.regions[job_id][0]
                buffer[start:end].copy_(self.arena[lo : lo + end - start])
        return buffer, regions

    # ----- attach / detach -------------------------------------------------------------
    def attach(self, state: JobRun) -> JobRun:
        """Put a job's state (already on the arena's device) into a slot; no rebuild."""
        if state.job_id in self.jobs:
            raise ValueError(f"job {state.job_id} is already attached")
        flat = state.adapter.flat
        if flat.dtype != self.arena.dtype:
            raise ValueError(f"job {state.job_id}: adapter dtype {flat.dtype} != engine's {self.arena.dtype}")
        self.settle()
        lo = self._alloc(flat.numel())
        hi = lo + flat.numel()
        self.jobs[state.job_id] = state
        self.regions[state.job_id] = (lo, hi)
        with torch.no_grad():
            self.arena[lo:hi].copy_(flat.data)
        flat.data = self.arena[lo:hi]
        return state

    def detach(self, job_id: str, park_device: torch.device | str | None = None) -> JobRun:
        """Free a job's slot; with park_device its state moves there (e.g. 'cpu')."""
        self.settle()
        state = self.jobs.pop(job_id)
        self.regions.pop(job_id)
        flat = state.adapter.flat
        if park_device is not None and torch.device(park_device).type == "cpu" and flat.is_cuda:
            return state.to(park_device)  # copied out of its region in stream order, before any reuse
        flat.data = flat.data.clone()  # its own storage again; the region is free for another job
        return state.to(park_device) if park_device is not None else state

    def park_target(self, job_id: str) -> str | None:
        """Where an attached job waiting for its turn (the warmup ranking) is parked: None keeps it
        on the device (a private copy of its region, nothing crosses to the host, most such jobs
        are evicted by the ranking anyway) while the device keeps PARK_RESERVE of its memory free
        after it; else "cpu" (pinned host memory)."""
        if self.device.type != "cuda":
            return "cpu"
        free, total = torch.cuda.mem_get_info(self.device)
        return park_target(state_bytes(self.jobs[job_id]), free, total)

    # ----- a step's layout -------------------------------------------------------------
    def layout_offsets(self, states: Sequence[JobRun]) -> list[int]:
        """Every layer's A then B element offsets in the arena, layer-major, for these jobs in
        slot order (what the multi-LoRA layers read per job)."""
        regions = self._regions_now(states)
        adapters = [s.adapter for s in states]
        n_layers = len(self.layers)
        a = [lo + ad.a_offsets[k] for k in range(n_layers) for lo, ad in zip(regions, adapters, strict=True)]
        return a + [lo + ad.b_offsets[k] for k in range(n_layers) for lo, ad in zip(regions, adapters, strict=True)]

    def set_layout(self, states: Sequence[JobRun], token_offsets: list[int]) -> None:
        """Point every layer at the arena for these jobs (in this order) and zero their gradient
        sums: one host-to-device copy of all layers' offsets, no per-layer work, no sync."""
        self.settle()
        states, token_offsets = self._whole_step(states, token_offsets)
        n_layers = len(self.layers)
        ints = self.layout_offsets(states) + [s.adapter.rank for s in states] + list(token_offsets)
        dev = host_to_device(torch.tensor(ints, dtype=torch.int64), self.device)
        n = len(states)
        offs = dev[: 2 * n_layers * n].view(2, n_layers, n)
        arena, grad_arena = self.layout_arenas()
        if torch.is_grad_enabled() and not self._accumulate:
            self.grad_arena.zero_()
        lay = StepLayout(
            offsets=dev[2 * n_layers * n + n :],
            scales=host_to_device(torch.tensor([s.adapter.scaling for s in states], dtype=torch.float32),
                                  self.device),
            ranks=dev[2 * n_layers * n : 2 * n_layers * n + n].to(torch.int32),
            arena=arena,
            grad_arena=grad_arena,
            r_max=max(s.adapter.rank for s in states),
            token=self.token,
            backend=self.backend,
            aligned=all(v % 16 == 0 for v in ints[: 2 * n_layers * n]),
        )
        for k, layer in enumerate(self.layers):
            layer.layout = lay
            layer.a_off, layer.b_off = offs[0, k], offs[1, k]

    def clear_layout(self) -> None:
        """Every layer back to its base linear alone, until the next layout."""
        self.settle()
        for layer in self.layers:
            layer.layout = layer.a_off = layer.b_off = None
