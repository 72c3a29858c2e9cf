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


def test_a_stopped_worker_starts_again_in_a_new_thread() -> None:
    """A worker whose step stops it once its work is done (join waits for that) runs again on a
    later start, in a fresh daemon thread of the same name, its health carried on; start while
    it runs is a no-op; start while a stop is under way waits for the old loop first."""
    todo: list[int] = []
    done: list[int] = []
    release = threading.Event()
    release.set()

    def step() -> bool:
        if not todo:
            w.stop()  # the work is done: the loop ends
            return False
        release.wait(5)
        done.append(todo.pop(0))
        return True

    w = BackgroundWorker("t-again", step, every_s=60)
    assert w.join(0) and not w.running  # never started: nothing to wait for
    todo += [1, 2]
    w.start()
    first = w._thread
    assert w.join(5) and done == [1, 2] and not w.alive and w.stopping
    todo.append(3)
    w.start()
    assert w.join(5) and done == [1, 2, 3]
    assert w._thread is not first and w._thread.daemon and w._thread.name == "t-again"
    assert w.health().runs == 5  # 3 writes + 2 stopping steps, over both threads

    release.clear()
    todo.append(4)
    w.start()
    assert wait_until(lambda: w.running)
    running = w._thread
    assert w.start() is w and w._thread is running  # running: a no-op
    w.stop(0)  # asked to stop while its step waits
    assert w.stopping and w.alive
    todo.append(5)
    starter = threading.Thread(target=w.start)
    starter.start()
    time.sleep(0.1)
    assert starter.is_alive()  # waits for the old loop to end
    release.set()
    starter.join(5)
    assert w.join(5) and done == [1, 2, 3, 4, 5] and w._thread is not running
