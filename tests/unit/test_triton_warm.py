"""Unit: Triton's one-time key (kernels.triton_warm) is computed once, with its code generator
imported, ahead of the first kernel: on a background worker the executor joins before its engine
(trainer.triton_ahead), or at once in a zygote; never twice, never where nothing wants it, and a
Triton without it (or one whose key fails) changes nothing."""

from __future__ import annotations

import functools
import sys
import threading
import time

import pytest
import torch

from kernels import triton_warm
from trainer import triton_ahead


def fake_key(calls: list[str], delay: float = 0.0, fail: bool = False):  # noqa: ANN201
    @functools.lru_cache
    def triton_key() -> str:
        calls.append(threading.current_thread().name)
        time.sleep(delay)
        if fail:
            raise RuntimeError("no libtriton")
        return "key"

    return triton_key


def test_the_real_key_is_triton_compilers_own_and_computed_once(monkeypatch) -> None:  # noqa: ANN001
    from triton.runtime import cache

    imported: list[str] = []
    real_import = triton_warm.importlib.import_module
    monkeypatch.setattr(triton_warm.importlib, "import_module",
                        lambda name: imported.append(name) or real_import(name))
    fn = triton_warm._key_function()
    assert fn is cache.triton_key  # the function Triton's compile calls, so its cache is the one filled
    fn.cache_clear()
    assert triton_warm.available() and not triton_warm.cached()
    triton_warm.compute()
    assert triton_warm.cached() and fn.cache_info().misses == 1
    assert imported == ["triton.compiler.code_generator"] and imported[0] in sys.modules  # the first launch's import
    assert triton_warm.compute() == 0.0 and fn.cache_info().misses == 1  # there already: nothing hashed again
    assert imported == ["triton.compiler.code_generator"]


def test_the_executors_worker_computes_it_in_its_thread_and_join_waits(monkeypatch) -> None:  # noqa: ANN001
    calls: list[str] = []
    key = fake_key(calls, delay=0.2)
    monkeypatch.setattr(triton_warm, "_key_function", lambda: key)
    worker = triton_ahead.start(True)
    assert worker.alive
    assert worker.join(timeout=10.0)  # its one step stops the loop
    assert calls == ["loraplex-triton-key"] and triton_warm.cached()
    assert key() == "key" and calls == ["loraplex-triton-key"]  # the first compile finds it: not computed again
    assert worker.health().runs == 1 and worker.health().crashes == 0


def test_nothing_starts_where_it_is_cached_unwanted_or_missing(monkeypatch) -> None:  # noqa: ANN001
    calls: list[str] = []
    key = fake_key(calls)
    monkeypatch.setattr(triton_warm, "_key_function", lambda: key)
    worker = triton_ahead.start(False)  # a CPU executor: its kernels never compile
    assert not worker.alive and worker.join() and calls == []
    key()
    assert not triton_ahead.start(True).alive  # cached: a zygote's child, a warm host
    monkeypatch.setattr(triton_warm, "_key_function", lambda: None)  # a Triton without the key
    assert not triton_warm.available() and not triton_ahead.start(True).alive
    assert triton_warm.compute() == 0.0 and not triton_warm.cached()


@pytest.mark.parametrize("on_worker", [False, True])
def test_a_key_that_fails_is_left_to_tritons_first_compile(monkeypatch, on_worker: bool) -> None:  # noqa: ANN001
    calls: list[str] = []
    key = fake_key(calls, fail=True)
    monkeypatch.setattr(triton_warm, "_key_function", lambda: key)
    if on_worker:
        worker = triton_ahead.start(True)
        assert worker.join(timeout=10.0) and worker.health().crashes == 0  # no restart loop
    else:
        triton_warm.compute()
    assert len(calls) == 1 and not triton_warm.cached()  # nothing kept: Triton computes (and raises) itself


def test_the_first_calls_run_on_the_device_they_are_given() -> None:
    triton_ahead.first_calls(torch.device("cpu"), tokens=32)  # the same ops, on the CPU: they run as written


def test_the_worker_makes_the_first_calls_on_a_cuda_device_even_with_the_key_cached(monkeypatch) -> None:  # noqa: ANN001
    calls: list[str] = []
    key = fake_key(calls)
    monkeypatch.setattr(triton_warm, "_key_function", lambda: key)
    key()  # cached: a zygote's child
    made: list[torch.device] = []
    monkeypatch.setattr(triton_ahead, "first_calls", lambda device: made.append(device))
    cuda = torch.device("cuda", 0)
    worker = triton_ahead.start(True, cuda)
    assert worker.join(timeout=10.0) and made == [cuda] and calls == ["MainThread"]  # the key not again
    assert not triton_ahead.start(True, torch.device("cpu")).alive  # a CPU device: nothing to warm
    assert not triton_ahead.start(False, cuda).alive
    monkeypatch.setattr(triton_ahead, "FIRST_CALLS", False)
    assert not triton_ahead.start(True, cuda).alive


def test_first_calls_that_fail_leave_the_load_alone(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(triton_warm, "cached", lambda: True)

    def broken(device: torch.device) -> None:
        raise RuntimeError("no CUDA here")

    monkeypatch.setattr(triton_ahead, "first_calls", broken)
    worker = triton_ahead.start(True, torch.device("cuda", 0))
    assert worker.join(timeout=10.0) and worker.health().crashes == 0  # logged, the worker's step ends cleanly
