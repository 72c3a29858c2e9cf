"""Unit: the one background worker (contract.background): steps until stopped, again at once
while busy, early on its wake event, restarted with backoff after a crash, its health kept, and
a step may end its own loop."""

from __future__ import annotations

import threading
import time

from contract.background import BackgroundWorker, Backoff


def wait_until(predicate, timeout: float = 5.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_backoff_grows_to_its_cap() -> None:
    b = Backoff(0.5, 3.0)
    assert [b.delay(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert Backoff(2.0, 2.0).delay(7) == 2.0


def test_a_crash_is_restarted_with_backoff_and_kept_in_health() -> None:
    calls: list[float] = []

    def step() -> None:
        calls.append(time.monotonic())
        if len(calls) <= 3:
            raise RuntimeError(f"boom {len(calls)}")

    w = BackgroundWorker("t-crash", step, every_s=60, backoff=Backoff(0.05, 0.2)).start()
    try:
        assert wait_until(lambda: len(calls) >= 4)
        assert calls[2] - calls[1] >= 0.09 and calls[3] - calls[2] >= 0.18  # 0.05, 0.1, 0.2
        h = w.health()
        assert h.alive and h.name == "t-crash" and h.crashes == 3 and h.failures == 0
        assert h.runs == 1 and h.last_run_at is not None
        assert h.last_error == "RuntimeError: boom 3" and h.last_error_at is not None
    finally:
        w.stop(5)
    assert not w.alive and not w.health().alive


def test_busy_steps_again_at_once_and_wake_ends_the_wait() -> None:
    wake = threading.Event()
    runs: list[int] = []
    w = BackgroundWorker("t-wake", lambda: runs.append(1) or len(runs) < 3, every_s=60,
                         wake=wake).start()
    try:
        assert wait_until(lambda: len(runs) == 3)  # two busy passes, then it waits
        time.sleep(0.1)
        assert len(runs) == 3
        wake.set()
        assert wait_until(lambda: len(runs) == 4)
    finally:
        t0 = time.monotonic()
        w.stop(5)
    assert time.monotonic() - t0 < 2 and not w.alive  # stop sets the wake event


def test_wait_first_and_a_step_that_stops_its_loop() -> None:
    runs: list[int] = []

    def step() -> None:
        runs.append(1)
        if len(runs) == 2:
            w.stop()  # from inside: asks only

    w = BackgroundWorker("t-self", step, every_s=0.05, wait_first=True)
    t0 = time.monotonic()
    w.start()
    assert wait_until(lambda: not w.alive)
    assert runs == [1, 1] and time.monotonic() - t0 >= 0.09 and w.stopping
