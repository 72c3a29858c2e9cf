"""Memory model fit and the intra-task admission/backfill policy against a given memory model.
CPU only: the CUDA profiling helper is exercised in tests/gpu."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from trainer.admission import (
    AdmissionController,
    MemoryModel,
    ProfilePoint,
    fit_memory_model,
    profile_memory,
)

GIB = 1 << 30
SEQ = 512


@dataclass(frozen=True)
class Job:
    job_id: str
    batch_size: int


def jobs(*sizes: int, prefix: str = "p") -> list[Job]:
    return [Job(f"{prefix}{i}", b) for i, b in enumerate(sizes)]


def total(ids: list[str], pool: list[Job]) -> int:
    by_id = {j.job_id: j for j in pool}
    return sum(by_id[i].batch_size for i in ids)


# 16 GiB of weights and workspace plus 1 MiB per token: at L=512, 0.5 GiB per sequence.
MODEL = MemoryModel(k0=16 * GIB, k1=float(1 << 20))


def controller(budget_gib: float = 40, safety: float = 0.9, **kw) -> AdmissionController:
    # Limit 0.9 * 40 GiB = 36 GiB -> 20 GiB of activations -> total batch <= 40.
    return AdmissionController(MODEL, budget_gib * GIB, SEQ, safety=safety, **kw)


def test_memory_model_predict_and_capacity() -> None:
    assert MODEL.predict(0, SEQ) == 16 * GIB
    assert MODEL.predict(8, SEQ) == 20 * GIB
    assert MODEL.max_total_batch(36 * GIB, SEQ) == 40
    assert MODEL.max_total_batch(36 * GIB - 1, SEQ) == 39
    assert MODEL.max_total_batch(10 * GIB, SEQ) == 0
    c = controller()
    assert c.fits(40) and not c.fits(41)


def test_fit_recovers_k0_k1_from_noisy_points() -> None:
    rng = random.Random(0)
    k0, k1 = 5.3e9, 2.1e5
    points = []
    for b in (1, 2, 4, 8, 16, 32):
        for seq in (256, 1024):
            peak = k0 + k1 * b * seq
            points.append((b, seq, peak * (1 + rng.gauss(0, 0.01))))
    m = fit_memory_model(points)
    assert m.k0 == pytest.approx(k0, rel=0.03)
    assert m.k1 == pytest.approx(k1, rel=0.03)
    # Exact data: exact recovery (checked in float64 arithmetic).
    exact = fit_memory_model([ProfilePoint(b, 128, int(1e9 + 3e5 * b * 128)) for b in (2, 4, 8)])
    assert exact.k0 == pytest.approx(1e9, rel=1e-9) and exact.k1 == pytest.approx(3e5, rel=1e-9)


def test_fit_rejects_degenerate_profiles() -> None:
    with pytest.raises(ValueError):
        fit_memory_model([(4, 128, 1e9), (4, 128, 1.1e9)])  # one distinct B*L
    with pytest.raises(ValueError):
        fit_memory_model([(2, 128, 2e9), (8, 128, 1e9)])  # memory falls with batch
    with pytest.raises(ValueError):
        fit_memory_model([])


def test_admit_greedy_decreasing_batch_under_budget() -> None:
    pending = jobs(4, 16, 8, 16, 2, 32)
    c = controller()
    ids = c.admit(pending, running=[])
    # 32 first; 16s no longer fit (48 > 40); 8 fits (40); 4 and 2 do not.
    assert ids == ["p5", "p2"]
    assert total(ids, pending) == 40
    assert MODEL.predict(total(ids, pending), SEQ) <= 0.9 * 40 * GIB


def test_admit_same_batch_sizes_together() -> None:
    pending = jobs(8, 16, 8, 4, 16, 8)
    ids = controller().admit(pending, running=[])
    assert ids == ["p1", "p4", "p0"]  # both 16s side by side, then the first 8 (40 total)
    # With 8s already running, pending 8s join them before the larger 16s.
    running = jobs(8, 8, prefix="r")
    ids = controller().admit(pending, running)
    assert ids == ["p0", "p2", "p5"]  # 16 + 24 = 40
    assert total(ids, pending) + 16 <= 40


def test_admit_respects_budget_with_running_jobs_and_skips_what_never_fits() -> None:
    c = controller()
    running = jobs(16, 16, prefix="r")
    assert c.admit(jobs(16, 4, 8), running) == ["p2"]  # 32 + 8 = 40
    assert c.admit(jobs(16), running) == []
    big = jobs(64, 2)
    assert c.unschedulable(big) == ["p0"]
    assert c.admit(big, []) == ["p1"]


def test_admit_max_jobs_cap() -> None:
    c = controller(max_jobs=3)
    assert c.admit(jobs(1, 1, 1, 1), jobs(1, prefix="r")) == ["p0", "p1"]


def test_safety_margin_changes_capacity() -> None:
    pending = jobs(*([4] * 20))
    assert len(controller(safety=0.9).admit(pending, [])) == 10  # 40 sequences
    assert len(controller(safety=1.0).admit(pending, [])) == 12  # 48 sequences


def test_backfill_prefers_the_exited_batch_size() -> None:
    c = controller()
    running = jobs(16, 8, 8, prefix="r")  # an 8 exited: 32 in use, 8 free
    pending = jobs(4, 8, 2, 8)
    assert c.backfill(8, pending, running) == ["p1"]  # an 8 replaces the 8
    running = jobs(16, 16, prefix="r")  # an 8 exited: 32 in use, 8 free
    pending = jobs(4, 4, 2, 16)
    # No 8 pending: fill with other sizes, largest that fits first (4 + 4 = 8).
    assert c.backfill(8, pending, running) == ["p0", "p1"]


def test_backfill_same_size_before_larger_that_fits() -> None:
    c = controller()
    running = jobs(8, 8, 8, prefix="r")  # 24 in use: 16 free
    pending = jobs(16, 8, 8)
    # 8s are running, so admission co-locates the pending 8s before the larger 16 ...
    assert c.admit(pending, running) == ["p1", "p2"]
    # ... but after a 16 exited, a pending 16 takes its place.
    assert c.backfill(16, pending, running) == ["p0"]
    # No pending job of the exited size: running sizes first, then the largest.
    assert c.backfill(4, pending, running) == ["p1", "p2"]
    assert c.backfill(4, pending, jobs(16, 8, prefix="r")) == ["p0"]


def test_token_budget_controller_for_cpu() -> None:
    c = AdmissionController.from_token_budget(max_tokens=4096, seq_len=256)
    assert c.fits(16) and not c.fits(17)
    assert c.admit(jobs(8, 8, 4, 2), []) == ["p0", "p1"]


def test_controller_validates_arguments() -> None:
    with pytest.raises(ValueError):
        AdmissionController(MODEL, 40 * GIB, SEQ, safety=0)
    with pytest.raises(ValueError):
        AdmissionController(MODEL, 0, SEQ)
    with pytest.raises(ValueError):
        AdmissionController(MODEL, GIB, SEQ, max_jobs=0)


def test_profile_memory_needs_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("covered by tests/gpu on a CUDA machine")
    with pytest.raises(RuntimeError, match="CUDA"):
        profile_memory(lambda b: None, [1, 2], 128)
