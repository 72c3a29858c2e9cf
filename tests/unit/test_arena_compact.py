"""Unit: packing the adapter arenas once jobs left (trainer.arena.AdapterArena.compact): every
attached job keeps its weights, its optimizer and its offset modulo 16, the arenas shrink to the
jobs' size, the next steps equal those of an engine that never packed, and a graphed step's
captures are dropped with the old storage. On the CPU (the stand-in graphs); the device's own
bytes are checked in tests/gpu/test_step_graphs_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine_ref import tiny_model_dir
from tests.unit.test_step_graphs import engine, examples, job

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN201
    return tiny_model_dir("llama", tmp_path_factory.mktemp("compact"))


def four_jobs_then_two_leave(eng) -> None:  # noqa: ANN001
    for name, rank, batch, seed in (("a", 4, 2, 1), ("b", 16, 1, 2), ("c", 8, 2, 3), ("d", 2, 1, 4)):
        eng.attach(job(name, rank, batch, seed))
    eng.step()
    eng.detach("b")
    eng.detach("d")


def test_packing_keeps_every_job_and_later_steps_equal_an_engine_that_never_packed(model_dir) -> None:  # noqa: ANN001
    data = examples(32, 12, seed=3)
    kept, packed = engine(model_dir, False, data), engine(model_dir, False, data)
    for eng in (kept, packed):
        four_jobs_then_two_leave(eng)
    slots = packed.slots
    before = {j: (s.adapter.flat.detach().clone(), slots.regions[j][0] % 16) for j, s in packed.jobs.items()}
    live = sum(hi - lo for lo, hi in slots.regions.values())
    free = slots.free_bytes()
    assert free > 0 and slots.arena.numel() > live
    assert slots.compact(free + 1) == 0 and slots.free_bytes() == free  # under the threshold: nothing moves
    freed = slots.compact(1)
    assert freed == free - slots.free_bytes() and freed > 0
    assert slots.arena.numel() < live + 16 * len(slots.regions) and slots.grad_arena.numel() == slots.arena.numel()
    spans = sorted(slots.regions.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    base = slots.arena.data_ptr()
    for j, (w, mod) in before.items():
        lo, hi = slots.regions[j]
        flat = packed.jobs[j].adapter.flat
        assert lo % 16 == mod and flat.data_ptr() == base + lo * slots.arena.element_size()
        assert torch.equal(flat.detach(), w)
    for _ in range(3):
        want, got = kept.step(), packed.step()
        assert got.losses == want.losses
    for j in kept.jobs:
        assert torch.equal(packed.jobs[j].adapter.flat.detach(), kept.jobs[j].adapter.flat.detach())
    packed.attach(job("e", 4, 1, 5))  # a new job after the packing: the arena grows again
    assert packed.slots.regions["e"][1] <= packed.slots.arena.numel()
    packed.step()


def test_no_packing_inside_a_pass_or_an_evaluation_copy(model_dir) -> None:  # noqa: ANN001
    eng = engine(model_dir, False, examples(16, 12))
    four_jobs_then_two_leave(eng)
    slots, states = eng.slots, list(eng.jobs.values())
    with slots.pass_of(states, later=False):
        assert slots.compact(1) == 0
    if slots.arena.dtype != slots.compute_dtype:
        with torch.no_grad(), slots.compute_copy(states):
            assert slots.copied and slots.compact(1) == 0
    assert slots.compact(1) > 0


def test_packing_drops_a_graphed_steps_captures_and_the_next_steps_still_equal_eager(model_dir) -> None:  # noqa: ANN001
    data = examples(32, 12, seed=5)
    eager, graphed = engine(model_dir, False, data), engine(model_dir, True, data)
    for eng in (eager, graphed):
        four_jobs_then_two_leave(eng)
        eng.step()
        eng.step()
    g = graphed.step_graphs
    captures, eager_runs = g.captures, g.eager_runs
    assert captures == 1 and g.last_replayed  # the 2-job key captured, then replayed
    assert graphed.slots.compact(1) > 0
    for _ in range(3):
        want, got = eager.step(), graphed.step()
        for j in want.losses:
            assert abs(got.losses[j] - want.losses[j]) <= 2e-5 * abs(want.losses[j]), j
    # the old capture dropped with the storage; its key captured anew at once (its class is warm)
    assert len(g.entries) == 1 and g.captures == captures + 1 and g.eager_runs == eager_runs
    for j in eager.jobs:
        torch.testing.assert_close(graphed.jobs[j].adapter.flat, eager.jobs[j].adapter.flat, rtol=1e-4, atol=1e-6)
