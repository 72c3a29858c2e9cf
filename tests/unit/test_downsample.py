"""service.downsample: at most max_points per curve, ordered by step, with the first and last
points, the global minimum, spikes and non-finite (null) losses kept."""

from __future__ import annotations

import math
import random

import pytest

from service.downsample import MIN_POINTS, downsample, keep_indices


def noisy_curve(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [2.0 * math.exp(-i / (n / 4)) + 0.05 * rng.random() + 0.3 for i in range(n)]


@pytest.mark.parametrize("n,max_points", [(5000, 300), (1001, 10), (64, 63), (10, 4), (7, 5)])
def test_bounded_ordered_first_last_min_kept(n: int, max_points: int) -> None:
    losses = noisy_curve(n, seed=n)
    steps = list(range(1, n + 1))
    s, ls = downsample(steps, losses, max_points)
    assert len(s) <= max_points and len(s) == len(ls)
    assert s == sorted(set(s))  # strictly increasing steps
    assert s[0] == 1 and s[-1] == n
    assert min(ls) == min(losses)
    assert max(ls) == max(losses)
    assert all(losses[step - 1] == loss for step, loss in zip(s, ls, strict=True))  # real points


def test_spike_and_null_survive_a_hundredfold_cut() -> None:
    n = 10_000
    losses: list[float | None] = noisy_curve(n, seed=1)
    losses[4321] = 50.0  # one spike
    losses[7777] = None  # one non-finite loss (null in the API)
    s, ls = downsample(list(range(n)), losses, 100)
    assert len(s) <= 100
    assert 4321 in s and 7777 in s
    assert ls[s.index(7777)] is None


def test_short_curves_and_no_limit_are_untouched() -> None:
    steps, losses = [1, 2, 3], [1.0, None, 0.5]
    assert downsample(steps, losses, 10) == (steps, losses)
    assert downsample(steps, losses, None) == (steps, losses)
    assert downsample([], [], 10) == ([], [])
    big = noisy_curve(50, seed=3)
    assert downsample(list(range(50)), big, None)[0] == list(range(50))


def test_last_point_kept_when_a_job_exits_early() -> None:
    # The curve of an exited job ends at its exit step: that point must be the last one kept.
    losses = noisy_curve(3000, seed=4)[:1234]
    idx = keep_indices(losses, 50)
    assert idx[-1] == 1233 and idx[0] == 0 and len(idx) <= 50


def test_tiny_limits_floor_at_min_points() -> None:
    losses = noisy_curve(100, seed=5)
    assert len(keep_indices(losses, 1)) <= MIN_POINTS
    assert keep_indices(losses, 1)[0] == 0 and keep_indices(losses, 1)[-1] == 99
