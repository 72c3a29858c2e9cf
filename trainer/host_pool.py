"""Page-locked host memory for parked job states, pinned off the critical path.

Parking a job (its adapter and AdamW moments leave the GPU while it waits for the warmup ranking)
copies its tensors into pinned host memory without waiting for the copies. Pinning that memory at
park time cost ~0.7 s a state at 32 layers of an 8B model (26 s of a 48-configuration search:
cudaHostAlloc on the loop's thread). The executor instead asks the pool, once it knows its
configurations, to pin what their parked states may need (`reserve`): a background thread pins
chunks while the steps train, and a park takes a slice of a chunk (`take`), giving it back
when the parked tensor is freed (resumed, evicted, finished). A park the pool cannot serve yet
grows it by one chunk on the spot (registered, as the thread pins), up to half the host's memory,
the thread's limit too; past that the caller allocates as before. The thread's chunks hold the
largest tensor a park takes (search (a)'s rank-64 states, 671 MB a tensor, found no 256 MB chunk
whole: 30 chunks pinned on its loop, 1.9-7.3 s of park time on an H100, 0.03 s once they did).
The executor reserves after a task's first step, only what the device cannot keep. The thread
faults its chunks in itself and then registers them (`_pinned_bytes`): with cudaHostAlloc the
driver's lock was held the whole time, and the loop's launches waited (30 GB pinned at the start
cost a search's first step 17 s; later, its first evaluation 13.7 s instead of ~5.5 s, and its
adapter inits 4-5 s instead of 0.5 s). It registers each chunk once the loop's thread waits for the
device (`device_wait`), not beside the eager first steps' launches (session 67: step 1 0.56-0.60 s
-> 0.44-0.46 s). Released chunks are unregistered.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Sequence

import torch

from contract.background import BackgroundWorker

log = logging.getLogger("loraplex.executor")

ALIGN = 512  # bytes: every slice starts on a boundary any dtype and the copy engine like
# The pinner registers a chunk (~17 ms for 256 MB, under the driver's lock) once the loop's thread waits for the
# device (`device_wait`), or after this many seconds without such a wait: registered beside the eager first steps'
# launches, 7 chunks slowed the 200-step task's step 1 by 0.07-0.16 s (bench/results/session66_h200.md);
# $LORAPLEX_PIN_QUIET_S=0: no wait (as before)
QUIET_WAIT_S = float(os.environ.get("LORAPLEX_PIN_QUIET_S", "0.5"))
_GATE = threading.local()  # the pinner's thread: what it waits for before a registration


def _pin_share(value: str | None) -> float:
    """$LORAPLEX_PIN_SHARE: the share of the host's memory a task's background target may reach,
    in (0, 0.5] (the pool's own limit, the default). Session 30's search (a) pinned 11.7 s beside
    its steps with 0.5 against 6.5 s with 0.25; which of the two keeps its parks off the loop with
    chunks that hold their tensors is the next measurement (bench/device_session.sh s31_a)."""
    if value is None or value == "":
        return 0.5
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0.0 < share <= 0.5:
        raise ValueError(f"LORAPLEX_PIN_SHARE={value!r}: a share of host memory in (0, 0.5]")
    return share


PIN_SHARE = _pin_share(os.environ.get("LORAPLEX_PIN_SHARE"))


class PinnedPool:
    """Chunks of pinned host memory and first-fit slices of them."""

    def __init__(self, chunk_bytes: int = 256 << 20, pause_s: float = 0.005) -> None:
        self.chunk_bytes = chunk_bytes
        self.pause_s = pause_s  # between chunks: the loop's driver calls wait at most one chunk
        self._lock = threading.Lock()
        self._chunks: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per chunk: free (start, end) byte ranges
        self._retired: list[tuple[torch.Tensor, list[tuple[int, int]]]] = []  # released, slices in use
        self._target = 0
        self._largest = 0  # the pinner's chunks hold at least this (reserve's `largest`)
        self.served = 0
        self.missed = 0
        self.grown = 0  # chunks pinned on a caller's thread (`take` found no room)
        self.grow_s = 0.0  # seconds callers spent pinning those chunks
        self.pin_s = 0.0  # seconds the background thread spent pinning (the loop's launches slow meanwhile)
        # None: half the host's memory (the background target too: target_for; past this limit
        # a caller pins by cudaHostAlloc as before, which no limit held back)
        self.grow_limit: int | None = None
        # the background pinning: a daemon thread (a killed executor still exits) whose step pins
        # one chunk; it stops itself at the target, and `reserve` starts it again
        self._pinner = BackgroundWorker("loraplex-pin", self._pin_next, logger=log)
        self._quiet = threading.Event()  # set while the loop's thread waits for the device
        self.quiet_pins = 0  # registrations that began in such a wait (the others waited QUIET_WAIT_S)

    @contextlib.contextmanager
    def device_wait(self):  # noqa: ANN201
        """Around the loop's wait for the device: the pinner's registrations go there, where the loop
        launches nothing that the driver's lock would hold back."""
        self._quiet.set()
        try:
            yield
        finally:
            self._quiet.clear()

    def _await_quiet(self) -> None:
        if self._quiet.wait(QUIET_WAIT_S):
            self.quiet_pins += 1

    # ----- filling ---------------------------------------------------------------------
    @property
    def pinned_bytes(self) -> int:
        return sum(c.numel() for c in self._chunks)

    def reserve(self, nbytes: int, largest: int = 0) -> None:
        """Pin chunks until `nbytes` are held, in a background thread (returns at once); each chunk
        holds at least `largest` bytes, the largest tensor a park will take (a slice is contiguous:
        search (a)'s rank-64 states, 671 MB a tensor, found no 256 MB chunk whole and pinned 30
        chunks on the loop in every call, 1.9-7.3 s of its park time)."""
        with self._lock:
            self._target = max(self._target, int(nbytes))
            self._largest = max(self._largest, -(-int(largest) // ALIGN) * ALIGN)
        # pinning: it sees the new target (it stops only under the lock, at the target it read);
        # stopped or stopping: a new loop starts
        self._pinner.start()

    def _pin_next(self) -> bool:
        """The pinner's step: one more chunk towards the target; True while more is due. At the
        target, or where no more pinned memory is to be had, it ends its loop."""
        with self._lock:
            want = self._target - self.pinned_bytes
            if want <= 0:
                self._pinner.stop()  # from inside the step: the loop ends after it
                return False
            size = max(min(self.chunk_bytes, max(ALIGN, want)), self._largest)
        t0 = time.perf_counter()
        _GATE.before_register = self._await_quiet
        try:
            chunk = _pinned_bytes(size)
        except Exception as err:  # noqa: BLE001 - no more pinned memory to be had: serve what there is
            log.warning("pinned pool stops at %d bytes: %s", self.pinned_bytes, err)
            self._pinner.stop()
            return False
        finally:
            _GATE.before_register = None
        with self._lock:
            self.pin_s += time.perf_counter() - t0
            self._chunks.append(chunk)
            self._free.append([(0, size)])
        self._pinner.wait(self.pause_s)
        return True

    def counts(self) -> dict[str, float]:
        """The timings report's view: slices served and missed, chunks grown on a caller's
        thread and the seconds that took, the background thread's pinning seconds and how many of its
        registrations began while the loop waited for the device, GB pinned now."""
        return {"pool_served": self.served, "pool_missed": self.missed, "pool_grown": self.grown,
                "pool_grow_s": round(self.grow_s, 3), "pool_pin_s": round(self.pin_s, 3),
                "pool_quiet_pins": self.quiet_pins, "pool_pinned_gb": round(self.pinned_bytes / 2**30, 2)}

    def wait(self) -> None:
        """Until the background pinning is done (tests, benchmarks)."""
        self._pinner.join()

    def release(self) -> None:
        """Drop the pool's chunks, unpinned; one with slices still in use stays pinned (and alive)
        until its last slice is freed."""
        self.wait()
        with self._lock:
            for chunk, free in zip(self._chunks, self._free, strict=True):
                if free == [(0, chunk.numel())]:
                    _unpin(chunk)
                else:
                    self._retired.append((chunk, free))
            self._chunks, self._free, self._target, self._largest = [], [], 0, 0

    # ----- slices ----------------------------------------------------------------------
    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """A pinned host tensor of this shape and dtype from the pool. Where no chunk has room,
        one more chunk is pinned here by registration (`_grow`: ~20 ms for 256 MB, where the
        caller's cudaHostAlloc took ~0.1 s and held the driver's lock), within `grow_limit`;
        None past it. Its bytes return to the pool when the tensor is freed."""
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = max(ALIGN, -(-numel * dtype.itemsize // ALIGN) * ALIGN)
        found = self._slice(nbytes)
        if found is None and self._grow(nbytes):
            found = self._slice(nbytes)
        if found is None:
            with self._lock:  # the counters change under the lock, as `served` does in _slice
                self.missed += 1
            return None
        chunk, lo = found
        out = chunk[lo : lo + numel * dtype.itemsize].view(dtype).view(tuple(shape))
        weakref.finalize(out, self._give_back, chunk, lo, nbytes)
        return out

    def _slice(self, nbytes: int) -> tuple[torch.Tensor, int] | None:
        with self._lock:
            for k, free in enumerate(self._free):
                for j, (lo, hi) in enumerate(free):
                    if hi - lo >= nbytes:
                        free[j] = (lo + nbytes, hi)
                        self.served += 1
                        return self._chunks[k], lo
        return None

    def limit_bytes(self) -> int:
        """The most the pool pins: grow_limit, else half the host's memory."""
        return self.grow_limit if self.grow_limit is not None else host_memory_bytes() // 2

    def target_for(self, parked: float, write_buffer: float) -> int:
        """What to reserve for a task: the bytes its states may park beyond the device's room and
        its writes' snapshots, on top of what the pool holds, within `limit_bytes` (the limit the
        loop's own growth has: pinned ahead rather than on the loop) and PIN_SHARE of the host.
        The earlier cap, a quarter of the host, is not what left search (a) short (its chunks were
        too small: `reserve`'s `largest`); with half, its pinner ran 11.7 s beside the steps, not 6.5."""
        cap = min(self.limit_bytes(), int(PIN_SHARE * host_memory_bytes()))
        return min(int(max(0.0, parked) + write_buffer) + self.pinned_bytes, cap)

    def _grow(self, nbytes: int) -> bool:
        """One more chunk (at least `nbytes`) pinned on the caller's thread, within grow_limit."""
        size = max(self.chunk_bytes, nbytes)
        if self.pinned_bytes + size > self.limit_bytes():
            return False
        t0 = time.perf_counter()
        try:
            chunk = _pinned_bytes(size)
        except Exception as err:  # noqa: BLE001 - no more pinned memory: the caller's fallback
            log.warning("pinned pool could not grow past %d bytes: %s", self.pinned_bytes, err)
            return False
        with self._lock:
            self._chunks.append(chunk)
            self._free.append([(0, size)])
            self.grown += 1
            self.grow_s += time.perf_counter() - t0
        return True

    def _give_back(self, chunk: torch.Tensor, lo: int, nbytes: int) -> None:
        with self._lock:
            k = next((i for i, c in enumerate(self._chunks) if c is chunk), None)
            if k is not None:
                self._free[k] = _merged(self._free[k], lo, nbytes)
                return
            # released meanwhile: unpinned (and dropped) with its last slice
            r = next((i for i, (c, _) in enumerate(self._retired) if c is chunk), None)
            if r is None:
                return
            free = _merged(self._retired[r][1], lo, nbytes)
            if free == [(0, chunk.numel())]:
                self._retired.pop(r)
                _unpin(chunk)
            else:
                self._retired[r] = (chunk, free)


def _merged(free: list[tuple[int, int]], lo: int, nbytes: int) -> list[tuple[int, int]]:
    """The free byte ranges with [lo, lo + nbytes) added, adjacent ones merged."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted([*free, (lo, lo + nbytes)]):
        if merged and merged[-1][1] >= a:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


# chunks pinned by registration (data pointers): unregistered before their memory goes
_REGISTERED: set[int] = set()


def _pinned_bytes(size: int) -> torch.Tensor:
    """A chunk of page-locked host memory. Not cudaHostAlloc (torch's pin_memory): it allocates,
    zeroes and locks the pages under the driver's lock, and the loop's launches wait the whole time
    (bench/pin_probe.py, H100: a 2,000-launch loop took 3.6 s instead of 13.5 ms beside 8 GB pinned).
    Here this thread faults the pages in itself (anonymous memory advised to use huge pages: 512
    times fewer pages to lock), then registers them: 8 GB in 0.55 s, the loop 2.8x slower meanwhile.
    Where registration fails, pin_memory as before."""
    if not torch.cuda.is_available():
        return torch.empty(size, dtype=torch.uint8)  # a CPU machine: plain memory, same bookkeeping
    try:
        return _registered_bytes(size)
    except (OSError, RuntimeError, ValueError, AttributeError) as err:
        log.info("host memory registration failed (%s): pinned by cudaHostAlloc", err)
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def _registered_bytes(size: int) -> torch.Tensor:
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(mm, dtype=torch.uint8)  # its storage keeps the mapping alive
    buf.fill_(0)  # the pages faulted in by this thread, not under the driver's lock
    gate = getattr(_GATE, "before_register", None)
    if gate is not None:  # the pinner's thread: registered while the loop waits for the device
        gate()
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), size, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister returned {err}")
    _REGISTERED.add(buf.data_ptr())
    return buf


def _unpin(chunk: torch.Tensor) -> None:
    """A chunk the pool drops: registered memory unregistered first (its pages unlocked; the
    mapping goes with the tensor's storage)."""
    ptr = chunk.data_ptr()
    if ptr in _REGISTERED:
        _REGISTERED.discard(ptr)
        torch.cuda.cudart().cudaHostUnregister(ptr)


def host_memory_bytes() -> int:
    """The host's physical memory (0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


# the process's pool: parks (trainer.jobs) take from it, the executor reserves it
POOL = PinnedPool()
