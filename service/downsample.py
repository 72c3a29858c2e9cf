"""Loss-curve downsampling for GET /v1/tasks/{id}/metrics?max_points=N: at most N points per curve
that still show its shape (the dashboard draws 60 jobs x thousands of steps on one chart).

Min/max per bucket: the first and last points are always kept, the steps in between are cut into
equal buckets and each bucket keeps its lowest and its highest loss (a non-finite loss, reported
as null, counts as the highest: a divergence is never averaged away). So the global minimum, every
spike and the step an early exit stopped at survive; the result stays ordered by step."""

from __future__ import annotations

from collections.abc import Sequence

MIN_POINTS = 4


def _extremes(losses: Sequence[float | None], lo: int, hi: int) -> set[int]:
    """Indices of the lowest and the highest loss in losses[lo:hi] (a null is the highest)."""
    low = high = None
    for i in range(lo, hi):
        loss = losses[i]
        if loss is None:
            if high is None or losses[high] is not None:
                high = i
            continue
        if low is None or loss < losses[low]:
            low = i
        if high is None or (losses[high] is not None and loss > losses[high]):
            high = i
    return {i for i in (low, high) if i is not None}


def keep_indices(losses: Sequence[float | None], max_points: int) -> list[int]:
    """Sorted indices of the points to keep, at most max(max_points, MIN_POINTS) of them."""
    n = len(losses)
    max_points = max(max_points, MIN_POINTS)
    if n <= max_points:
        return list(range(n))
    buckets = (max_points - 2) // 2  # two points per bucket, plus the first and the last
    inner = n - 2
    keep = {0, n - 1}
    for b in range(buckets):
        lo = 1 + b * inner // buckets
        hi = 1 + (b + 1) * inner // buckets
        keep |= _extremes(losses, lo, hi)
    return sorted(keep)


def downsample(steps: Sequence[int], losses: Sequence[float | None], max_points: int | None
               ) -> tuple[list[int], list[float | None]]:
    """(steps, losses) of one curve cut to at most max_points; None keeps every point."""
    if max_points is None or len(steps) <= max(max_points, MIN_POINTS):
        return list(steps), list(losses)
    idx = keep_indices(losses, max_points)
    return [steps[i] for i in idx], [losses[i] for i in idx]
