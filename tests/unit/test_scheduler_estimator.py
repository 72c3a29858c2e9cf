"""Duration and GPU-count estimates: model sizes from configs, memory-based GPU counts, the
early-exit expectation, profiles / measured rates taking precedence over the analytic rate, and
the per-model correction learnt from measured runs against raw estimates."""

from __future__ import annotations

import math

import pytest

from service.scheduler.estimator import (
    CORRECTION_BOUNDS,
    CORRECTION_PRIOR,
    GIB,
    Estimator,
    JobProgress,
    ModelShape,
    TaskWork,
    batch_key,
    correction_factor,
    flops_per_token,
    gpu_spec,
)

LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
            "vocab_size": 128256, "num_attention_heads": 32, "num_key_value_heads": 8}


def work(model: str = "m", samples: int = 1000, jobs: list[JobProgress] | None = None,
         **kw: object) -> TaskWork:
    return TaskWork(model, samples, 1, 256.0, 1024, jobs or [JobProgress(4)] * 4, **kw)


def test_shape_from_config_counts_llama_8b_parameters() -> None:
    shape = ModelShape.from_config(None, LLAMA_8B)
    # Llama-3.1-8B has 8.03e9 parameters (GQA: k and v project to 8 heads of 128).
    assert shape.parameters == pytest.approx(8.03e9, rel=0.01)
    assert (shape.layers, shape.hidden) == (32, 4096)


def test_flops_per_token_is_six_p_plus_attention() -> None:
    shape = ModelShape(8_000_000_000, 32, 4096)
    f = flops_per_token(shape, 2048)
    assert f == pytest.approx(6 * 8e9 + 8 * 32 * 4096 * 2048, rel=1e-12)
    assert flops_per_token(shape, 4096) > f


@pytest.mark.parametrize(("params", "gpu", "expected"), [
    (8e9, "H100", 1), (32e9, "H100-80GB", 2), (70e9, "H100", 4), (70e9, "H200", 2),
    (405e9, "H100", 16),  # fits no 8-GPU node: reported unschedulable by the planner
])
def test_gpus_needed_from_memory(params: float, gpu: str, expected: int) -> None:
    est = Estimator({"m": ModelShape.guess(int(params))})
    w = TaskWork("m", 1000, 1, 512.0, 2048, [JobProgress(4)] * 4)  # micro-batch 4 x 2048
    g, _ = est.estimate(w, gpu, gpu_spec(gpu))
    assert g == expected


def test_registry_minimum_gpus_is_respected() -> None:
    est = Estimator({"m": ModelShape.guess(int(1e9))})
    assert est.estimate(work(), "H100", gpu_spec("H100"), minimum_gpus=3)[0] == 4


def test_gpu_spec_prefix_and_overrides() -> None:
    spec = gpu_spec("H100-80GB-SXM", memory_bytes=79 * GIB, measured_flops=700e12)
    assert spec.memory_bytes == 79 * GIB and spec.matrix_flops == 700e12
    assert gpu_spec("A100-80GB").memory_bytes == 80 * GIB
    assert gpu_spec("A100").memory_bytes == 40 * GIB


def test_early_exit_expectation_and_exited_jobs() -> None:
    est = Estimator({"m": ModelShape.guess(int(8e9))})
    h100 = gpu_spec("H100")
    full = est.estimate(work(samples=4000, early_exit=False), "H100", h100)[1]
    expected = est.estimate(work(samples=4000), "H100", h100)[1]
    # warmup 5% of steps + 25% of the rest survive the warmup ranking: 0.2875 of the work.
    assert expected / full == pytest.approx(0.05 + 0.25 * 0.95, rel=0.01)
    done = [JobProgress(4, 1000, "exited")] * 2 + [JobProgress(4, 0, "pending")] * 2
    half = est.estimate(work(samples=4000, jobs=done), "H100", h100)[1]
    assert half == pytest.approx(expected / 2, rel=0.01)
    past_warmup = [JobProgress(4, 500, "running")] * 4  # 500 of 1000 steps, warmup over
    assert est.estimate(work(samples=4000, jobs=past_warmup), "H100", h100)[1] == \
        pytest.approx(full / 2, rel=0.01)


def test_profile_then_measured_rate_override_analytic() -> None:
    shapes = {"m": ModelShape.guess(int(8e9))}
    w = work(samples=10_000, early_exit=False)
    tokens = 4 * math.ceil(10_000 / 4) * 4 * 256.0
    key = ("m", "H100", 1024, batch_key([4, 4, 4, 4]))
    est = Estimator(shapes, {key: 5000.0})
    assert est.estimate(w, "H100", gpu_spec("H100"))[1] == math.ceil(tokens / 5000.0)
    other = Estimator(shapes, {("m", "H100", 1024, "8x1"): 2500.0})  # other batch mix
    assert other.estimate(w, "H100", gpu_spec("H100"))[1] == math.ceil(tokens / 2500.0)
    measured = est.estimate_with_raw(w, "H100", gpu_spec("H100"), measured_tokens_per_s=10_000.0)
    assert measured.seconds == measured.raw_seconds == math.ceil(tokens / 10_000.0)
    analytic = Estimator(shapes).estimate(w, "H100", gpu_spec("H100"))[1]
    rate = 989e12 * 0.4 / flops_per_token(shapes["m"], 256.0)
    assert analytic == math.ceil(tokens / rate)


def test_batch_key_is_order_free() -> None:
    assert batch_key([8, 4, 4]) == batch_key([4, 8, 4]) == "4x2,8x1"


def test_correction_factor_from_measured_runs() -> None:
    assert correction_factor([]) == 1.0
    assert correction_factor([(0, 50.0), (100, 0.0)]) == 1.0  # unusable pairs are skipped
    # One run twice as long: moved only part of the way (shrunk toward 1 by 1 / (1 + prior)).
    one = correction_factor([(100, 200.0)])
    assert one == pytest.approx(2 ** (1 / (1 + CORRECTION_PRIOR)))
    # Many agreeing runs: close to the measured ratio, either way.
    assert correction_factor([(100, 200.0)] * 47) == pytest.approx(2 ** (47 / 50))
    assert correction_factor([(100, 50.0)] * 47) == pytest.approx(0.5 ** (47 / 50))
    # The median: one wild run among agreeing ones barely moves it.
    runs = [(100, 150.0)] * 9 + [(100, 100_000.0)]
    assert correction_factor(runs) == pytest.approx(1.5 ** (10 / 13))
    # Bounded both ways however far off the estimates were.
    assert correction_factor([(1, 1e6)] * 50) == CORRECTION_BOUNDS[1]
    assert correction_factor([(1e6, 1)] * 50) == CORRECTION_BOUNDS[0]


def test_estimator_applies_the_models_correction_to_raw_estimates_only() -> None:
    shapes = {"m": ModelShape.guess(int(8e9)), "n": ModelShape.guess(int(8e9))}
    w = work(samples=10_000, early_exit=False)
    tokens = 4 * math.ceil(10_000 / 4) * 4 * 256.0
    key = ("m", "H100", 1024, batch_key([4, 4, 4, 4]))
    est = Estimator(shapes, {key: 5000.0}, corrections={"m": 1.5})
    both = est.estimate_with_raw(w, "H100", gpu_spec("H100"))  # one call, both numbers
    assert both.raw_seconds == math.ceil(tokens / 5000.0)
    assert both.seconds == math.ceil(tokens / 5000.0 * 1.5)
    assert est.estimate(w, "H100", gpu_spec("H100")) == (both.gpus, both.seconds)
    # A running task's own measured rate is the measurement: no correction on top.
    measured = est.estimate_with_raw(w, "H100", gpu_spec("H100"), measured_tokens_per_s=10_000.0)
    assert measured.seconds == measured.raw_seconds == math.ceil(tokens / 10_000.0)
    # Another model keeps its analytic estimate.
    other = TaskWork("n", 10_000, 1, 256.0, 1024, [JobProgress(4)] * 4, early_exit=False)
    assert est.estimate(other, "H100", gpu_spec("H100")) == Estimator(shapes).estimate(
        other, "H100", gpu_spec("H100"))
