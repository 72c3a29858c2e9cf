"""The one background worker every loop runs on (the service's leader loops, outboxes and
replanner; the node daemon's heartbeat; a shared executor's control): a named daemon thread that
runs a step again and again until stopped, restarts it with backoff when it raises, and keeps
its health (alive, last run, last error). In the contract because the service and the node agent
both use it and import nothing of each other; it imports the stdlib alone."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

log = logging.getLogger("loraplex.background")


@dataclass(frozen=True)
class Backoff:
    """How long a worker waits after its n-th failure in a row: base_s * factor**(n-1), at
    most cap_s (base_s == cap_s: a constant wait)."""

    base_s: float
    cap_s: float
    factor: float = 2.0

    def delay(self, failures: int) -> float:
        return min(self.cap_s, self.base_s * self.factor ** max(0, failures - 1))


@dataclass(frozen=True)
class Health:
    """A worker as an operator sees it: alive, its steps that returned (runs, the last one's
    time) and those that raised (in a row and all told, the last error and its time)."""

    name: str
    alive: bool
    runs: int
    last_run_at: datetime | None
    failures: int  # in a row: 0 once a step returns
    crashes: int  # all told
    last_error: str | None
    last_error_at: datetime | None


def _now() -> datetime:
    return datetime.now(timezone.utc)


class BackgroundWorker:
    """Runs ``step()`` in a daemon thread named ``name`` until ``stop()``.

    After a step that returns True (busy: more is due) it steps again at once; otherwise it
    waits ``every_s`` (``wait_first``: also before the first step). With a ``wake`` event the
    wait ends early when the event is set (and clears it): the loop's "something is due now".
    A step that raises is logged (the first of a run of failures as a warning, with its
    traceback) and tried again after ``backoff.delay(failures)`` (default: ``every_s``,
    constant). The step may call ``stop()`` itself to end the loop; ``join()`` waits for that
    end, and a later ``start()`` runs the loop again in a new thread (a worker that stops itself
    once its work is done and is started again when more comes: trainer.checkpoint.FileWriter,
    trainer.host_pool.PinnedPool)."""

    def __init__(self, name: str, step: Callable[[], object], *, every_s: float = 0.0,
                 wake: threading.Event | None = None, wait_first: bool = False,
                 backoff: Backoff | None = None, logger: logging.Logger | None = None,
                 stop_s: float | None = None) -> None:
        self.name, self._step, self.every_s, self.stop_s = name, step, every_s, stop_s
        self._wake, self._wait_first = wake, wait_first
        self.backoff = backoff or Backoff(every_s, every_s)
        self._log = logger or log
        self._stop = threading.Event()
        self._starting = threading.Lock()
        self._thread = self._new_thread()
        self._runs = self._failures = self._crashes = 0
        self._last_run_at: datetime | None = None
        self._last_error: str | None = None
        self._last_error_at: datetime | None = None

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._loop, name=self.name, daemon=True)

    def start(self) -> BackgroundWorker:
        """Run the loop in its thread. A running worker runs on (a no-op); one whose loop ended
        (stopped) runs again in a new thread, its health carried on; one asked to stop whose
        step is still finishing is waited for first (from inside the step: it runs on)."""
        with self._starting:
            if self._thread.is_alive():
                if not self._stop.is_set():
                    return self
                if threading.current_thread() is self._thread:
                    self._stop.clear()
                    return self
                self._thread.join()
            if self._thread.ident is not None:  # a thread runs once: a fresh one
                self._thread = self._new_thread()
            self._stop.clear()
            self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Ask the loop to end (a step under way finishes) and wait up to ``timeout`` (default
        ``stop_s``; None: until it ended) for it; from inside the step, only ask."""
        self._stop.set()
        if self._wake is not None:
            self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout if timeout is not None else self.stop_s)

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` (None: as long as it takes) for the loop to end, without asking
        it to (a step that stops itself once its work is done); True once it is not running."""
        thread = self._thread
        if thread.is_alive() and threading.current_thread() is not thread:
            thread.join(timeout)
        return not thread.is_alive()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait(self, seconds: float | None) -> bool:
        """For a step that waits itself: sleep up to ``seconds``; True once stop() was asked."""
        return self._stop.wait(seconds)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def running(self) -> bool:
        """Alive and not asked to stop."""
        return self._thread.is_alive() and not self._stop.is_set()

    def health(self) -> Health:
        return Health(self.name, self.alive, self._runs, self._last_run_at, self._failures,
                      self._crashes, self._last_error, self._last_error_at)

    def _loop(self) -> None:
        if self._wait_first:
            self._pause(self.every_s)
        while not self._stop.is_set():
            try:
                busy = self._step() is True
            except Exception as exc:  # noqa: BLE001 - the step's crash: logged, then restarted
                self._crashed(exc)
                self._pause(self.backoff.delay(self._failures))
                continue
            self._runs, self._failures, self._last_run_at = self._runs + 1, 0, _now()
            if not busy:
                self._pause(self.every_s)

    def _crashed(self, exc: Exception) -> None:
        self._failures += 1
        self._crashes += 1
        self._last_error = f"{type(exc).__name__}: {exc}"[:500]
        self._last_error_at = _now()
        if self._failures == 1:
            self._log.warning("background worker failed name=%s error=%s", self.name,
                              self._last_error, exc_info=exc)
        else:
            self._log.debug("background worker failed again name=%s failures=%d error=%s",
                            self.name, self._failures, self._last_error)

    def _pause(self, seconds: float) -> None:
        if self._stop.is_set() or seconds <= 0:
            return
        if self._wake is None:
            self._stop.wait(seconds)
        else:
            self._wake.wait(seconds)
            self._wake.clear()
