"""Unit: the node's zygote (worker.zygote) forks executor processes that are what ``python -m``
would start (argv, folder, environment, own session, log, exit status), with the executor's imports
already done and CUDA untouched; the daemon recognises them, signals them, reads their exit status,
and execs instead whenever the zygote cannot serve a request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.test_background_worker import wait_until
from worker.processes import (
    ForkedProcess,
    NodeZygote,
    alive,
    exit_code_of,
    kill_group,
    process_env,
    spawn,
)
from worker.zygote import Zygote

CHILD = "tests.helpers.zygote_child"


def folder(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    return d


@pytest.fixture
def zygote(tmp_path):  # noqa: ANN001, ANN201
    """A light zygote (it imports json only), started in the test's call phase: pytest's own
    PYTEST_CURRENT_TEST changes between phases, and a request whose environment differs is execed."""
    made: list[Zygote] = []

    def make() -> Zygote:
        z = Zygote(process_env([], cuda=False, cache_dir=tmp_path / "cache"), tmp_path,
                   tmp_path / "zygote.log", preload=["json"])
        made.append(z)
        assert z.ready(30.0), (tmp_path / "zygote.log").read_text()
        return z

    yield make
    for z in made:
        z.close()
        z.proc.wait(timeout=30)


def seen(d: Path) -> dict:
    return json.loads((d / "child.json").read_text())


def test_a_forked_child_is_what_an_exec_would_start(tmp_path, zygote) -> None:  # noqa: ANN001
    cache = tmp_path / "cache"
    runs = {}
    for name, z in (("forked", zygote()), ("exec", None)):
        d = folder(tmp_path, name)
        proc = spawn(CHILD, "--dir", d, [3], "child.log", ["5"], cuda=False, cache_dir=cache, zygote=z)
        assert isinstance(proc, ForkedProcess if z else subprocess.Popen)
        assert proc.wait(timeout=60) == 5
        runs[name] = (d, seen(d), (d / "child.log").read_text())
    (fd, forked, flog), (ed, execed, elog) = runs["forked"], runs["exec"]
    assert forked["argv"] == ["--dir", str(fd), "5"] and execed["argv"] == ["--dir", str(ed), "5"]
    assert forked["cwd"] == str(fd) and forked["sid"] == forked["pid"]  # leads its own session
    assert forked["env"] == execed["env"] and forked["env"]["LORAPLEX_SLOTS"] == "3"
    assert forked["stdin"] == execed["stdin"] == ""
    assert "to stdout" in flog and "to stderr" in flog and flog == elog
    assert exit_code_of(forked["pid"], fd) == 5  # what the zygote noted, for a daemon that adopts it


def test_the_daemon_recognises_signals_and_reads_a_running_child(tmp_path, zygote) -> None:  # noqa: ANN001
    zygote = zygote()
    d = folder(tmp_path, "placement")
    proc = spawn(CHILD, "--dir", d, [], "child.log", ["0", "60"], cuda=False, cache_dir=tmp_path / "cache",
                 zygote=zygote)
    assert isinstance(proc, ForkedProcess)
    assert alive(proc.pid, d)  # from the first look: the zygote notes it before it answers
    assert not alive(proc.pid, folder(tmp_path, "other"))  # another folder's pid is not ours
    assert exit_code_of(proc.pid, d) is None and proc.poll() is None
    assert wait_until(lambda: (d / "child.json").exists(), timeout=20)
    kill_group(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert not alive(proc.pid, d) and exit_code_of(proc.pid, d) == -signal.SIGTERM


def test_a_request_it_must_not_serve_is_execed(tmp_path, zygote, monkeypatch) -> None:  # noqa: ANN001
    zygote = zygote()
    monkeypatch.setenv("LORAPLEX_SOMETHING_AN_OPERATOR_SET", "1")  # not in the zygote's environment
    d = folder(tmp_path, "a")
    proc = spawn(CHILD, "--dir", d, [], "child.log", cuda=False, cache_dir=tmp_path / "cache", zygote=zygote)
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0
    monkeypatch.delenv("LORAPLEX_SOMETHING_AN_OPERATOR_SET")
    zygote.close()  # gone: the next process is execed too
    zygote.proc.wait(timeout=30)
    d = folder(tmp_path, "b")
    proc = spawn(CHILD, "--dir", d, [], "child.log", cuda=False, cache_dir=tmp_path / "cache", zygote=zygote)
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0


def test_a_zygote_whose_daemon_is_gone_notes_its_childrens_ends_then_exits(tmp_path, zygote) -> None:  # noqa: ANN001
    zygote = zygote()
    d = folder(tmp_path, "placement")
    proc = spawn(CHILD, "--dir", d, [], "child.log", ["4", "1.5"], cuda=False,
                 cache_dir=tmp_path / "cache", zygote=zygote)
    assert isinstance(proc, ForkedProcess)
    zygote.close()
    time.sleep(0.5)
    assert zygote.alive() and proc.poll() is None  # the child runs on, its zygote waits for it
    assert zygote.proc.wait(timeout=30) == 0
    assert proc.poll() == 4 and exit_code_of(proc.pid, d) == 4


def test_the_executors_imports_are_done_before_the_fork_and_cuda_is_untouched(tmp_path) -> None:  # noqa: ANN001
    z = Zygote(process_env([], cuda=False), tmp_path, tmp_path / "zygote.log")
    try:
        assert z.ready(240.0), (tmp_path / "zygote.log").read_text()
        d = folder(tmp_path, "placement")
        proc = spawn(CHILD, "--dir", d, [], "child.log", cuda=False, zygote=z)
        assert isinstance(proc, ForkedProcess) and proc.wait(timeout=60) == 0
        child = seen(d)
        assert child["imported"] == ["json", "torch", "trainer.executor", "transformers"]
        assert not child["cuda_initialized"]
        assert child["triton_key_cached"]  # hashed once in the zygote, not in each executor's first step
        assert z.info["imports_s"] > 0
    finally:
        z.close()
        z.proc.wait(timeout=30)


def test_the_node_keeps_a_zygote_only_where_asked_and_starts_it_again_after_it_dies(tmp_path) -> None:  # noqa: ANN001
    off = NodeZygote("auto", tmp_path)
    off.tend(cuda=False)
    assert off.zygote is None and off.current() is None  # auto: a CPU node execs
    node = NodeZygote("on", tmp_path)
    node.tend(cuda=False)
    first = node.zygote
    try:
        assert first is not None and wait_until(lambda: node.current() is first, timeout=240)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=30)
        node.tend(cuda=False)
        assert node.zygote is None and node.failures == 1 and node.after > time.monotonic()
        assert node.current() is None
        node.after = 0.0  # the pause over
        node.tend(cuda=False)
        assert node.zygote is not None and node.zygote is not first
    finally:
        node.close()


def test_a_zygote_that_held_cuda_refuses_to_fork(tmp_path) -> None:  # noqa: ANN001
    """The zygote's own check: a CUDA context in the parent would be unusable in every child."""
    code = ("import sys, types; import worker.zygote as z; "
            "fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True)); "
            "sys.modules['torch'] = fake; sys.exit(z.main(['--preload', '']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2], stdin=subprocess.DEVNULL)
    assert out.returncode == 3 and "CUDA" in out.stderr and "ready" not in out.stdout
