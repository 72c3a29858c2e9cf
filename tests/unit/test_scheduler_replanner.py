"""Unit: the background replanner thread coalesces bursts of triggers, never blocks the caller on
a running replan, runs the periodic pass only when due, and survives a replan that raises."""

from __future__ import annotations

import threading
import time

from service.scheduler.replanner import Replanner, lookup, register, unregister


class Recorder:
    def __init__(self, delay: float = 0.0, fail_first: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.threads: set[str] = set()
        self.delay, self.fail_first = delay, fail_first
        self.started = threading.Event()

    def __call__(self, reasons: list[str]) -> None:
        self.started.set()
        self.threads.add(threading.current_thread().name)
        self.calls.append(reasons)
        time.sleep(self.delay)
        if self.fail_first and len(self.calls) == 1:
            raise RuntimeError("solver blew up")


def test_burst_of_triggers_is_one_or_two_replans() -> None:
    run = Recorder(delay=0.05)
    r = Replanner(run, due=lambda: False, interval_s=0, debounce_s=0.2).start()
    try:
        for i in range(50):
            r.trigger("task_created" if i % 2 else "task_cancelled")
        assert r.wait_idle(10)
        assert 1 <= len(run.calls) <= 2, run.calls
        assert set(run.calls[0]) <= {"task_created", "task_cancelled"}
        assert run.threads == {"loraplex-replanner"}
    finally:
        r.stop()


def test_trigger_during_a_replan_does_not_block_and_runs_again() -> None:
    gate = threading.Event()
    calls: list[list[str]] = []

    def slow(reasons: list[str]) -> None:
        calls.append(reasons)
        if len(calls) == 1:
            gate.wait(5)

    r = Replanner(slow, interval_s=0, debounce_s=0.01).start()
    try:
        r.trigger("a")
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.005)
        assert calls == [["a"]]
        t0 = time.perf_counter()
        r.trigger("b")  # the first replan is still blocked on the gate
        assert time.perf_counter() - t0 < 1.0  # the first replan holds the gate for 5 s
        assert not r.wait_idle(0.2), "b is not served while the first replan runs"
        gate.set()
        assert r.wait_idle(5)
        assert calls == [["a"], ["b"]]
    finally:
        gate.set()
        r.stop()


def test_periodic_pass_runs_only_when_due() -> None:
    run = Recorder()
    due = threading.Event()
    r = Replanner(run, due=due.is_set, interval_s=0.02, debounce_s=0).start()
    try:
        time.sleep(0.2)
        assert run.calls == [], "nothing due: no periodic replan"
        due.set()
        deadline = time.monotonic() + 5
        while len(run.calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert run.calls[:2] == [["periodic"], ["periodic"]]
    finally:
        r.stop()


def test_failing_replan_keeps_the_thread_alive() -> None:
    run = Recorder(fail_first=True)
    r = Replanner(run, interval_s=0, debounce_s=0).start()
    try:
        r.trigger("x")
        assert r.wait_idle(5)
        r.trigger("y")
        assert r.wait_idle(5)
        assert run.calls == [["x"], ["y"]] and r.alive
    finally:
        r.stop()
    assert not r.alive


def test_registry_finds_only_live_replanners() -> None:
    r = Replanner(Recorder(), interval_s=0)
    register("db-a", r)
    try:
        assert lookup("db-a") is None, "not started yet"
        r.start()
        assert lookup("db-a") is r and lookup("db-b") is None
        unregister("db-a", Replanner(Recorder()))  # another one's unregister is a no-op
        assert lookup("db-a") is r
    finally:
        unregister("db-a", r)
        r.stop()
    assert lookup("db-a") is None
