"""Unit: a new attempt of a task resumes from the newest checkpoint an earlier attempt left on
this node when the service offers an older one, replaying the earlier attempt's reports up to it;
and the daemon stops placements (never tasks) the service names, without a report, also after a
restart (it asks the service before it reports an adopted executor's death)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from contract.protocol import (
    EarlyExitSettings,
    EvalSettings,
    JobHyperparameters,
    JobSpec,
    PlacementSpec,
    TaskSettings,
)
from worker.config import DaemonConfig
from worker.daemon import Daemon
from worker.local_resume import (
    LOCAL_RESUME_NAME,
    OFFERED_NAME,
    checkpoint_step,
    newest_local_checkpoint,
    seed_local_resume,
)
from worker.local_state import LocalPlacement
from worker.service_client import Backoff, ServiceClient
from worker.spool import SpoolWriter, read_complete_lines

torch = pytest.importorskip("torch")
TASK = "task_1"


def spec(**kw: object) -> PlacementSpec:
    base = dict(task_id=TASK, placement_id="pl_new", attempt=2, node_id="n", gpu_indices=[0],
                method="sft", base_model="tiny", base_model_path="/m", training_file_id="f1",
                training_file_url="/internal/v1/files/f1/content", training_file_format="chat",
                settings=TaskSettings(validation_split=0.1, max_seq_len=64, epochs=1, seed=0,
                                      eval=EvalSettings(), early_exit=EarlyExitSettings()),
                jobs=[JobSpec(job_id=j, index=i, state="pending", hyperparameters=
                              JobHyperparameters(learning_rate=1e-3, lora_rank=4,
                                                 lora_alpha=8, batch_size=2))
                      for i, j in enumerate(("j0", "j1"))])
    return PlacementSpec.model_validate(base | kw)


def state_pt(path: Path, global_step: int, files: bool = False) -> Path:
    """An executor state.pt as far as the daemon reads it (tensors included, as for real);
    files: the current format, the job's state in its own file beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not files:
        torch.save({"global_step": global_step, "active": [{"adapter": torch.zeros(64)}]}, path)
        return path
    from trainer.checkpoint_files import write_checkpoint

    name = f"job-j0-{global_step}-ab.pt"
    ref = {"file": name, "spec": {"job_id": "j0"}, "step": global_step, "total_steps": 99}
    return write_checkpoint(path.parent, {"format": 2, "global_step": global_step, "active": [ref],
                                          "queue": []}, {name: {"adapter": torch.zeros(64)}})


def records(directory: Path) -> list[dict]:
    return [json.loads(t) for _, _, t in read_complete_lines(directory / "spool.jsonl", 0)]


def earlier_attempt(placements: Path, pid: str, attempt: int, steps: int, every: int,
                    task_id: str = TASK, finish_j1_at: int | None = None, files: bool = False) -> Path:
    """A placement folder as a stopped executor of an earlier attempt leaves it: per step a loss
    point of each live job, a checkpoint (copy + spool record) every `every` steps, j1 ending
    (adapter + job state) at step finish_j1_at, then the stop's events and failure."""
    d = placements / pid
    d.mkdir(parents=True)
    (d / "spec.json").write_text(json.dumps({"task_id": task_id, "placement_id": pid,
                                             "attempt": attempt}))
    w = SpoolWriter(d / "spool.jsonl")
    w.event("resumed", "attempt starts")
    for job in ("j0", "j1"):
        w.job_state(job, state="running")
    for step in range(1, steps + 1):
        for job in ("j0", "j1"):
            if job == "j1" and finish_j1_at is not None and step > finish_j1_at:
                continue
            w.metric(job, step, "train", 1.0 / step)
        if step == finish_j1_at:
            adapter = d / "artifacts" / f"adapter-j1-{step}"
            adapter.mkdir(parents=True)
            (adapter / "adapter_config.json").write_text("{}")
            (adapter / "adapter_model.safetensors").write_bytes(b"weights")
            w.artifact(f"artifacts/adapter-j1-{step}", kind="adapter", job_id="j1")
            w.job_state("j1", state="completed", best_val_loss=0.5, best_step=step)
        if step % every == 0:
            state_pt(d / "artifacts" / f"checkpoint-{step}" / "state.pt", step, files)
            w.artifact(f"artifacts/checkpoint-{step}", kind="checkpoint", step=step)
        w.throughput(gpus=1, seq_len=64, batch_sizes=[2, 2], tokens_per_s=100.0)
    w.event("executor_stopped", "stopped: SIGTERM")
    w.failed("executor stopped: SIGTERM", retryable=True)
    w.close()
    return d


def new_attempt(placements: Path, offered_step: int | None) -> Path:
    d = placements / "pl_new"
    d.mkdir(parents=True)
    (d / "spec.json").write_text(spec().model_dump_json())
    if offered_step is not None:
        state_pt(d / "resume" / "state.pt", offered_step)
    return d


def test_checkpoint_step_reads_global_step(tmp_path: Path) -> None:
    assert checkpoint_step(state_pt(tmp_path / "s.pt", 42)) == 42
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    assert checkpoint_step(tmp_path / "bad.pt") is None
    assert checkpoint_step(tmp_path / "missing.pt") is None


def test_job_files_are_linked_and_an_incomplete_checkpoint_falls_back(tmp_path: Path) -> None:
    """Checkpoints with job files: the newest whose job file is gone is unusable, the one
    before it seeds the executor's folder: state.pt and its job file, hard links."""
    placements = tmp_path / "placements"
    old = earlier_attempt(placements, "pl_old", 1, steps=13, every=4, files=True)
    (old / "artifacts" / "checkpoint-12" / "job-j0-12-ab.pt").unlink()
    assert checkpoint_step(old / "artifacts" / "checkpoint-12" / "state.pt") is None
    new = new_attempt(placements, offered_step=4)
    seeded = seed_local_resume(placements, new, spec())
    assert seeded is not None and (seeded.global_step, seeded.offered_step) == (8, 4)
    assert checkpoint_step(new / "executor" / "state.pt") == 8
    for name in ("state.pt", "job-j0-8-ab.pt"):
        assert os.path.samefile(new / "executor" / name, old / "artifacts" / "checkpoint-8" / name)
    assert sorted(p.name for p in (new / "executor").iterdir()) == ["job-j0-8-ab.pt", "state.pt"]
    assert records(new)[-1]["dir"] == "artifacts/checkpoint-8"


def test_a_newer_local_checkpoint_wins_and_replays_the_reports_before_it(tmp_path: Path) -> None:
    placements = tmp_path / "placements"
    old = earlier_attempt(placements, "pl_old", 1, steps=13, every=4, finish_j1_at=6)
    new = new_attempt(placements, offered_step=4)  # the service heard up to step 4
    seeded = seed_local_resume(placements, new, spec())
    assert seeded is not None and (seeded.global_step, seeded.offered_step) == (12, 4)
    assert seeded.directory == old
    # The executor resumes from step 12: the runner finds no resume/ to copy over it.
    assert checkpoint_step(new / "executor" / "state.pt") == 12
    assert os.path.samefile(new / "executor" / "state.pt",
                            old / "artifacts" / "checkpoint-12" / "state.pt")
    assert not (new / "resume").exists() and (new / OFFERED_NAME / "state.pt").is_file()
    # Its spool starts with the earlier reports up to that checkpoint, then the checkpoint.
    got = records(new)
    assert got[0]["type"] == "event" and got[0]["event"]["type"] == "local_resume"
    assert got[0]["event"]["data"] == {"from_placement_id": "pl_old", "global_step": 12,
                                       "offered_global_step": 4}
    kinds = [r["type"] for r in got[1:]]
    assert set(kinds) == {"metric", "job_state", "artifact"}  # no events, throughput, end
    steps = {(r["point"]["job_id"], r["point"]["step"]) for r in got if r["type"] == "metric"}
    assert steps == {("j0", s) for s in range(1, 13)} | {("j1", s) for s in range(1, 7)}
    assert [r["update"]["state"] for r in got if r["type"] == "job_state"] == [
        "running", "running", "completed"]
    artifacts = [r for r in got if r["type"] == "artifact"]
    assert [a["meta"]["kind"] for a in artifacts] == ["adapter", "checkpoint"]
    assert artifacts[-1] == got[-1] and artifacts[-1]["meta"]["step"] == 12
    for a in artifacts:  # the forwarder finds each folder under this placement
        assert sorted(p.name for p in (new / a["dir"]).iterdir()) == sorted(
            p.name for p in (old / a["dir"]).iterdir())
    marker = json.loads((new / LOCAL_RESUME_NAME).read_text())
    assert marker["global_step"] == 12 and marker["replayed_records"] == len(got) - 1
    # Done once: a restarted daemon starting it again changes nothing.
    before = (new / "spool.jsonl").read_bytes()
    assert seed_local_resume(placements, new, spec()) is None
    assert (new / "spool.jsonl").read_bytes() == before


@pytest.mark.parametrize("offered", [12, 16])
def test_an_offered_checkpoint_as_new_or_newer_is_kept(tmp_path: Path, offered: int) -> None:
    placements = tmp_path / "placements"
    earlier_attempt(placements, "pl_old", 1, steps=13, every=4)
    new = new_attempt(placements, offered_step=offered)
    assert seed_local_resume(placements, new, spec()) is None
    assert checkpoint_step(new / "resume" / "state.pt") == offered
    assert not (new / "executor").exists() and not (new / "spool.jsonl").exists()


def test_without_an_offered_checkpoint_any_local_one_wins(tmp_path: Path) -> None:
    """The service never received a checkpoint (the node was cut off before its first upload)."""
    placements = tmp_path / "placements"
    earlier_attempt(placements, "pl_old", 1, steps=5, every=4)
    new = new_attempt(placements, offered_step=None)
    seeded = seed_local_resume(placements, new, spec())
    assert seeded is not None and (seeded.global_step, seeded.offered_step) == (4, -1)
    assert checkpoint_step(new / "executor" / "state.pt") == 4
    assert records(new)[0]["event"]["data"]["offered_global_step"] is None


def test_the_newest_of_several_attempts_and_only_this_task(tmp_path: Path) -> None:
    placements = tmp_path / "placements"
    earlier_attempt(placements, "pl_a1", 1, steps=9, every=4)  # last: 8
    earlier_attempt(placements, "pl_a2", 2, steps=14, every=4)  # last: 12
    earlier_attempt(placements, "pl_other", 1, steps=30, every=4, task_id="task_other")
    (placements / "pl_popped").mkdir()  # popped, never claimed: no spec.json
    new = new_attempt(placements, offered_step=8)
    best = newest_local_checkpoint(placements, new, TASK)
    assert best is not None and (best.directory.name, best.global_step) == ("pl_a2", 12)
    # Its last copy is gone (disk cleanup): the newest one still there wins.
    (placements / "pl_a2" / "artifacts" / "checkpoint-12" / "state.pt").unlink()
    best = newest_local_checkpoint(placements, new, TASK)
    assert best is not None and best.global_step == 8


def test_an_unreadable_offered_checkpoint_is_kept(tmp_path: Path) -> None:
    placements = tmp_path / "placements"
    earlier_attempt(placements, "pl_old", 1, steps=13, every=4)
    new = new_attempt(placements, offered_step=None)
    (new / "resume").mkdir()
    (new / "resume" / "state.pt").write_bytes(b"cannot compare")
    assert seed_local_resume(placements, new, spec()) is None
    assert (new / "resume" / "state.pt").read_bytes() == b"cannot compare"


# -- the daemon: stops by placement, and asks the service first after a restart -------------
class Service:
    """The internal API as a MockTransport; the heartbeat reply names `stop`."""

    def __init__(self) -> None:
        self.stop: list[str] = []
        self.up = True
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.calls.append((request.url.path, body))
        if not self.up:
            return httpx.Response(503, json={"error": {"code": "db", "message": "down"}})
        if request.url.path.endswith("/heartbeat"):
            return httpx.Response(200, json={"node_id": "node_1", "state": "up",
                                             "cancelled_placement_ids": self.stop})
        return httpx.Response(200, json={"stored": 1})

    def reports(self) -> list[str]:
        return [p for p, _ in self.calls if not p.endswith(("/heartbeat", "/nodes"))]


class NoRedis:
    """Redis with no cancel flag set (mget answers None for every key)."""

    def mget(self, keys: list[str]) -> list[None]:
        return [None] * len(keys)

    def exists(self, *keys: str) -> int:
        return 0


def daemon(tmp_path: Path, service: Service) -> Daemon:
    cfg = DaemonConfig(service_url="http://svc", worker_token="t", redis_url="redis://x",
                       node_name="n1", work_dir=tmp_path, poll_interval_s=0.01)
    client = ServiceClient("http://svc", "t", transport=httpx.MockTransport(service),
                           backoff=Backoff(base_s=0.01, jitter=False), sleep=lambda s: None)
    d = Daemon(cfg, client=client, conn=NoRedis())  # type: ignore[arg-type]
    d.registration.node_id = "node_1"
    d.shutdown.drain = True  # no queue to pop from here
    return d


def adopted(tmp_path: Path, pid: str, task_id: str = TASK) -> LocalPlacement:
    """A placement a killed daemon left running; its executor died with it (no pid)."""
    directory = tmp_path / "placements" / pid
    directory.mkdir(parents=True)
    (directory / "spec.json").write_text(spec(placement_id=pid).model_dump_json())
    SpoolWriter(directory / "spool.jsonl").metric("j0", 1, "train", 1.0)
    p = LocalPlacement(placement_id=pid, directory=directory, status="running",
                       task_id=task_id, gpu_indices=[0], pid=None)
    p.save()
    return p


def test_a_restarted_daemon_reports_no_failure_for_an_attempt_the_service_gave_up(
        tmp_path: Path) -> None:
    service = Service()
    stale, current = adopted(tmp_path, "pl_stale"), adopted(tmp_path, "pl_current", "task_2")
    d = daemon(tmp_path, service)
    d.recover()
    service.up = False  # the service cannot say yet: nothing is closed meanwhile
    d.registration.claimed_ids = d.lifecycle.claimed_ids()
    d.registration.heartbeat_once()
    d.tick()
    assert {p.status for p in d.placements.values()} == {"running"}
    assert all(t["type"] == "metric" for t in records(stale.directory))
    service.up, service.stop = True, ["pl_stale"]
    d.registration.heartbeat_once()
    d.tick()
    assert "pl_stale" not in d.placements  # ended without a word, its folder kept
    assert [r["type"] for r in records(stale.directory)] == ["metric"]
    assert json.loads((stale.directory / "daemon.json").read_text())["status"] == "done"
    # The current attempt's executor is gone too: that one is reported, to be retried.
    assert [r["type"] for r in records(current.directory)] == ["metric", "event", "failed"]
    assert records(current.directory)[1]["event"]["type"] == "executor_failed"
    assert not any("pl_stale" in json.dumps(b) or p.startswith(f"/internal/v1/tasks/{TASK}/")
                   for p, b in service.calls if not p.endswith("/heartbeat"))


def test_a_named_placement_stops_and_a_new_attempt_of_its_task_runs_on(tmp_path: Path) -> None:
    service = Service()
    d = daemon(tmp_path, service)
    old = tmp_path / "placements" / "pl_old"
    new = tmp_path / "placements" / "pl_new"
    for directory in (old, new):
        directory.mkdir(parents=True)
    d.placements.update({
        "pl_old": LocalPlacement("pl_old", old, status="exited", task_id=TASK),
        "pl_new": LocalPlacement("pl_new", new, status="exited", task_id=TASK)})
    SpoolWriter(old / "spool.jsonl").metric("j0", 7, "train", 1.0)  # a backlog
    service.stop = ["pl_old"]
    d.registration.confirmed.set()
    d.registration.heartbeat_once()
    d.lifecycle.apply_stops()
    assert d.placements["pl_old"].cancelled and not d.placements["pl_new"].cancelled
    d.lifecycle.advance(d.placements["pl_old"], stopping=False)
    assert "pl_old" not in d.placements and old.is_dir()  # kept: a checkpoint may be there
    assert not service.reports()  # its backlog is not sent: the service would refuse it
