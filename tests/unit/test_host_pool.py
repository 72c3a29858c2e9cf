"""Unit: the pinned pool parked job states take host memory from (trainer.host_pool): slices of
chunks pinned in the background, given back when their tensors are freed, none handed out twice,
and a state parked through it (CPU stand-in: plain memory) round-trips exactly."""

from __future__ import annotations

import gc

import torch

from trainer.host_pool import ALIGN, PinnedPool


def test_slices_come_from_reserved_chunks_and_go_back_when_freed() -> None:
    pool = PinnedPool(chunk_bytes=64 * 1024)
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
    pool.reserve(4 * ALIGN)
    pool.wait()
    held = [pool.take((ALIGN // 4,), torch.float32) for _ in range(4)]
    assert all(t is not None for t in held)
    assert len({t.data_ptr() for t in held}) == 4
    assert pool.take((1,), torch.uint8) is None
    held.pop(1)
    gc.collect()
    assert pool.take((ALIGN // 4,), torch.float32) is not None
