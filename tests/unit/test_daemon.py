"""Unit: the daemon's configuration, node detection, persisted placement state and the checks
it uses to adopt executors after a restart (pid liveness that survives pid reuse)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.config import parse_args
from worker.daemon import run_placement
from worker.local_state import LocalPlacement
from worker.processes import alive, describe
from worker.registration import detect_node


def test_parse_args_env_and_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORAPLEX_SERVICE_URL", "http://svc:1")
    monkeypatch.setenv("LORAPLEX_WORKER_TOKEN", "wt")
    monkeypatch.setenv("LORAPLEX_NODE_NAME", "gpu-7")
    monkeypatch.setenv("LORAPLEX_CPU_SLOTS", "3")
    cfg = parse_args(["--work-dir", str(tmp_path / "w"), "--redis-url", "redis://r:2/1",
                      "--runner-arg=--threads", "--runner-arg", "2"])
    assert (cfg.service_url, cfg.worker_token, cfg.node_name) == ("http://svc:1", "wt", "gpu-7")
    assert cfg.redis_url == "redis://r:2/1" and cfg.cpu_slots == 3
    assert cfg.work_dir == (tmp_path / "w").resolve() and cfg.work_dir.is_absolute()
    assert cfg.runner_module == "worker.runner" and cfg.runner_args == ["--threads", "2"]
    with pytest.raises(SystemExit):
        parse_args(["--no-such-flag"])


def test_detect_node_without_cuda(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the CPU path is not taken")
    cfg = parse_args(["--work-dir", str(tmp_path), "--cpu-slots", "2", "--node-name", "n1"])
    node = detect_node(cfg)
    assert (node.name, node.gpu_type, node.gpu_count) == ("n1", "cpu", 2)
    assert node.gpu_memory_bytes > 0 and node.meta["torch"] == torch.__version__


def test_local_placement_round_trip(tmp_path: Path) -> None:
    p = LocalPlacement(placement_id="pl_1", directory=tmp_path, status="running",
                       task_id="task_1", gpu_indices=[0, 2], pid=1234)
    p.save()
    q = LocalPlacement.load(tmp_path)
    assert q is not None and (q.placement_id, q.status, q.task_id, q.gpu_indices, q.pid) == (
        "pl_1", "running", "task_1", [0, 2], 1234)
    assert q.proc is None and q.forwarder is None and not q.cancelled
    assert LocalPlacement.load(tmp_path / "missing") is None


def test_alive_checks_the_pid_is_still_our_executor(tmp_path: Path) -> None:
    work = tmp_path / "placements" / "pl_9"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)",
                             "--placement-dir", str(work)])
    try:
        deadline = time.monotonic() + 10
        while not alive(proc.pid, work) and time.monotonic() < deadline:
            time.sleep(0.05)  # /proc shows the new cmdline once exec has completed
        assert alive(proc.pid, work)
        assert not alive(proc.pid, tmp_path / "placements" / "pl_other")  # a reused pid
    finally:
        proc.kill()
        proc.wait()
    assert not alive(proc.pid, work)


def test_exit_descriptions() -> None:
    assert describe(-signal.SIGKILL) == "signal SIGKILL"
    assert describe(3) == "code 3"
    assert "gone" in describe("lost")


def test_run_placement_refuses_plain_rq_workers() -> None:
    with pytest.raises(RuntimeError, match="worker.daemon"):
        run_placement("pl_1")
