"""Unit: the one-message reports (contract.protocol.REPORTS) through the spool and the daemon's
Forwarder by one table: the executor's timings become one POST .../timings carrying
ExecutorTimings, a record the contract refuses is dropped without stalling what follows, an
older writer's flat finished/failed record still ends the task, and an unknown kind is refused
at the writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.protocol import REPORTS, ExecutorTimings
from tests.unit.test_daemon_forwarding import FakeService, make_client
from worker.forwarder import Forwarder
from worker.runner import timings_report
from worker.spool import SpoolWriter

TIMINGS = {"wall_s": 42.5, "load_s": 3.0, "train_s": 30.25, "eval_s": 4.0, "idle_s": 5.25,
           "first_step_s": 6.5, "writer_checkpoint_s": 0.5, "profile_reused": True,
           "global_step": 20, "recompute": "auto", "recompute_steps": 2, "no_recompute_steps": 18}


def test_timings_split_into_phases_and_details() -> None:
    fields = timings_report(TIMINGS | {"odd": [1, 2], "nan_s": float("nan")})
    msg = ExecutorTimings(placement_id="plc_1", **fields)
    assert (msg.wall_s, msg.first_step_s) == (42.5, 6.5)
    assert msg.phases == {"load": 3.0, "train": 30.25, "eval": 4.0, "idle": 5.25,
                          "writer_checkpoint": 0.5}
    assert msg.details == {"profile_reused": True, "global_step": 20, "recompute": "auto",
                           "recompute_steps": 2, "no_recompute_steps": 18}
    assert timings_report({"wall_s": 1.0, "first_step_s": None})["first_step_s"] is None


def test_forwarder_dispatches_reports_by_the_table(tmp_path: Path) -> None:
    fake = FakeService()
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    spool.metric("job_a", 1, "train", 2.0)
    spool.report("timings", timings_report(TIMINGS))
    spool.report("timings", {"wall_s": -1.0})  # refused by the contract: dropped, not stalled
    spool.finished(best_job_id="job_a")
    fwd = Forwarder(make_client(fake), tmp_path, "task_1", "plc_1")
    fwd.pump()
    assert fake.paths() == ["metrics", "timings", "finished"]
    [(method, path, body)] = [c for c in fake.calls if c[1].endswith("/timings")]
    assert (method, path) == ("POST", "/internal/v1" + REPORTS["timings"].path.format(
        task_id="task_1"))
    assert ExecutorTimings.model_validate(body).phases["train"] == 30.25
    assert body["placement_id"] == "plc_1"
    assert fwd.done and fwd.state.terminal == "finished" and fwd.state.dropped == 1


def test_older_flat_terminal_record_still_ends_the_task(tmp_path: Path) -> None:
    (tmp_path / "spool.jsonl").write_text(json.dumps(
        {"type": "failed", "error": "boom", "retryable": False, "detail": None}) + "\n")
    fake = FakeService()
    fwd = Forwarder(make_client(fake), tmp_path, "task_1", "plc_1")
    fwd.pump()
    [(_, path, body)] = fake.calls
    assert path.endswith("/failed") and body == {"placement_id": "plc_1", "error": "boom",
                                                 "retryable": False}
    assert fwd.state.terminal == "failed"


def test_unknown_report_kind_is_refused_at_the_writer(tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    with pytest.raises(ValueError, match="unknown report"):
        spool.report("nope", {})
    assert (tmp_path / "spool.jsonl").read_text() == ""
