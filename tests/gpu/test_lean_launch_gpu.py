"""The lean launch path on the device (kernels.lean_launch): the fused multi-LoRA operator's forward
and backward match the float64 oracle with it and without it, its launches do take it, shapes and
dtypes Triton specializes differently after it is warm still match the oracle, and a CUDA graph
captured through it replays to the eager result. Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from kernels import fused_lora as fl  # noqa: E402
from kernels import lean_launch as ll  # noqa: E402
from kernels.testing import make_case, oracle_fp64, rel_errors, run_arena  # noqa: E402

CASE = dict(counts=[300, 0, 517, 90], ranks=[16, 8, 64, 32], d_in=1024, d_out=768, dtype=torch.bfloat16, device="cuda",
            seed=3)


def _run(on: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(ll, "ENABLED", on)
    got, stray = run_arena(make_case(**CASE), fl.multilora_linear_arena_fused, aligned=True)
    assert stray == 0
    return got


def test_the_fused_operator_matches_the_oracle_with_and_without_the_lean_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Against the float64 oracle, as tests/gpu/test_kernels_gpu.py checks the operator: the LoRA passes
    add split sums with atomics, so two runs of either path need not agree to the bit."""
    want = oracle_fp64(make_case(**CASE), device="cuda")
    off = _run(False, monkeypatch)
    before = ll.stats()["lean"]
    first = _run(True, monkeypatch)  # Triton's path where a specialization is new, the launcher's after
    again = _run(True, monkeypatch)
    assert ll.stats()["lean"] > before
    for name, got in (("off", off), ("first", first), ("again", again)):
        errors = rel_errors(got, want)
        assert max(errors.values()) < 1.5e-2, (name, errors)


@pytest.mark.parametrize("other", [dict(d_in=1000, d_out=776), dict(dtype=torch.float16), dict(counts=[1, 0, 15, 1])])
def test_a_new_specialization_after_the_lean_path_is_warm_matches_the_oracle(
        monkeypatch: pytest.MonkeyPatch, other: dict) -> None:
    """Widths 16 does not divide, another dtype, rows of one: what Triton specializes differently must
    not reuse a kernel the lean path kept for the warm case."""
    _run(True, monkeypatch)
    _run(True, monkeypatch)
    case = make_case(**{**CASE, **other})
    got, stray = run_arena(case, fl.multilora_linear_arena_fused, aligned=True)
    errors = rel_errors(got, oracle_fp64(case, device="cuda"))
    assert stray == 0 and max(errors.values()) < 1.5e-2, errors


def test_a_graph_captured_through_the_lean_path_replays_the_eager_result(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ll, "ENABLED", True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t, d_in, d_out, n = 640, 1024, 512, 3
    x = torch.randn(t, d_in, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.03
    a = torch.randn(n, d_in, 32, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.03
    b = torch.randn(n, 32, d_out, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.03
    scales = torch.tensor([1.0, 0.5, 2.0], device="cuda")
    ranks = torch.tensor([32, 16, 8], device="cuda", dtype=torch.int32)
    offsets = torch.tensor([0, 200, 450, t], device="cuda", dtype=torch.int32)

    def forward() -> torch.Tensor:
        return fl.multilora_linear_fused(x, w, None, a, b, scales, ranks, offsets)

    eager = forward()
    forward()  # every specialization launched once: the capture runs on the launcher's path
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    lean_before = ll.stats()["lean"]
    with torch.cuda.graph(graph):
        out = forward()
    assert ll.stats()["lean"] > lean_before
    graph.replay()  # the same inputs: the eager output, up to the LoRA passes' atomics' order
    torch.cuda.synchronize()
    assert ((out.float() - eager.float()).norm() / eager.float().norm()).item() < 1e-2
