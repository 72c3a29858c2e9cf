"""Unit: every executor a node starts keeps its compiled kernels and its memory models under the
daemon's work directory (worker.processes.node_caches), so a new process compiles and profiles
nothing a former one did; an operator's own setting wins."""

from __future__ import annotations

import json

from worker.processes import spawn


def run_dump(tmp_path, **kw) -> dict:  # noqa: ANN001, ANN003
    d = tmp_path / "placement"
    d.mkdir()
    proc = spawn("tests.helpers.env_dump", "--dir", d, [], "out.log", cuda=False, **kw)
    assert proc.wait(timeout=60) == 0, (d / "out.log").read_text()
    return json.loads((d / "env.json").read_text())


def test_executors_share_the_nodes_caches_under_its_work_dir(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("LORAPLEX_PROFILE_CACHE", raising=False)
    cache = tmp_path / "work" / "cache"
    env = run_dump(tmp_path, cache_dir=cache)
    assert env["TRITON_CACHE_DIR"] == str(cache / "triton")
    assert env["LORAPLEX_PROFILE_CACHE"] == str(cache / "memory_profiles.json")
    assert cache.is_dir()


def test_an_operators_cache_settings_win(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("TRITON_CACHE_DIR", "/srv/triton")
    monkeypatch.setenv("LORAPLEX_PROFILE_CACHE", "/srv/profiles.json")
    env = run_dump(tmp_path, cache_dir=tmp_path / "cache")
    assert env["TRITON_CACHE_DIR"] == "/srv/triton" and env["LORAPLEX_PROFILE_CACHE"] == "/srv/profiles.json"


def test_without_a_cache_dir_nothing_is_set(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("LORAPLEX_PROFILE_CACHE", raising=False)
    env = run_dump(tmp_path)
    assert env["TRITON_CACHE_DIR"] is None and env["LORAPLEX_PROFILE_CACHE"] is None
