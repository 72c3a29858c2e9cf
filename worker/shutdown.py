"""How the daemon is asked to end: SIGTERM drains (no new placements, running ones finish), a
second SIGTERM or SIGINT stops (executors get SIGTERM, their tasks are reported retryable);
either one ends a daemon still waiting to register."""

from __future__ import annotations

import signal
import time


class Shutdown:
    """The flags the signal handlers set (a handler does nothing else) and a sleep they end."""

    def __init__(self) -> None:
        self.drain = False
        self.stop = False

    @property
    def requested(self) -> bool:
        return self.drain or self.stop

    def install(self) -> None:
        def on_term(signum: int, _frame: object) -> None:
            if self.drain:
                self.stop = True
            self.drain = True

        def on_int(signum: int, _frame: object) -> None:
            self.drain = self.stop = True

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_int)

    def sleep(self, seconds: float) -> None:
        """Sleep in short slices so a signal ends the wait."""
        deadline = time.monotonic() + seconds
        while not self.requested:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.1, left))
