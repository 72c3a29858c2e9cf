"""Unit: what makes a GPU decode repeat (issue 44). Every GPU process a node starts gets cuBLAS's
fixed workspaces (an operator's own value wins; a CPU node's processes are left as they are), and
the decode's deterministic-algorithms scope is entered only where it does something (CUDA with that
variable) and always restores the process's own setting, even when the decode raises."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer import sampling
from worker import processes


def _spawned_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cuda: bool) -> dict[str, str]:
    seen: dict[str, str] = {}

    class Proc:
        def __init__(self, cmd, env, **kw) -> None:  # noqa: ANN001, ANN003
            seen.update(env)

    monkeypatch.setattr(processes.subprocess, "Popen", Proc)
    processes.spawn("worker.runner", "--dir", tmp_path, [0], "x.log", cuda=cuda)
    return seen


def test_a_gpu_process_gets_cublas_fixed_workspaces_and_an_operators_value_wins(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert _spawned_env(monkeypatch, tmp_path, cuda=True)["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "CUBLAS_WORKSPACE_CONFIG" not in _spawned_env(monkeypatch, tmp_path, cuda=False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert _spawned_env(monkeypatch, tmp_path, cuda=True)["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_the_scope_changes_nothing_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with sampling.repeatable(torch.device("cpu")):
        assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("env, on", [({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, True),
                                     ({}, False),
                                     ({"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "LORAPLEX_REPEATABLE_DECODE": "0"}, False)])
def test_on_cuda_deterministic_algorithms_within_the_scope_and_restored_after(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], on: bool) -> None:
    for name in ("CUBLAS_WORKSPACE_CONFIG", "LORAPLEX_REPEATABLE_DECODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(KeyError), sampling.repeatable(torch.device("cuda")):  # only read, never used
        assert torch.are_deterministic_algorithms_enabled() is on
        assert not on or torch.is_deterministic_algorithms_warn_only_enabled()  # never fails a decode
        raise KeyError("the decode failed")
    assert not torch.are_deterministic_algorithms_enabled()


def test_the_static_decodes_scope_pins_the_attention_without_deterministic_algorithms(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # under them the static cache's index_copy_ copies each layer's cache out and back (trainer.sampling)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.delenv("LORAPLEX_DECODE_SDPA", raising=False)
    monkeypatch.delenv("LORAPLEX_REPEATABLE_DECODE", raising=False)
    before = _sdpa_flags()
    with pytest.raises(KeyError), sampling.repeatable(torch.device("cuda"), algorithms=False):
        assert not torch.are_deterministic_algorithms_enabled()
        assert _sdpa_flags() == (True, False, False, False)
        raise KeyError("the decode failed")
    assert _sdpa_flags() == before and not torch.are_deterministic_algorithms_enabled()


def test_generate_asks_for_the_algorithms_only_off_the_static_path(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.helpers.engine_ref import tiny_model_dir
    from trainer.engine import MultiLoraEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", tmp_path), dtype=torch.float32).eval()
    engine = MultiLoraEngine(model, [], model.config.pad_token_id)
    asked: list[bool] = []
    real = sampling.repeatable

    def spy(device, algorithms=True):  # noqa: ANN001, ANN202
        asked.append(algorithms)
        return real(device, algorithms)

    monkeypatch.setattr(sampling, "repeatable", spy)
    for static in (True, False):
        sampling.generate(engine, [[5, 6, 7]], [None], max_new_tokens=2, pad_id=engine.pad_id, static=static)
    sampling.generate(engine, [[5, 6, 7]], [None], max_new_tokens=2, pad_id=engine.pad_id, static=True,
                      temperature=1.0)  # sampled: never the static path
    assert asked == [False, True, True]


def _sdpa_flags() -> tuple[bool, bool, bool, bool]:
    b = torch.backends.cuda
    return b.math_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.flash_sdp_enabled(), b.cudnn_sdp_enabled()


@pytest.mark.parametrize("value, inside", [(None, (True, False, False, False)),
                                           ("math,efficient", (True, True, False, False)),
                                           ("auto", None)])
def test_on_cuda_the_decode_attention_runs_on_the_named_backends_and_they_are_restored(
        monkeypatch: pytest.MonkeyPatch, value: str | None, inside: tuple[bool, ...] | None) -> None:
    # the memory-efficient kernel did not repeat in the token steps on an H200 (session 23): math by default
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.delenv("LORAPLEX_DECODE_SDPA", raising=False)
    if value is not None:
        monkeypatch.setenv("LORAPLEX_DECODE_SDPA", value)
    before = _sdpa_flags()
    with pytest.raises(KeyError), sampling.repeatable(torch.device("cuda")):
        assert _sdpa_flags() == (before if inside is None else inside)
        raise KeyError("the decode failed")
    assert _sdpa_flags() == before


def test_an_unknown_attention_backend_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("LORAPLEX_DECODE_SDPA", "math,fast")
    with pytest.raises(ValueError, match=r"LORAPLEX_DECODE_SDPA.*'fast'"), sampling.repeatable(torch.device("cuda")):
        pass
    assert not torch.are_deterministic_algorithms_enabled()
