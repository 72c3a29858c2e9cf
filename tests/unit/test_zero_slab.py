"""kernels.zero_slab: a step's zeroed S buffers, several to one fill, each handed out once."""

from __future__ import annotations

import pytest
import torch

from kernels.zero_slab import ZeroSlab
from trainer.multilora import StepLayout


def test_buffers_are_zero_distinct_and_filled_once_per_slab() -> None:
    slab = ZeroSlab(slices=3)
    bufs = [slab.take(5, 4, torch.float32, torch.device("cpu")) for _ in range(7)]
    assert slab.fills == 3 and slab.taken == 7  # 3 + 3 + 1
    for b in bufs:
        assert b.shape == (5, 4) and b.is_contiguous() and not b.any()
    for b in bufs:  # writing one touches no other: every buffer is its own memory
        b.fill_(1.0)
    assert all(int(b.sum()) == 20 for b in bufs)
    ptrs = {b.data_ptr() for b in bufs}
    assert len(ptrs) == 7


def test_a_new_shape_or_dtype_starts_a_new_slab() -> None:
    slab = ZeroSlab(slices=4)
    cpu = torch.device("cpu")
    a = slab.take(6, 16, torch.float32, cpu)
    a.fill_(3.0)
    b = slab.take(7, 16, torch.float32, cpu)  # other rows: a fresh slab, zeros
    c = slab.take(7, 16, torch.float64, cpu)
    assert slab.fills == 3 and not b.any() and not c.any() and c.dtype == torch.float64
    with pytest.raises(ValueError, match="slices"):
        ZeroSlab(slices=0)


def test_every_step_layout_has_its_own_slab() -> None:
    t = torch.zeros(1)
    kw = dict(offsets=t, scales=t, ranks=t, arena=t, grad_arena=t, r_max=16, token=t)
    one, two = StepLayout(**kw), StepLayout(**kw)
    assert isinstance(one.slab, ZeroSlab) and one.slab is not two.slab
