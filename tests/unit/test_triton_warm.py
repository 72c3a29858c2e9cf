"""Unit: Triton's one-time key (kernels.triton_warm) is computed once, with its code generator
imported, ahead of the first kernel: in a daemon thread the executor joins before its engine, or at
once in a zygote; never twice, never where nothing wants it, and a Triton without it (or one whose key
fails) changes nothing."""

from __future__ import annotations

import functools
import sys
import threading
import time

import pytest

from kernels import triton_warm


def fake_key(calls: list[str], delay: float = 0.0, fail: bool = False):  # noqa: ANN201
    @functools.lru_cache
    def triton_key() -> str:
        calls.append(threading.current_thread().name)
        time.sleep(delay)
        if fail:
            raise RuntimeError("no libtriton")
        return "key"

    return triton_key


def test_the_real_key_is_triton_compilers_own_and_computed_once() -> None:
    from triton.runtime import cache

    fn = triton_warm._key_function()
    assert fn is cache.triton_key  # the function Triton's compile calls, so its cache is the one filled
    fn.cache_clear()
    assert not triton_warm.cached()
    assert triton_warm.compute() > 0.0
    assert triton_warm.cached() and "triton.compiler.code_generator" in sys.modules  # the first launch's import too
    assert triton_warm.compute() == 0.0  # there already: nothing hashed again


def test_start_computes_it_in_a_daemon_thread_and_join_waits_for_it(monkeypatch) -> None:  # noqa: ANN001
    calls: list[str] = []
    key = fake_key(calls, delay=0.2)
    monkeypatch.setattr(triton_warm, "_key_function", lambda: key)
    warming = triton_warm.start()
    assert warming.thread is not None and warming.thread.daemon
    warming.join()
    assert calls == ["triton-key"] and triton_warm.cached()
    assert warming.seconds >= 0.2
    assert key() == "key" and calls == ["triton-key"]  # the first compile finds it: not computed again
    warming.join()  # a second join returns at once


def test_nothing_starts_where_it_is_cached_unwanted_or_missing(monkeypatch) -> None:  # noqa: ANN001
    calls: list[str] = []
    key = fake_key(calls)
    monkeypatch.setattr(triton_warm, "_key_function", lambda: key)
    assert triton_warm.start(False).thread is None  # a CPU executor: its kernels never compile
    assert calls == []
    key()
    assert triton_warm.start().thread is None  # cached: a zygote's child, a warm host
    monkeypatch.setattr(triton_warm, "_key_function", lambda: None)  # a Triton without the key
    assert triton_warm.start().thread is None
    assert triton_warm.compute() == 0.0 and not triton_warm.cached()


@pytest.mark.parametrize("in_thread", [False, True])
def test_a_key_that_fails_is_left_to_tritons_first_compile(monkeypatch, in_thread: bool) -> None:  # noqa: ANN001
    calls: list[str] = []
    key = fake_key(calls, fail=True)
    monkeypatch.setattr(triton_warm, "_key_function", lambda: key)
    if in_thread:
        triton_warm.start().join()
    else:
        triton_warm.compute()
    assert len(calls) == 1 and not triton_warm.cached()  # nothing kept: Triton computes (and raises) itself
