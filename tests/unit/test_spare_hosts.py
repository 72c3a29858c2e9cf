"""Unit: spare shared executors (issue 41). A GPU node keeps a warmed-up `worker.host --spare` on
each GPU that nothing holds; a one-GPU placement of any model adopts the spare on its GPU (no new
process); a placement that cannot share (several GPUs) has it stopped first; the heartbeat never
offers a spare to the scheduler; a sample request may use its slot; a spare that keeps dying is
restarted with a growing wait, never every tick; a CPU node has none unless asked."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from worker import shared_hosts
from worker.config import DaemonConfig
from worker.local_state import LocalPlacement, LocalStatus
from worker.shared_hosts import SPARE_KEY, SharedHosts


class FakeProc:
    def __init__(self, pid: int, cmd: list[str]) -> None:
        self.pid, self.cmd, self.code = pid, cmd, None

    def poll(self) -> int | None:
        return self.code


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> list[FakeProc]:
    procs: list[FakeProc] = []

    def spawn(module, flag, directory, gpus, log_name, extra=(), *, cuda, cache_dir=None, zygote=None):  # noqa: ANN001, ANN202
        procs.append(FakeProc(1000 + len(procs), [module, flag, str(directory), *extra, f"gpus={gpus}"]))
        return procs[-1]

    monkeypatch.setattr(shared_hosts, "spawn", spawn)
    monkeypatch.setattr(shared_hosts, "kill_group", lambda pid, sig: None)
    return procs


def hosts(tmp_path: Path, gpus: int = 2, cuda: bool = True, mode: str = "auto",
          placements: dict | None = None) -> SharedHosts:
    cfg = DaemonConfig(service_url="http://svc", worker_token="t", redis_url="", node_name="n",
                       work_dir=tmp_path, spare_hosts=mode)
    registration = SimpleNamespace(node=SimpleNamespace(gpu_count=gpus), cuda=cuda, node_id="node_1")
    return SharedHosts(cfg, registration, placements if placements is not None else {})  # type: ignore[arg-type]


def placement(tmp_path: Path, pid: str, gpus: list[int]) -> LocalPlacement:
    d = tmp_path / "placements" / pid
    d.mkdir(parents=True)
    return LocalPlacement(placement_id=pid, directory=d, status=LocalStatus.READY, task_id=f"task_{pid}",
                          gpu_indices=gpus)


def test_a_gpu_node_keeps_one_spare_per_free_gpu_and_never_offers_it(tmp_path: Path, spawned) -> None:  # noqa: ANN001
    busy = placement(tmp_path, "pl_busy", [1])
    busy.status = LocalStatus.RUNNING
    done = placement(tmp_path, "pl_done", [0])
    done.status = LocalStatus.DONE  # holds nothing any more
    sh = hosts(tmp_path, gpus=3, placements={"pl_busy": busy, "pl_done": done})
    sh.keep_spares(also=[2])  # GPU 1 is a placement's, GPU 2 a sampler process's
    assert [p.cmd[3:] for p in spawned] == [["--spare", "gpus=[0]"]]
    (h,) = sh.hosts.values()
    assert h.key == SPARE_KEY and h.gpu_indices == [0] and h.pid == spawned[0].pid
    assert json.loads((h.directory / "daemon.json").read_text())["key"] == SPARE_KEY  # a restart knows
    sh.keep_spares(also=[2])
    assert len(spawned) == 1  # GPU 0 is held by the spare now
    assert sh.reports() == ()  # the scheduler joins nothing to a spare


def test_a_cpu_node_has_none_unless_asked(tmp_path: Path, spawned) -> None:  # noqa: ANN001
    hosts(tmp_path, cuda=False).keep_spares()
    hosts(tmp_path, mode="off").keep_spares()
    assert spawned == []
    hosts(tmp_path, cuda=False, mode="on").keep_spares()
    assert len(spawned) == 2


def test_a_one_gpu_placement_adopts_the_spare_on_its_gpu(tmp_path: Path, spawned) -> None:  # noqa: ANN001
    placements: dict[str, LocalPlacement] = {}
    sh = hosts(tmp_path, placements=placements)
    sh.keep_spares()  # the node idle: spares on both GPUs
    placements["pl_a"] = p = placement(tmp_path, "pl_a", [0])  # then a placement comes
    spare = sh.spare_for(p)
    assert spare is not None and spare.gpu_indices == [0]
    assert sh.spare_for(placement(tmp_path, "pl_b", [0, 1])) is None
    sh.adopt(spare, p, "tiny|sft|48|*")
    assert spare.key == "tiny|sft|48|*" and p.host_id == spare.host_id and p.pid == spare.pid
    assert p.status == LocalStatus.RUNNING and len(spawned) == 2  # no new process for it
    (request,) = [json.loads(f.read_text()) for f in (spare.directory / "inbox").iterdir()]
    assert request == {"op": "attach", "placement_id": "pl_a", "placement_dir": str(p.directory)}
    assert sh.spare_for(placement(tmp_path, "pl_c", [0])) is None  # a model's host now, not a spare
    assert [r.key for r in sh.reports()] == ["tiny|sft|48|*"]


def test_a_placement_that_cannot_share_has_the_spares_stopped_first(tmp_path: Path, spawned) -> None:  # noqa: ANN001
    sh = hosts(tmp_path)
    sh.keep_spares()
    p = placement(tmp_path, "pl_big", [0, 1])
    assert not sh.make_room(p)  # both spares asked to stop; it starts once they have exited
    assert all(h.closing for h in sh.hosts.values())
    for proc in spawned:
        proc.code = 0
    sh.tend(None)
    assert sh.hosts == {} and sh.make_room(p)
    assert sh.spare_failures == 0  # asked to stop: no failure


def test_a_spare_that_keeps_dying_is_restarted_with_a_growing_wait(tmp_path: Path, spawned,  # noqa: ANN001
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(shared_hosts.time, "monotonic", lambda: now[0])
    sh = hosts(tmp_path, gpus=1)
    waits = []
    for _ in range(3):
        sh.keep_spares()
        spawned[-1].code = 1  # died at its start
        sh.tend(None)
        assert sh.hosts == {}
        count = len(spawned)
        sh.keep_spares()
        assert len(spawned) == count  # not at once
        waits.append(sh.spare_after - now[0])
        now[0] = sh.spare_after
    assert waits == [10.0, 20.0, 40.0]
    sh.keep_spares()
    sh.adopt(next(iter(sh.hosts.values())), placement(tmp_path, "pl_a", [0]), "k")
    assert sh.spare_failures == 0  # one that served resets the count


def test_a_sample_request_may_use_a_spares_slot(tmp_path: Path, spawned) -> None:  # noqa: ANN001
    from worker.sample_requests import SampleRequests

    sh = hosts(tmp_path, gpus=1)
    sh.keep_spares()
    part = SampleRequests(sh.cfg, None, sh.registration, {}, sh)  # type: ignore[arg-type]
    assert part._free_slot() == [0]
    assert part._idle_hosts() == []  # no model to answer on
