"""The co-location path of the scheduler on random states (tests/helpers/colocation_fuzz.py): the
call sequence of loop.colocation() + replan() without the database, and its invariants on every
plan. Session 10's fuzz found three bugs this way (about 1% of states failed); these seeds run
clean and must exercise joins, warm moves and quota reclaim, or they prove nothing."""

from __future__ import annotations

import pytest

from tests.helpers.colocation_fuzz import run


@pytest.mark.parametrize(("seed0", "n", "weird"), [(0, 300, False), (10_000, 200, True)])
def test_random_states_keep_the_colocation_invariants(seed0: int, n: int, weird: bool) -> None:
    report = run(n, seed0, weird)
    assert not report.fails, (dict(report.fails), report.examples)
    assert report.info["instances"] == n
    for exercised in ("joins", "occupants", "reclaim victims", "prefer_warm moved",
                      "busy executors usable", "idle executors usable"):
        assert report.info[exercised] > 0, (exercised, dict(report.info))
