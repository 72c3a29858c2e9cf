"""Held ends under adapter parallelism (CPU, gloo, 2 ranks, tiny Llama): the search of
tests/unit/test_warmup_hold.py with every job admitted at once over the ranks ends every job as
one process does, however many it runs at once; the held jobs leave their own rank's engine only
and a kept held completion still writes its final adapter (trainer.warmup_hold)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_warmup_hold import EXPECTED, Recorder, search, statuses
from trainer.launch import run_parallel

pytestmark = pytest.mark.usefixtures("one_thread")


def test_held_ends_on_two_ranks_end_as_in_one_process(tmp_path: Path) -> None:
    rec = Recorder()
    status = run_parallel(search(tmp_path, "par", 3), 2, rec.callbacks())  # 3 a rank: all five at once
    assert statuses(status) == EXPECTED
    assert {j: d["exit_reason"] for j, d in rec.named("exit_held").items()} == {"nan_later": "diverging"}
    assert sorted(rec.named("completion_held")) == ["keep_short", "slow_short"]
    assert not rec.named("parked_after_warmup")
    assert ("keep_short", "final") in rec.adapters
    assert (tmp_path / "par" / "jobs" / "keep_short" / "final" / "adapter_model.safetensors").exists()
