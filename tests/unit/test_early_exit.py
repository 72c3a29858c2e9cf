"""Early-exit detectors on synthetic loss curves, the warmup ranking arithmetic and the config.
Curves are deterministic (seeded random.Random); nothing here needs torch."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
from pydantic import ValidationError

from contract.protocol import EarlyExitSettings
from trainer.early_exit import (
    ExitDecision,
    JobMonitor,
    WarmupRanking,
    keep_count,
    regression_slope,
    relative_slope,
    warmup_ranking,
    warmup_steps,
)

Curve = Callable[[int], float]


def run(
    train: Curve,
    val: Curve,
    steps: int = 1000,
    eval_every: int = 25,
    cfg: EarlyExitSettings | None = None,
) -> tuple[JobMonitor, ExitDecision | None, int | None]:
    """Feed a job's curves to a monitor the way the executor does; stop at the first exit."""
    mon = JobMonitor(cfg or EarlyExitSettings())
    for step in range(1, steps + 1):
        mon.observe_train(step, train(step))
        if step % eval_every == 0:
            decision = mon.observe_eval(step, val(step))
            if decision is not None:
                return mon, decision, step
    return mon, None, None


def healthy(t: int) -> float:
    return 1.0 + 2.0 * math.exp(-t / 400.0)


def noisy(curve: Curve, sd: float, seed: int) -> Curve:
    rng = random.Random(seed)
    return lambda t: curve(t) + rng.gauss(0.0, sd)


def test_diverging_job_exits_soon_after_the_rise() -> None:
    def loss(t: int) -> float:
        return healthy(t) + (0.0 if t < 400 else math.exp((t - 400) / 60.0) - 1.0)

    mon, decision, step = run(noisy(loss, 0.05, 1), noisy(lambda t: 1.03 * loss(t), 0.005, 2))
    assert decision is not None and decision.reason == "diverging"
    assert 400 < step <= 500
    d = decision.details
    assert d["slope_val"] >= 0.001 and d["slope_ema_train"] >= 0.001
    assert d["consecutive_evals"] == 2 and d["step"] == step
    assert mon.best_step is not None and mon.best_step <= 425
    assert mon.decision is decision


def test_overfitting_job_exits_and_keeps_best_checkpoint() -> None:
    # Train keeps falling after step 300 (memorisation), validation turns back up.
    def train(t: int) -> float:
        return healthy(t) - (0.0 if t < 300 else 0.6 * (1 - math.exp(-(t - 300) / 150.0)))

    def val(t: int) -> float:
        return healthy(t) + (0.0 if t < 300 else 0.0008 * (t - 300))

    seen: list[tuple[int, float]] = []
    mon = JobMonitor()
    decision = None
    for t in range(1, 1001):
        mon.observe_train(t, train(t))
        if t % 25 == 0:
            v = val(t)
            seen.append((t, v))
            decision = mon.observe_eval(t, v)
            if mon.last_eval_was_best:
                assert mon.best_step == t
            if decision is not None:
                break
    assert decision is not None and decision.reason == "overfitting"
    assert decision.details["gap_ratio"] > 0.1
    best_step, best_val = min(seen, key=lambda p: p[1])
    assert (mon.best_step, mon.best_val) == (best_step, best_val)
    assert decision.details["best_step"] == best_step
    # Exited within a few evaluations of the gap opening past 10%, long before the end.
    assert decision.details["step"] < 1000


@pytest.mark.parametrize("seed", range(20))
def test_noisy_but_healthy_job_never_exits(seed: int) -> None:
    train = noisy(healthy, 0.15, seed)
    val = noisy(lambda t: 1.02 * healthy(t), 0.004, 1000 + seed)
    mon, decision, _ = run(train, val)
    assert decision is None
    assert mon.diverge_count < 2 and mon.overfit_count < 2
    assert mon.best_val < 1.3


@pytest.mark.parametrize("seed", range(10))
def test_late_improving_job_never_exits(seed: int) -> None:
    # A long flat plateau (with noise) and then a drop: neither rising nor overfitting.
    def loss(t: int) -> float:
        return 2.0 if t < 600 else 1.0 + math.exp(-(t - 600) / 100.0)

    mon, decision, _ = run(noisy(loss, 0.2, seed), noisy(loss, 0.01, 500 + seed))
    assert decision is None
    assert mon.best_val < 1.1 and mon.best_step > 600


def test_transient_spike_resets_patience() -> None:
    # Step 500: train and validation spike together (a bad batch, an lr bump) and recover.
    # Step 700: validation alone spikes past the overfitting gap and recovers.
    def val(t: int) -> float:
        return healthy(t) * {500: 1.5, 700: 1.3}.get(t, 1.0)

    def train(t: int) -> float:
        return healthy(t) * (1.8 if 480 <= t <= 500 else 1.0)

    mon = JobMonitor()
    at = {}
    for t in range(1, 1001):
        mon.observe_train(t, train(t))
        if t % 25 == 0:
            assert mon.observe_eval(t, val(t)) is None
            at[t] = (mon.diverge_count, mon.overfit_count)
    assert at[500] == (1, 0)  # both slopes rose once ...
    assert at[525] == (0, 0)  # ... and the recovery reset the counter
    assert at[700] == (0, 1)  # the validation gap opened once ...
    assert at[725] == (0, 0)  # ... and closed again


def test_min_steps_is_a_grace_period_for_the_loss_detectors_only() -> None:
    def loss(t: int) -> float:
        return healthy(t) + (0.0 if t < 400 else math.exp((t - 400) / 60.0) - 1.0)

    _, plain, at = run(noisy(loss, 0.05, 1), noisy(lambda t: 1.03 * loss(t), 0.005, 2))
    assert plain is not None and at is not None
    grace = at + 100
    _, decision, step = run(noisy(loss, 0.05, 1), noisy(lambda t: 1.03 * loss(t), 0.005, 2),
                            cfg=EarlyExitSettings(min_steps=grace))
    # the detectors kept counting: the job exits at the first evaluation the grace allows
    assert decision is not None and decision.reason == "diverging" and step == grace
    # a non-finite loss is not waited for
    mon = JobMonitor(EarlyExitSettings(min_steps=10_000))
    assert mon.observe_train(3, float("nan")) is not None
    with pytest.raises(ValidationError):
        EarlyExitSettings(min_steps=-1)


def test_nan_loss_is_divergence_at_once() -> None:
    mon = JobMonitor()
    for t in range(1, 30):
        assert mon.observe_train(t, 2.0) is None
    d = mon.observe_train(30, float("nan"))
    assert d is not None and d.reason == "diverging" and d.details["non_finite"] == "train_loss"
    assert math.isfinite(mon.ema_train)  # the NaN does not poison the average
    later = mon.observe_eval(50, 2.0)
    assert later is not None and later.reason == "diverging" and later.details["step"] == 30

    mon2 = JobMonitor()
    mon2.observe_train(1, 2.0)
    d2 = mon2.observe_eval(10, float("inf"))
    assert d2 is not None and d2.details["non_finite"] == "val_loss"
    assert mon2.best_step is None


def test_disabled_monitor_tracks_but_never_exits() -> None:
    def loss(t: int) -> float:
        return math.exp(t / 200.0)  # rising 0.5% per step from the start

    mon, decision, _ = run(loss, loss, cfg=EarlyExitSettings(enabled=False))
    assert decision is None and mon.diverge_count > 2
    assert mon.best_step == 25
    assert mon.observe_train(2000, float("nan")) is None


def test_ema_is_bias_corrected_and_tracks_loss() -> None:
    mon = JobMonitor(EarlyExitSettings(ema_alpha=0.1))
    assert math.isnan(mon.ema_train)
    mon.observe_train(1, 4.0)
    assert mon.ema_train == pytest.approx(4.0)
    mon.observe_train(2, 2.0)
    # (0.9*0.1*4 + 0.1*2) / (1 - 0.81)
    assert mon.ema_train == pytest.approx((0.036 * 10 + 0.2) / 0.19)
    for t in range(3, 200):
        mon.observe_train(t, 1.0)
    assert mon.ema_train == pytest.approx(1.0, abs=1e-6)


def test_slopes() -> None:
    assert regression_slope([0, 1, 2], [1.0, 3.0, 5.0]) == pytest.approx(2.0)
    assert regression_slope([0, 10], [2.0, 1.0]) == pytest.approx(-0.1)
    # Relative per step: +1% of the mean over 10 steps = 0.001 per step.
    assert relative_slope([100, 110], [0.995, 1.005]) == pytest.approx(0.001)
    # Same rate, ten times the loss scale: same relative slope.
    assert relative_slope([100, 110], [9.95, 10.05]) == pytest.approx(0.001)
    with pytest.raises(ValueError):
        regression_slope([3, 3], [1.0, 2.0])


def test_eval_steps_must_increase() -> None:
    mon = JobMonitor()
    mon.observe_train(1, 1.0)
    mon.observe_eval(10, 1.0)
    with pytest.raises(ValueError):
        mon.observe_eval(10, 1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": 1}, {"patience": 0}, {"tau_gap": -0.1}, {"tau_slope": float("nan")},
        {"warmup_fraction": 1.0}, {"warmup_fraction": -0.1}, {"keep_fraction": 0.0},
        {"keep_fraction": 1.5}, {"ema_alpha": 0.0},
    ],
)
def test_config_rejects_out_of_range(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        EarlyExitSettings(**kwargs)


def test_config_defaults_and_frozen() -> None:
    cfg = EarlyExitSettings()
    assert (cfg.window, cfg.patience, cfg.tau_gap, cfg.tau_slope) == (2, 2, 0.1, 0.001)
    assert (cfg.warmup_fraction, cfg.keep_fraction, cfg.enabled) == (0.05, 0.25, True)
    with pytest.raises(ValidationError):
        cfg.window = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("total", "frac", "expected"),
    [(100, 0.05, 5), (101, 0.05, 6), (10, 0.05, 1), (1, 0.05, 1), (1000, 0.0, 1), (3, 0.9, 3)],
)
def test_warmup_steps(total: int, frac: float, expected: int) -> None:
    assert warmup_steps(total, frac) == expected
    assert EarlyExitSettings(warmup_fraction=frac).warmup_steps(total) == expected


@pytest.mark.parametrize(
    ("n", "ratio", "expected"),
    [(0, 0.25, 0), (1, 0.25, 1), (4, 0.25, 1), (5, 0.25, 2), (24, 0.25, 6), (30, 0.1, 3),
     (7, 1.0, 7), (3, 0.5, 2)],
)
def test_keep_count_is_ceil(n: int, ratio: float, expected: int) -> None:
    assert keep_count(n, ratio) == expected


def test_warmup_ranking_orders_by_loss_with_nan_last_and_stable_ties() -> None:
    losses = {"a": 2.0, "b": float("nan"), "c": 1.0, "d": 1.5, "e": 1.0, "f": float("inf"),
              "g": 3.0, "h": 1.5}
    keep, evict = warmup_ranking(losses, 0.25)
    assert keep == ["c", "e"]
    assert evict == ["d", "h", "a", "g", "b", "f"]
    keep, evict = warmup_ranking(losses, 0.5)
    assert keep == ["c", "e", "d", "h"]
    # Reversing the input order reverses the order of equal losses only.
    rev = dict(reversed(list(losses.items())))
    assert warmup_ranking(rev, 0.5)[0] == ["e", "c", "h", "d"]


def test_warmup_ranking_edge_cases() -> None:
    assert warmup_ranking({}, 0.25) == ([], [])
    assert warmup_ranking({"only": float("nan")}, 0.25) == (["only"], [])
    assert warmup_ranking({"x": 1.0, "y": 0.5}, 0.25) == (["y"], ["x"])
    losses = {f"j{i}": float(i % 5) for i in range(24)}
    keep, evict = warmup_ranking(losses, 0.25)
    assert len(keep) == 6 and len(evict) == 18
    assert max(losses[j] for j in keep) <= min(losses[j] for j in evict)
    assert sorted(keep + evict) == sorted(losses)


def test_warmup_ranking_tracker_with_rotation() -> None:
    wr = WarmupRanking(["a", "b", "c"], keep_fraction=0.5)
    wr.report("a", 1.0)
    wr.exit("b")  # diverged during warmup: not a survivor
    assert not wr.ready and wr.waiting == ["c"]
    wr.add("d")  # a queued configuration rotated in
    with pytest.raises(RuntimeError):
        wr.decide()
    wr.report("c", 0.5)
    wr.report("d", 2.0)
    assert wr.ready
    assert wr.decide() == (["c", "a"], ["d"])  # ceil(0.5 * 3 survivors) = 2
    decisions = wr.eviction_decisions()
    assert list(decisions) == ["d"]
    d = decisions["d"]
    assert d.reason == "underperforming"
    assert d.details["val_loss"] == 2.0 and d.details["rank"] == 3
    assert (d.details["ranked"], d.details["kept"], d.details["worst_kept_val_loss"]) == (3, 2, 1.0)
    with pytest.raises(KeyError):
        wr.report("a", 0.1)
    with pytest.raises(RuntimeError):
        wr.add("e")
