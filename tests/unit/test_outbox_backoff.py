"""Unit: the leased outbox's backoff (service.outbox.retry_at): the n-th failure waits the n-th
step (the last one beyond), jittered by 10%, 60 s without steps; past the give-up time, or a
final failure, gives up."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from service.outbox import retry_at

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def waited(tries: int, steps: list[float]) -> float:
    due = retry_at(NOW, tries, steps)
    assert due is not None
    return (due - NOW).total_seconds()


def test_steps_grow_then_hold_at_the_last_one() -> None:
    steps = [1.0, 10.0, 100.0]
    for tries, want in ((1, 1.0), (2, 10.0), (3, 100.0), (7, 100.0)):
        assert 0.9 * want <= waited(tries, steps) <= 1.1 * want
    assert 54.0 <= waited(1, []) <= 66.0


def test_gives_up_past_the_deadline_or_when_final() -> None:
    assert retry_at(NOW, 1, [10.0], give_up_at=NOW + timedelta(seconds=5)) is None
    assert retry_at(NOW, 1, [10.0], give_up_at=NOW + timedelta(seconds=20)) is not None
    assert retry_at(NOW, 1, [10.0], final=True) is None
