"""Unit: the shared executor process (worker/host.py) on a tiny Llama (CPU), driven through its
control channel (inbox requests, status.json) as the daemon drives it: placements of two tasks
join one executor mid-run and each reports through its own spool; a cancel or pause detaches one
task alone; a placement of another model is refused untouched; a crash of the executor fails
every hosted placement retryably. The host runs in-process here (threads); the daemon tests below
run it as the daemon does (a subprocess) and prove one process for two placements."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from contract.protocol import (
    EarlyExitSettings,
    EvalSettings,
    JobHyperparameters,
    JobSpec,
    PlacementSpec,
    TaskSettings,
)
from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir, write_jsonl
from worker import host as shared
from worker.spool import read_complete_lines

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir("llama", tmp_path_factory.mktemp("host_model"))


def make_placement(root: Path, model: Path, placement_id: str, *, epochs: int = 2,
                   seed: int = 5, max_seq_len: int = 48, gpus: tuple[int, ...] = (0,)) -> Path:
    """A placement folder as the daemon leaves it after the claim: spec.json and data/."""
    directory = root / "placements" / placement_id
    (directory / "data").mkdir(parents=True)
    write_jsonl(directory / "data" / "train.jsonl", synthetic_rows(20, seed=seed))
    jobs = [JobSpec(job_id=f"{placement_id}_j{i}", index=i, state="pending",
                    hyperparameters=JobHyperparameters(learning_rate=lr, lora_rank=r,
                                                       lora_alpha=2 * r, batch_size=b))
            for i, (lr, r, b) in enumerate([(3e-3, 4, 1), (1e-3, 2, 2)])]
    spec = PlacementSpec(
        task_id=f"task_{placement_id}", placement_id=placement_id, attempt=1, node_id="n",
        gpu_indices=list(gpus), method="sft", base_model="tiny", base_model_path=str(model),
        training_file_id="f", training_file_url="/f", training_file_format="chat",
        settings=TaskSettings(validation_split=0.2, max_seq_len=max_seq_len, epochs=epochs, seed=seed,
        eval=EvalSettings(eval_every_steps=5, eval_max_samples=4),
        early_exit=EarlyExitSettings(enabled=False)), jobs=jobs)
    (directory / "spec.json").write_text(spec.model_dump_json())
    return directory


def records(directory: Path) -> list[dict]:
    return [json.loads(t) for _, _, t in read_complete_lines(directory / "spool.jsonl", 0)]


def wait(predicate: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class Running:
    """A Host serving in a thread of this process (its executor on this CPU)."""

    def __init__(self, directory: Path, linger_s: float = 0.5, lease_timeout_s: float = 0,
                 **kw: Any) -> None:
        self.directory = directory
        self.host = shared.Host(directory, lease_timeout_s=lease_timeout_s, linger_s=linger_s,
                                poll_s=0.02, **kw)
        self.code: int | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        self.code = self.host.serve()

    def start(self) -> Running:
        self.thread.start()
        return self

    def status(self) -> dict:
        return shared.read_status(self.directory)

    def join(self, timeout: float = 120) -> int:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the host did not exit"
        assert self.code is not None
        return self.code


def attach(host_dir: Path, placement: Path) -> None:
    shared.send(host_dir, {"op": "attach", "placement_id": placement.name,
                           "placement_dir": str(placement)})


def trained(placement: Path, n: int = 1) -> bool:
    return sum(r["type"] == "metric" for r in records(placement)) >= n


def test_two_tasks_share_one_executor_each_reporting_through_its_own_spool(
        tmp_path: Path, model: Path) -> None:
    a = make_placement(tmp_path, model, "pl_a", epochs=3)
    b = make_placement(tmp_path, model, "pl_b", seed=9)
    host_dir = tmp_path / "hosts" / "h1"
    attach(host_dir, a)
    running = Running(host_dir).start()
    wait(lambda: trained(a, 3), "A to train")
    attach(host_dir, b)  # B joins the executor while A trains
    joined = wait(lambda: "pl_b" in running.status().get("accepted", []) and running.status(),
                  "B to join")
    assert "pl_a" not in joined["ended"]  # A was still training then
    assert joined["state"] == "serving" and joined["key"] == "tiny|sft|48|*"
    assert joined["total_rows"] > 0 and joined["free_rows"] <= joined["total_rows"]
    assert running.join() == 0  # both ended, then it lingered idle and left
    final = running.status()
    assert final["state"] == "closed" and final["hosted"] == []
    assert final["ended"] == {"pl_a": "succeeded", "pl_b": "succeeded"}
    for placement in (a, b):
        recs = records(placement)
        assert recs[-1]["type"] == "finished"
        jobs = {r["point"]["job_id"] for r in recs if r["type"] == "metric"}
        assert jobs == {f"{placement.name}_j0", f"{placement.name}_j1"}  # its own jobs only
        adapters = [r for r in recs if r["type"] == "artifact" and r["meta"]["kind"] == "adapter"]
        assert {r["meta"]["job_id"] for r in adapters} == jobs
        assert all((placement / r["dir"] / "adapter_model.safetensors").is_file()
                   for r in adapters)
        assert recs[-1]["report"]["best_job_id"] in jobs
        # the last checkpoint, in its own folder, announced before the terminal record
        ckpts = [r for r in recs if r["type"] == "artifact" and r["meta"]["kind"] == "checkpoint"]
        assert ckpts and (placement / ckpts[-1]["dir"] / "state.pt").is_file()
    assert not any(r["type"] == "event" and r["event"]["type"] == "resumed" for r in records(b))


def test_cancel_and_pause_detach_one_task_alone(tmp_path: Path, model: Path) -> None:
    a = make_placement(tmp_path, model, "pl_a", epochs=3)
    b = make_placement(tmp_path, model, "pl_b", seed=9, epochs=3)
    c = make_placement(tmp_path, model, "pl_c", seed=11, epochs=3)
    host_dir = tmp_path / "hosts" / "h1"
    for p in (a, b, c):
        attach(host_dir, p)
    running = Running(host_dir).start()
    wait(lambda: trained(b, 2) and trained(c, 2), "B and C to train")
    shared.send(host_dir, {"op": "detach", "placement_id": "pl_b", "outcome": "cancelled"})
    shared.send(host_dir, {"op": "detach", "placement_id": "pl_c", "outcome": "paused"})
    wait(lambda: len(running.status().get("ended", {})) >= 2, "B and C to leave")
    status = running.status()
    assert status["ended"] == {"pl_b": "cancelled", "pl_c": "paused"}
    assert status["hosted"] == ["pl_a"]  # A trains on
    assert running.join() == 0
    assert running.status()["ended"]["pl_a"] == "succeeded"
    assert records(a)[-1]["type"] == "finished"
    # cancelled: its jobs end cancelled, no terminal record (the service stopped it)
    rb = records(b)
    assert not any(r["type"] in ("finished", "failed") for r in rb)
    assert {r["update"]["state"] for r in rb if r["type"] == "job_state"} >= {"cancelled"}
    # paused: a checkpoint, then the retryable stop the service takes as a pause
    rc = records(c)
    assert rc[-1] == {"type": "failed", "report": {
        "error": "executor stopped: paused by the service", "retryable": True, "detail": None}}
    assert rc[-2]["type"] == "event" and rc[-2]["event"]["type"] == "executor_stopped"
    ckpt = [r for r in rc if r["type"] == "artifact" and r["meta"]["kind"] == "checkpoint"][-1]
    assert (c / ckpt["dir"] / "state.pt").is_file()


def test_a_stale_daemon_lease_stops_every_hosted_task_at_a_checkpoint(
        tmp_path: Path, model: Path) -> None:
    """The orphan stop: no daemon touches the host's lease any more (it is gone for good):
    every hosted task checkpoints and stops retryably, and the executor leaves."""
    import os

    a = make_placement(tmp_path, model, "pl_a", epochs=20)
    b = make_placement(tmp_path, model, "pl_b", seed=9, epochs=20)
    host_dir = tmp_path / "hosts" / "h1"
    for p in (a, b):
        attach(host_dir, p)
    lease = host_dir / "lease"
    lease.touch()
    running = Running(host_dir, linger_s=60, lease_timeout_s=30).start()
    wait(lambda: trained(a, 2) and trained(b, 2), "both to train")
    old = time.time() - 60
    os.utime(lease, (old, old))
    assert running.join() == 0  # no linger: a stopped executor takes no new task
    status = running.status()
    assert status["ended"] == {"pl_a": "paused", "pl_b": "paused"}
    for placement in (a, b):
        recs = records(placement)
        assert recs[-1]["type"] == "failed" and recs[-1]["report"]["retryable"] is True
        assert recs[-1]["report"]["error"].startswith("executor stopped: daemon lease stale")
        assert any(r["type"] == "artifact" and r["meta"]["kind"] == "checkpoint" for r in recs)


def test_another_model_is_refused_and_a_crash_fails_every_hosted_task(
        tmp_path: Path, model: Path) -> None:
    from trainer.executor import Executor

    class Crashing(Executor):
        """The executor itself fails (a lost device) once both tasks have trained."""

        def _admit(self) -> None:
            if len(self.tasks) == 2 and self.global_step >= 4:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            super()._admit()

    a = make_placement(tmp_path, model, "pl_a", epochs=3)
    b = make_placement(tmp_path, model, "pl_b", seed=9, epochs=3)
    other = make_placement(tmp_path, model, "pl_other", max_seq_len=64)
    host_dir = tmp_path / "hosts" / "h1"
    for p in (a, other, b):
        attach(host_dir, p)
    running = Running(host_dir, make_executor=Crashing).start()
    assert running.join() == 1
    status = running.status()
    assert status["refused"] == {"pl_other": "another model or GPU set: tiny|sft|64|* [0]"}
    assert not (other / "spool.jsonl").exists() or not records(other)  # untouched: it may go on
    assert status["ended"] == {"pl_a": "failed", "pl_b": "failed"} and status["state"] == "closed"
    for placement in (a, b):
        last = records(placement)[-1]
        assert last["type"] == "failed" and last["report"]["retryable"] is True
        assert "illegal memory access" in last["report"]["error"]


# -- the daemon's side: one shared executor process for the placements of one model ----------
class Service:
    """The internal API as a MockTransport: every report stored (artifacts are multipart)."""

    def __init__(self) -> None:
        self.stop: list[str] = []
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, request: Any) -> Any:
        import httpx

        try:
            body = json.loads(request.content) if request.content else {}
        except ValueError:
            body = {"multipart": len(request.content)}
        self.calls.append((request.url.path, body))
        if request.url.path.endswith("/heartbeat"):
            return httpx.Response(200, json={"node_id": "node_1", "state": "up",
                                             "cancelled_placement_ids": self.stop})
        if request.url.path.endswith("/sample_requests/claim"):
            return httpx.Response(204)  # no sample request waiting, as the service answers
        return httpx.Response(200, json={"stored": 1})


@pytest.fixture
def one_thread_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor subprocesses on one torch thread too (the CI machine has 2 shared cores)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def node_daemon(work: Path, service: Service, **cfg_kw: Any) -> Any:
    import httpx

    from tests.unit.test_daemon_local_resume import NoRedis
    from worker.config import DaemonConfig
    from worker.daemon import Daemon
    from worker.service_client import Backoff, ServiceClient

    cfg = DaemonConfig(service_url="http://svc", worker_token="t", redis_url="redis://x",
                       node_name="n1", work_dir=work, poll_interval_s=0.01, cancel_grace_s=30,
                       **cfg_kw)
    client = ServiceClient("http://svc", "t", transport=httpx.MockTransport(service),
                           backoff=Backoff(base_s=0.01, jitter=False), sleep=lambda s: None)
    d = Daemon(cfg, client=client, conn=NoRedis())  # type: ignore[arg-type]
    d.registration.node_id = "node_1"
    d.lifecycle.pop = lambda: None  # placements are put in place here, not popped
    d.registration.confirmed.set()
    return d


def ready(d: Any, directory: Path) -> None:
    """A claimed placement the daemon will start (its spec and data are in its folder)."""
    from worker.local_state import LocalPlacement

    spec = PlacementSpec.model_validate_json((directory / "spec.json").read_text())
    p = LocalPlacement(placement_id=directory.name, directory=directory, status="ready",
                       task_id=spec.task_id, gpu_indices=list(spec.gpu_indices))
    p.save()
    d.placements[p.placement_id] = p


def ticking(d: Any, predicate: Callable[[], Any], what: str, timeout: float = 90) -> Any:
    def step() -> Any:
        d.tick()
        return predicate()
    return wait(step, what, timeout)


def reported(service: Any, path_end: str) -> list[dict]:
    return [body for path, body in service.calls if path.endswith(path_end)]


@pytest.mark.usefixtures("one_thread_host")
def test_the_daemon_attaches_placements_of_one_model_to_one_process_across_a_restart(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.processes import alive

    monkeypatch.setenv("LORAPLEX_EXECUTOR_LINGER_S", "60")
    service = Service()
    d = node_daemon(tmp_path, service)
    a = make_placement(tmp_path, model, "pl_a", epochs=4)
    b = make_placement(tmp_path, model, "pl_b", seed=9, epochs=20)
    ready(d, a)
    ticking(d, lambda: trained(a), "A to train on a new shared executor")
    ready(d, b)  # the scheduler joined B to A's executor (same model, same GPU)
    ticking(d, lambda: trained(b), "B to train")
    (h,) = d.shared.hosts.values()
    assert {d.placements[p].host_id for p in ("pl_a", "pl_b")} == {h.host_id}
    assert d.placements["pl_a"].pid == d.placements["pl_b"].pid == h.pid  # one process
    assert not (a / "executor.log").exists() and not (b / "executor.log").exists()
    d.registration.heartbeat_once()
    (beat,) = [e for e in reported(service, "/heartbeat")[-1]["executors"]]
    assert beat["key"] == "tiny|sft|48|*" and beat["gpu_indices"] == [0]
    assert sorted(beat["placement_ids"]) == ["pl_a", "pl_b"] and beat["total_rows"] > 0

    # the daemon restarts (killed at any line): the new one adopts the executor and both tasks
    d = node_daemon(tmp_path, service)
    d.recover()
    assert list(d.shared.hosts) == [h.host_id] and d.shared.hosts[h.host_id].exit_code() is None
    d.registration.stop_ids = {"pl_b"}  # the service cancelled B: it leaves alone, A trains on
    ticking(d, lambda: "pl_b" not in d.placements, "B to be retired")
    assert d.placements["pl_a"].status == "running"
    # B checkpointed where it stopped (a later attempt here may resume from it), as a runner
    # does on SIGTERM; its stop record stays on the node: the service takes nothing more
    rb = records(b)
    assert rb[-1]["type"] == "failed" and rb[-1]["report"]["error"] == "executor stopped: stopped by the service"
    assert any(r["type"] == "artifact" and r["meta"]["kind"] == "checkpoint" for r in rb)
    assert not reported(service, "/tasks/task_pl_b/failed")
    ticking(d, lambda: "pl_a" not in d.placements, "A to finish")
    assert records(a)[-1]["type"] == "finished" and reported(service, "/tasks/task_pl_a/finished")
    assert not reported(service, "/tasks/task_pl_b/finished")
    d.tick()
    (idle,) = d.registration.executors  # warm and idle: another task of the model may join it
    assert idle.placement_ids == [] and idle.free_rows == idle.total_rows > 0
    assert alive(h.pid, h.directory)

    # a task of another model (another max_seq_len) on the same GPU: the idle one gives way
    other = make_placement(tmp_path, model, "pl_other", max_seq_len=64, epochs=1)
    ready(d, other)
    ticking(d, lambda: trained(other), "the other model's task to train")
    assert not alive(h.pid, h.directory) and h.host_id not in d.shared.hosts
    (h2,) = d.shared.hosts.values()
    assert h2.key == "tiny|sft|64|*"
    ticking(d, lambda: "pl_other" not in d.placements, "the other task to finish")
    assert records(other)[-1]["type"] == "finished"
    d.shared.stop(h2, "test over")
    ticking(d, lambda: not d.shared.hosts, "the executor to leave")


@pytest.mark.usefixtures("one_thread_host")
def test_a_spare_executor_warms_up_ahead_and_the_next_task_trains_on_it(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41: with spares on, an idle node keeps a warmed-up `worker.host --spare` on its free
    slot; the next task, of a model the node never ran, trains in that process (no new one); once
    the task is done and its executor has lingered out, a new spare takes the slot; a draining
    daemon stops it."""
    from worker.registration import detect_node

    monkeypatch.setenv("LORAPLEX_EXECUTOR_LINGER_S", "1")
    service = Service()
    d = node_daemon(tmp_path, service, spare_hosts="on")
    d.registration.node = detect_node(d.cfg)
    (spare,) = ticking(d, lambda: list(d.shared.hosts.values()), "a spare on the idle slot")
    status = wait(lambda: (s := spare.status()).get("warm_s") is not None and s, "the spare to warm up")
    assert status["state"] == "spare" and status["key"] is None and status["hosted"] == []
    d.registration.heartbeat_once()
    assert reported(service, "/heartbeat")[-1]["executors"] == []  # nothing to join yet

    a = make_placement(tmp_path, model, "pl_a", epochs=2)
    ready(d, a)
    ticking(d, lambda: trained(a), "A to train on the spare")
    assert d.placements["pl_a"].host_id == spare.host_id and d.placements["pl_a"].pid == spare.pid
    assert spare.key == "tiny|sft|48|*" and len(d.shared.hosts) == 1
    assert "spare executor warm" in (spare.directory / "host.log").read_text()
    ticking(d, lambda: "pl_a" not in d.placements, "A to finish")
    assert records(a)[-1]["type"] == "finished" and reported(service, "/tasks/task_pl_a/finished")
    # the model's executor lingers 1 s, exits; a fresh spare takes the slot
    (again,) = ticking(d, lambda: [h for h in d.shared.hosts.values() if h.host_id != spare.host_id],
                       "a new spare")
    assert again.key == "" and again.pid != spare.pid
    d.shared.tend("draining")
    wait(lambda: again.exit_code() is not None, "the spare to stop on a drain")


@pytest.mark.usefixtures("one_thread_host")
def test_with_a_zygote_the_executor_is_forked_trains_and_a_restarted_daemon_adopts_it(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41: a node's zygote (worker.zygote) has done the executor's imports; the task's shared
    executor is forked there (its command line is the zygote's), trains, and a daemon restarted
    while it runs adopts it, and reads its exit status once it stops (the old zygote noted it)."""
    from worker.processes import ForkedProcess

    monkeypatch.setenv("LORAPLEX_EXECUTOR_LINGER_S", "60")
    service = Service()
    d = node_daemon(tmp_path, service, zygote="on")
    ticking(d, lambda: d.zygote.current() is not None, "the zygote's imports", timeout=240)
    a = make_placement(tmp_path, model, "pl_a", epochs=2)
    ready(d, a)
    ticking(d, lambda: trained(a), "A to train in a forked executor")
    (h,) = d.shared.hosts.values()
    assert isinstance(h.proc, ForkedProcess) and d.placements["pl_a"].pid == h.pid
    assert b"worker.zygote" in Path(f"/proc/{h.pid}/cmdline").read_bytes()
    assert "left the executor" not in (h.directory / "host.log").read_text()

    d.zygote.close()  # the daemon dies; its zygote waits for its children, noting their ends
    d = node_daemon(tmp_path, service)
    d.recover()
    assert list(d.shared.hosts) == [h.host_id] and d.shared.hosts[h.host_id].exit_code() is None
    ticking(d, lambda: "pl_a" not in d.placements, "A to finish")
    assert records(a)[-1]["type"] == "finished" and reported(service, "/tasks/task_pl_a/finished")
    adopted = d.shared.hosts[h.host_id]
    d.shared.stop(adopted, "test over")
    wait(lambda: adopted.exit_code() is not None, "the adopted executor to stop")
    assert adopted.exit_code() == 0  # its status as the zygote noted it, not "lost"


@pytest.mark.usefixtures("one_thread_host")
def test_a_crash_of_the_shared_executor_fails_every_hosted_placement_retryably(
        tmp_path: Path, model: Path) -> None:
    import os
    import signal

    d = node_daemon(tmp_path, Service())
    a = make_placement(tmp_path, model, "pl_a", epochs=20)
    b = make_placement(tmp_path, model, "pl_b", seed=9, epochs=20)
    ready(d, a)
    ready(d, b)
    ticking(d, lambda: trained(a) and trained(b), "both to train")
    (h,) = d.shared.hosts.values()
    os.killpg(h.pid, signal.SIGKILL)
    ticking(d, lambda: not d.placements and not d.shared.hosts, "both to be reported")
    for placement in (a, b):
        last = records(placement)[-1]
        assert last["type"] == "failed" and last["report"]["retryable"] is True
        assert "signal SIGKILL" in last["report"]["error"]


def test_which_placements_share_an_executor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    from worker.config import parse_args

    d = node_daemon(tmp_path, Service())
    one = PlacementSpec.model_validate_json(
        make_placement(tmp_path, tmp_path / "m", "pl_1").joinpath("spec.json").read_text())
    two = one.model_copy(update={"gpu_indices": [0, 1]})
    assert d.shared.colocation_key(one) == "tiny|sft|48|*"
    assert d.shared.colocation_key(two) is None  # adapter parallelism: one task per executor
    d.cfg.runner_module = "tests.e2e.fake_runner"
    assert d.shared.colocation_key(one) is None  # another runner replaces the executor side
    assert parse_args(["--work-dir", str(tmp_path)]).colocate
    assert not parse_args(["--work-dir", str(tmp_path), "--no-colocate"]).colocate
    monkeypatch.setenv("LORAPLEX_COLOCATE", "0")
    assert not parse_args(["--work-dir", str(tmp_path)]).colocate
