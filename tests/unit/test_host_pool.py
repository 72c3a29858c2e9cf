"""Unit: the pinned pool parked job states take host memory from (trainer.host_pool): slices of
chunks pinned in the background, given back when their tensors are freed, none handed out twice,
and a state parked through it (CPU stand-in: plain memory) round-trips exactly; the pinning
thread (a contract.background.BackgroundWorker) stops itself at the target or where no memory is
to be had, follows a raised target, and starts again on a later reserve."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from tests.unit.test_background_worker import wait_until
from trainer import host_pool
from trainer.host_pool import ALIGN, PinnedPool


def test_slices_come_from_reserved_chunks_and_go_back_when_freed() -> None:
    pool = PinnedPool(chunk_bytes=64 * 1024)
    pool.grow_limit = 0  # the background chunks alone (growth on a miss: its own test)
    assert pool.take((10,), torch.float32) is None and pool.missed == 1  # nothing pinned yet
    pool.reserve(100 * 1024)
    pool.wait()
    assert pool.pinned_bytes == 100 * 1024  # a full chunk and the rest
    a = pool.take((1000,), torch.float32)
    b = pool.take((3, 500), torch.float64)
    assert a.shape == (1000,) and a.dtype == torch.float32
    assert b.shape == (3, 500) and b.dtype == torch.float64
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.sum().item() == 1000 and b.sum().item() == 3000  # disjoint: neither overwrote the other
    assert (b.data_ptr() - a.data_ptr()) % ALIGN == 0  # slices start on ALIGN bytes of their chunk
    too_big = pool.take((200 * 1024,), torch.uint8)
    assert too_big is None  # larger than any chunk: the caller allocates on its own
    first = a.data_ptr()
    del a
    gc.collect()
    again = pool.take((1000,), torch.float32)
    assert again.data_ptr() == first  # the freed slice is reused
    assert b.sum().item() == 3000
    pool.release()
    assert pool.pinned_bytes == 0
    assert b.sum().item() == 3000  # a slice in use keeps its chunk after the release


def test_a_full_pool_refuses_and_serves_again_after_a_free() -> None:
    pool = PinnedPool(chunk_bytes=4 * ALIGN)
    pool.grow_limit = 4 * ALIGN  # what the background pinned: no room to grow
    pool.reserve(4 * ALIGN)
    pool.wait()
    held = [pool.take((ALIGN // 4,), torch.float32) for _ in range(4)]
    assert all(t is not None for t in held)
    assert len({t.data_ptr() for t in held}) == 4
    assert pool.take((1,), torch.uint8) is None
    held.pop(1)
    gc.collect()
    assert pool.take((ALIGN // 4,), torch.float32) is not None


def test_a_miss_grows_the_pool_by_a_chunk_on_the_callers_thread_within_its_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pin = FakePin()
    monkeypatch.setattr(host_pool, "_pinned_bytes", pin)
    pool = PinnedPool(chunk_bytes=4 * ALIGN)
    pool.grow_limit = 10 * ALIGN
    a = pool.take((ALIGN,), torch.uint8)  # nothing pinned: one chunk, pinned here
    assert a is not None and pin.sizes == [4 * ALIGN] and pin.threads == [threading.current_thread()]
    b = pool.take((3 * ALIGN,), torch.uint8)  # the rest of that chunk
    assert b is not None and pin.sizes == [4 * ALIGN]
    big = pool.take((5 * ALIGN,), torch.uint8)  # larger than a chunk: a chunk of its own size
    assert big is not None and pin.sizes == [4 * ALIGN, 5 * ALIGN]
    assert pool.take((2 * ALIGN,), torch.uint8) is None  # 9 + 4 over the limit of 10: the caller's
    counts = pool.counts()
    assert counts.pop("pool_grow_s") >= 0 and counts.pop("pool_pin_s") == 0  # nothing pinned by the thread
    assert counts == {"pool_served": 3, "pool_missed": 1, "pool_grown": 2, "pool_quiet_pins": 0,
                      "pool_pinned_gb": round(9 * ALIGN / 2**30, 2)}
    for t in (a, b, big):
        t.fill_(7)
    assert int(a.sum()) + int(b.sum()) == 7 * 4 * ALIGN  # disjoint slices of one chunk
    del a
    gc.collect()
    assert pool.take((ALIGN,), torch.uint8) is not None and pool.grown == 2  # a freed slice first


class FakePin:
    """host_pool._pinned_bytes stand-in: plain CPU memory, each size recorded; a gate holds
    each allocation; from the `fail_at`-th on, it raises as cudaHostAlloc does out of memory."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.sizes: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_at = fail_at
        self.threads: list[threading.Thread] = []

    def __call__(self, size: int) -> torch.Tensor:
        self.threads.append(threading.current_thread())
        self.gate.wait(5)
        if self.fail_at is not None and len(self.sizes) + 1 >= self.fail_at:
            raise RuntimeError("CUDA error: out of memory")
        self.sizes.append(size)
        return torch.empty(size, dtype=torch.uint8)


def test_the_pinning_thread_stops_at_its_target_follows_a_raised_one_and_starts_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pin = FakePin()
    monkeypatch.setattr(host_pool, "_pinned_bytes", pin)
    pool = PinnedPool(chunk_bytes=4 * ALIGN, pause_s=0.0)
    pool.grow_limit = 0  # the background thread's chunks alone
    pool.wait()  # nothing reserved: returns at once
    pin.gate.clear()
    pool.reserve(6 * ALIGN)
    assert wait_until(lambda: pin.threads)
    thread = pin.threads[0]
    assert thread.name == "loraplex-pin" and thread.daemon and thread is not threading.current_thread()
    pool.reserve(10 * ALIGN)  # raised while the first chunk pins: the same thread goes on to it
    pin.gate.set()
    pool.wait()
    assert pin.sizes == [4 * ALIGN, 4 * ALIGN, 2 * ALIGN] and pool.pinned_bytes == 10 * ALIGN
    assert set(pin.threads) == {thread} and not thread.is_alive()  # stopped itself at the target
    pool.reserve(8 * ALIGN)  # already held: the new loop stops at once
    pool.wait()
    assert pool.pinned_bytes == 10 * ALIGN and len(pin.sizes) == 3
    pool.reserve(12 * ALIGN)  # more: pinning starts again, in a new daemon thread
    pool.wait()
    assert pin.sizes[3:] == [2 * ALIGN] and pool.pinned_bytes == 12 * ALIGN
    assert pin.threads[-1] is not thread and pin.threads[-1].daemon
    assert pool.take((ALIGN,), torch.uint8) is not None
    pool.release()
    assert pool.pinned_bytes == 0 and pool.take((1,), torch.uint8) is None
    pool.reserve(ALIGN)  # after a release: pins from nothing again
    pool.wait()
    assert pool.pinned_bytes == ALIGN


def test_pinning_stops_where_no_memory_is_to_be_had(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    pin = FakePin(fail_at=3)
    monkeypatch.setattr(host_pool, "_pinned_bytes", pin)
    pool = PinnedPool(chunk_bytes=ALIGN, pause_s=0.0)
    with caplog.at_level("WARNING", logger="loraplex.executor"):
        pool.reserve(10 * ALIGN)
        pool.wait()  # returns: the loop ended, short of its target
    assert pool.pinned_bytes == 2 * ALIGN and not pin.threads[-1].is_alive()
    assert "pinned pool stops at 1024 bytes" in caplog.text
    assert pool.take((ALIGN,), torch.uint8) is not None  # what there is, served




def test_release_unpins_free_chunks_now_and_used_ones_with_their_last_slice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Registered chunks must be unregistered before their memory goes: release unpins a chunk
    no slice uses at once, and one still in use when its last slice is freed (never twice)."""
    monkeypatch.setattr(host_pool, "_pinned_bytes", FakePin())
    unpinned: list[torch.Tensor] = []
    monkeypatch.setattr(host_pool, "_unpin", unpinned.append)
    pool = PinnedPool(chunk_bytes=2 * ALIGN, pause_s=0.0)
    pool.reserve(4 * ALIGN)
    pool.wait()
    first, second = pool._chunks
    a = pool.take((ALIGN,), torch.uint8)
    b = pool.take((ALIGN,), torch.uint8)
    c = pool.take((ALIGN,), torch.uint8)  # the first chunk full, one slice of the second
    assert a is not None and b is not None and c is not None
    del b
    gc.collect()
    pool.release()
    assert unpinned == [] and pool.pinned_bytes == 0  # both still have a slice in use
    del c
    gc.collect()
    assert len(unpinned) == 1 and unpinned[0] is second
    del a
    gc.collect()
    assert len(unpinned) == 2 and unpinned[1] is first
    pool.reserve(2 * ALIGN)  # pins afresh; a new release unpins the unused chunk at once
    pool.wait()
    pool.release()
    assert len(unpinned) == 3 and pool._retired == []


def test_a_tasks_reserve_covers_its_parks_and_snapshots_up_to_the_pools_own_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # what a task reserves (trainer.hosting.reserve_parking): the states beyond the device's room and
    # the writes' snapshots, on top of what is pinned, up to the limit the loop's growth has too (half
    # the host, where the thread stopped at a quarter before)
    monkeypatch.setattr(host_pool, "_pinned_bytes", FakePin())
    pool = PinnedPool(chunk_bytes=4 * ALIGN, pause_s=0.0)
    pool.grow_limit = 100 * ALIGN
    assert pool.target_for(30 * ALIGN, 10 * ALIGN) == 40 * ALIGN
    assert pool.target_for(-5 * ALIGN, 10 * ALIGN) == 10 * ALIGN  # the device keeps every state
    assert pool.target_for(300 * ALIGN, 10 * ALIGN) == 100 * ALIGN
    pool.reserve(8 * ALIGN)
    pool.wait()
    assert pool.target_for(30 * ALIGN, 10 * ALIGN) == 48 * ALIGN  # on top of what it holds
    pool.grow_limit = None
    gib = 2**30
    monkeypatch.setattr(host_pool, "host_memory_bytes", lambda: 64 * gib)
    assert pool.limit_bytes() == 32 * gib
    assert pool.target_for(40 * gib, 4 * gib) == 32 * gib  # past a quarter (16), to half
    assert pool.target_for(20 * gib, 4 * gib) == 24 * gib + 8 * ALIGN
    pool.release()


def test_chunks_hold_the_largest_tensor_a_park_takes_so_no_park_pins_on_the_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a slice is contiguous: a park's tensor larger than the pool's chunks found none whole and was
    # pinned on the loop (search (a)'s rank-64 states, 671 MB against 256 MB chunks: 30 chunks a call)
    pin = FakePin()
    monkeypatch.setattr(host_pool, "_pinned_bytes", pin)
    pool = PinnedPool(chunk_bytes=4 * ALIGN, pause_s=0.0)
    pool.grow_limit = 100 * ALIGN
    pool.reserve(30 * ALIGN, largest=10 * ALIGN - 7)  # rounded up to ALIGN
    pool.wait()
    assert pin.sizes == [10 * ALIGN] * 3 and pool.pinned_bytes == 30 * ALIGN
    slices = [pool.take((10 * ALIGN,), torch.uint8) for _ in range(3)]
    assert all(t is not None for t in slices) and pool.grown == 0 and pool.missed == 0
    # without `largest`, a take of that size grows the pool on the caller's thread
    other = PinnedPool(chunk_bytes=4 * ALIGN, pause_s=0.0)
    other.grow_limit = 100 * ALIGN
    other.reserve(30 * ALIGN)
    other.wait()
    assert other.take((10 * ALIGN,), torch.uint8) is not None and other.grown == 1
    del slices
    pool.release()
    other.release()
    assert pool.pinned_bytes == 0 and pool._largest == 0


def test_the_pin_share_caps_the_target_and_a_bad_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 2**30
    assert host_pool._pin_share(None) == host_pool._pin_share("") == 0.5
    assert host_pool._pin_share("0.25") == 0.25
    for bad in ("0", "0.6", "-1", "half"):
        with pytest.raises(ValueError, match="LORAPLEX_PIN_SHARE"):
            host_pool._pin_share(bad)
    monkeypatch.setattr(host_pool, "host_memory_bytes", lambda: 64 * gib)
    monkeypatch.setattr(host_pool, "PIN_SHARE", 0.25)
    pool = PinnedPool()
    assert pool.limit_bytes() == 32 * gib  # the loop's growth keeps half
    assert pool.target_for(40 * gib, 4 * gib) == 16 * gib and pool.target_for(8 * gib, 4 * gib) == 12 * gib


@pytest.mark.parametrize("queued", [False, True])
def test_a_task_reserves_parks_only_where_configurations_are_queued(monkeypatch: pytest.MonkeyPatch,
                                                                    queued: bool) -> None:
    # trainer.hosting.TaskRoster.reserve_parking after a task's first step: the writes' snapshots
    # always; the states that may park beyond the device's room only where a queued configuration
    # will need that room (a park nothing queued needs stays on the device: trainer.warmup_hold)
    from types import SimpleNamespace

    from trainer import hosting
    from trainer.jobs import TrainJob

    reserved: list[tuple[int, int]] = []
    monkeypatch.setattr(hosting.POOL, "reserve", lambda nbytes, largest=0: reserved.append((nbytes, largest)))
    monkeypatch.setattr(hosting.POOL, "target_for", lambda parked, buffer: int(max(0.0, parked) + buffer))
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * gib, 100 * gib))
    monkeypatch.setattr(hosting, "park_room", lambda free, total: 0.25 * gib)
    jobs = [TrainJob(f"j{r}", lora_rank=r) for r in (8, 16, 64)]
    engine = SimpleNamespace(device=torch.device("cuda"), params_per_rank=2**20, adapter_dtype=torch.float32)
    task = SimpleNamespace(cfg=SimpleNamespace(jobs=jobs, write_buffer_bytes=4 * gib),
                           queue=[jobs[2]] if queued else [])
    hosting.TaskRoster.reserve_parking(SimpleNamespace(executor=SimpleNamespace(engine=engine)), task)
    states = sum(3 * 4 * 2**20 * r for r in (8, 16, 64))  # weights and two moments, float32
    assert states > gib // 4  # more than the device keeps
    assert reserved == [((states - gib // 4 if queued else 0) + 4 * gib, 4 * 2**20 * 64)]


class _FakeCudart:
    """torch.cuda.cudart() stand-in: registrations succeed and record whether the pool's loop was then
    waiting for the device, and on which thread."""

    def __init__(self, pool: PinnedPool) -> None:
        self.pool, self.seen = pool, []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 (cudart's name)
        self.seen.append((self.pool._quiet.is_set(), threading.current_thread().name))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return 0


def _registering_pool(monkeypatch: pytest.MonkeyPatch, quiet_s: float) -> tuple[PinnedPool, _FakeCudart]:
    pool = PinnedPool(chunk_bytes=1 << 20, pause_s=0.0)
    fake = _FakeCudart(pool)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the real registering path, on plain memory
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(host_pool, "QUIET_WAIT_S", quiet_s)
    return pool, fake


def test_the_pinner_registers_while_the_loop_waits_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    pool, fake = _registering_pool(monkeypatch, quiet_s=30.0)
    pool.reserve(2 << 20)
    threading.Event().wait(0.3)  # the pinner has faulted its first chunk in and waits for a quiet window
    assert fake.seen == [] and pool.pinned_bytes == 0
    with pool.device_wait():
        wait_until(lambda: len(fake.seen) == 2)
    pool.wait()
    assert fake.seen == [(True, "loraplex-pin")] * 2 and pool.quiet_pins == 2
    assert pool.counts()["pool_quiet_pins"] == 2 and pool.pinned_bytes == 2 << 20
    assert not pool._quiet.is_set()  # the window closes with the wait
    pool.release()


def test_without_a_wait_the_pinner_registers_after_its_limit_and_a_caller_never_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pool, fake = _registering_pool(monkeypatch, quiet_s=0.05)
    pool.reserve(1 << 20)
    pool.wait()
    assert fake.seen == [(False, "loraplex-pin")] and pool.quiet_pins == 0 and pool.pinned_bytes == 1 << 20
    monkeypatch.setattr(host_pool, "QUIET_WAIT_S", 30.0)
    caller = threading.current_thread().name
    t = pool.take((3 << 20,), torch.uint8)  # no chunk holds it: grown on this thread, at once
    assert t is not None and fake.seen[-1] == (False, caller) and pool.grown == 1
    pool.release()
