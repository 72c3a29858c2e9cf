"""Unit: an executor's throughput measurement through the spool: SpoolWriter.throughput writes a
plain JSON record, and the daemon's Forwarder turns it into exactly one POST
/internal/v1/tasks/{task}/throughput carrying its placement, in spool order, dropped when refused
for good or malformed, retried when the service is sick."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

from contract.protocol import ThroughputReport
from tests.unit.test_daemon_forwarding import FakeService, make_client
from worker.forwarder import Forwarder
from worker.service_client import Backoff
from worker.spool import SpoolWriter, read_complete_lines

MEASURED = {"gpus": 2, "seq_len": 1024, "batch_sizes": [4, 4, 8], "tokens_per_s": 5321.5,
            "samples_per_s": 7.25, "memory_k0": 17.5e9, "memory_k1": 2048.0}


def records(path: Path) -> list[dict]:
    return [json.loads(text) for _, _, text in read_complete_lines(path, 0)]


def throughput_calls(fake: FakeService) -> list[tuple[str, str, object]]:
    return [c for c in fake.calls if c[1].endswith("/throughput")]


def test_spool_record_is_plain_json(tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    # An executor may hand over numpy/torch-like scalars: they must not become strings.
    spool.throughput(gpus=Fraction(2), seq_len=Fraction(1024), batch_sizes=(Fraction(4), 8),
                     tokens_per_s=Fraction(10643, 2))
    [record] = records(tmp_path / "spool.jsonl")
    assert record == {"type": "throughput", "report": {
        "gpus": 2, "seq_len": 1024, "batch_sizes": [4, 8], "tokens_per_s": 5321.5,
        "samples_per_s": None, "memory_k0": None, "memory_k1": None}}
    assert ThroughputReport(placement_id="plc_1", **record["report"]).tokens_per_s == 5321.5


def test_forwarder_posts_one_report_in_spool_order(tmp_path: Path) -> None:
    fake = FakeService()
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    spool.event("log", "started")
    spool.metric("job_a", 1, "train", 2.0)
    spool.throughput(**MEASURED)
    spool.metric("job_a", 2, "train", 1.9)
    spool.finished(best_job_id="job_a")
    fwd = Forwarder(make_client(fake), tmp_path, "task_1", "plc_1")
    assert fwd.pump() == 5
    assert fake.paths() == ["events", "metrics", "throughput", "metrics", "finished"]
    [(method, path, body)] = throughput_calls(fake)
    assert (method, path) == ("POST", "/internal/v1/tasks/task_1/throughput")
    assert body == {"placement_id": "plc_1", **MEASURED}
    ThroughputReport.model_validate(body)  # the contract's shape, as the service parses it
    assert fwd.done and fwd.state.dropped == 0
    # A restarted daemon does not send it again.
    Forwarder(make_client(fake), tmp_path, "task_1", "plc_1").pump()
    assert len(throughput_calls(fake)) == 1


def test_optional_numbers_are_left_out(tmp_path: Path) -> None:
    fake = FakeService()
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    spool.throughput(gpus=1, seq_len=512, batch_sizes=[2], tokens_per_s=100.0)
    Forwarder(make_client(fake), tmp_path, "task_1", "plc_9").pump()
    [(_, _, body)] = throughput_calls(fake)
    assert body == {"placement_id": "plc_9", "gpus": 1, "seq_len": 512, "batch_sizes": [2],
                    "tokens_per_s": 100.0}


def test_refused_report_is_dropped_and_the_rest_goes_on(tmp_path: Path) -> None:
    fake = FakeService()
    fake.fail["/throughput"] = [409]  # a superseded attempt: retrying can never succeed
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    spool.throughput(**MEASURED)
    spool.job_state("job_a", state="completed")
    fwd = Forwarder(make_client(fake), tmp_path, "task_1", "plc_1")
    fwd.pump()
    assert fake.paths() == ["state"] and fwd.state.dropped == 1 and fwd.failures == 0
    assert fwd.state.offset == (tmp_path / "spool.jsonl").stat().st_size


def test_sick_service_is_retried_later_and_delivered_once(tmp_path: Path) -> None:
    fake = FakeService()
    fake.fail["/throughput"] = [503]
    now = [0.0]
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    spool.throughput(**MEASURED)
    spool.finished()
    fwd = Forwarder(make_client(fake), tmp_path, "task_1", "plc_1",
                    backoff=Backoff(base_s=1.0, jitter=False), clock=lambda: now[0])
    assert fwd.pump() == 0 and fwd.failures == 1 and fake.paths() == []
    now[0] = 1.0
    assert fwd.pump() == 2 and fwd.done
    assert fake.paths() == ["throughput", "finished"]


def test_malformed_measurement_is_dropped_without_a_request(tmp_path: Path) -> None:
    fake = FakeService()
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    spool.throughput(**MEASURED | {"tokens_per_s": float("nan")})
    spool.throughput(**MEASURED | {"batch_sizes": []})
    spool.write({"type": "throughput", "report": {"gpus": 1}})
    spool.write({"type": "throughput", "report": "fast"})
    spool.write({"type": "throughput"})
    spool.event("log", "after")
    fwd = Forwarder(make_client(fake), tmp_path, "task_1", "plc_1")
    fwd.pump()
    assert fake.paths() == ["events"] and fwd.state.dropped == 5 and fwd.failures == 0
