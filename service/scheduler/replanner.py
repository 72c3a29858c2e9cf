"""The per-process background replanner: requests signal it instead of solving inline; a burst of
signals becomes one replan (two if more arrive mid-solve), plus a periodic pass when due."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from contract.background import BackgroundWorker, Backoff, Health

log = logging.getLogger("loraplex.scheduler")

_registry: dict[str, Replanner] = {}
_registry_lock = threading.Lock()


class Replanner:
    """A daemon thread that runs ``run(reasons)`` after ``trigger`` calls (debounced) and every
    ``interval_s`` when ``due()`` says so. No database code here: service.cluster gives it both
    (replan and commit; is a periodic replan worth it); pg's advisory lock in replan serialises
    the replanners of several API replicas. ``wait_idle`` lets tests wait for it to settle."""

    def __init__(self, run: Callable[[list[str]], None], due: Callable[[], bool] | None = None,
                 interval_s: float = 5.0, debounce_s: float = 0.1,
                 name: str = "loraplex-replanner") -> None:
        self._run, self._due = run, due
        self.interval_s, self.debounce_s = interval_s, debounce_s
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self._reasons: list[str] = []
        self._requested = 0  # triggers so far
        self._served = 0  # triggers covered by a finished replan
        self.replans = 0  # replans run (triggered + periodic), for tests and logs
        # The step waits on _wake itself (every_s=0); stop() sets it after asking the loop to end.
        self.worker = BackgroundWorker(name, self._step, wake=self._wake, logger=log,
                                       backoff=Backoff(1.0, 30.0))

    def start(self) -> Replanner:
        self.worker.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.worker.stop(timeout)

    @property
    def alive(self) -> bool:
        return self.worker.alive

    def health(self) -> Health:
        return self.worker.health()

    def trigger(self, reason: str) -> None:
        """Ask for a replan soon; never blocks on the solver."""
        with self._cond:
            self._requested += 1
            self._reasons.append(reason)
        self._wake.set()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until every trigger made before this call is covered by a finished replan."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._requested
            while self._served < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive:
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    def _step(self) -> None:
        woke = self._wake.wait(self.interval_s if self.interval_s > 0 else None)
        if self.worker.stopping:
            return
        if woke:
            # Let the rest of a burst arrive, then take every trigger so far in one replan.
            self.worker.wait(self.debounce_s)
            self._wake.clear()
            with self._cond:
                target, reasons, self._reasons = self._requested, self._reasons, []
            self._safe_run(sorted(set(reasons)))
            with self._cond:
                self._served = max(self._served, target)
                self._cond.notify_all()
        elif self._is_due():
            self._safe_run(["periodic"])

    def _is_due(self) -> bool:
        if self._due is None:
            return True
        try:
            return self._due()
        except Exception:
            log.exception("replanner due-check failed")
            return False

    def _safe_run(self, reasons: list[str]) -> None:
        start = time.perf_counter()
        try:
            self._run(reasons)
        except Exception:
            log.exception("background replan failed reasons=%s", ",".join(reasons))
        self.replans += 1
        log.debug("background replan reasons=%s seconds=%.3f", ",".join(reasons),
                  time.perf_counter() - start)


def register(key: str, replanner: Replanner) -> None:
    """Make ``replanner`` the one cluster_changed signals for this database (key: its URL)."""
    with _registry_lock:
        _registry[key] = replanner


def unregister(key: str, replanner: Replanner) -> None:
    with _registry_lock:
        if _registry.get(key) is replanner:
            del _registry[key]


def lookup(key: str) -> Replanner | None:
    with _registry_lock:
        found = _registry.get(key)
    return found if found is not None and found.alive else None
