"""GPU correctness of every small-step launch configuration of the fused form's LoRA passes.

The shipped tables pick, per key, one candidate of `_shrink`, `_shrink_wgrad` and `_wgrad`; a small step's keys
take the small-step candidates (session 40's, and session 52's taller and deeper tiles). Each one is forced here
on the engine's arena form at a 2-job step's layout (ranks 16 and 64, with and without a padding tail no adapter
owns) and checked against the float64 oracle: outputs, input gradients and the adapters' gradients, nothing
written outside their blocks. Skipped without CUDA.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from kernels import multilora_linear_arena  # noqa: E402
from kernels.testing import (  # noqa: E402
    empty_adapter_grad_nonzero,
    make_case,
    oracle_fp64,
    rel_errors,
    run_arena,
)

TOL = 1.5e-2  # bf16, as tests/gpu/test_kernels_gpu.py


def _small(kernel) -> list:  # noqa: ANN001
    from kernels import fused_lora

    small = {"shrink": "_SMALL_SHRINK", "shrink_wgrad": "_SMALL_SHRINK", "wgrad": "_SMALL_WGRAD"}[kernel.name]
    return list(getattr(fused_lora, small, []))


@pytest.mark.parametrize(("counts", "ranks", "pad", "d_in", "d_out"), [
    ([290, 1160], [16, 64], 0, 4096, 14336),
    ([290, 1160], [16, 64], 86, 14336, 4096),   # a 1,536-row graph key's padding tail
    ([61, 1003], [64, 16], 20, 4096, 1024),
])
def test_every_small_step_configuration_matches_fp64(counts: list[int], ranks: list[int], pad: int, d_in: int,
                                                     d_out: int) -> None:
    from kernels import fused_lora

    kernels = (fused_lora._shrink, fused_lora._shrink_wgrad, fused_lora._wgrad)
    lists = [_small(k) for k in kernels]
    assert all(lists), "the small-step candidates exist on a GPU"
    case = make_case(counts, ranks, d_in, d_out, dtype=torch.bfloat16, device="cuda", bias=False, pad_rows=pad)
    want = oracle_fp64(case, device="cuda")
    live = int(case.offsets[-1])
    checked = 0
    for i in range(max(len(cands) for cands in lists)):
        chosen = [cands[i % len(cands)] for cands in lists]
        for k, cfg in zip(kernels, chosen, strict=True):
            k.choose = lambda *_a, _cfg=cfg, **_k: _cfg
        try:
            got, stray = run_arena(case, multilora_linear_arena, form="fused", aligned=True)
        finally:
            for k in kernels:
                del k.choose
        got["y"], got["dx"] = got["y"][:live], got["dx"][:live]
        errs = rel_errors(got, {**want, "y": want["y"][:live], "dx": want["dx"][:live]})
        assert all(e <= TOL for e in errs.values()), f"{errs} with {[c.kwargs for c in chosen]} for {case.describe()}"
        assert stray == 0 and empty_adapter_grad_nonzero(got, case.offsets) == 0
        checked += 1
    assert checked == max(len(cands) for cands in lists)


@pytest.mark.parametrize("form", ["arena", "stacked"])
def test_da_on_a_side_stream_matches_fp64_eager_and_captured(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """$LORAPLEX_DA_SIDE_STREAM: dA runs on a side stream beside the dX GEMM, eagerly and inside a CUDA graph
    capture (a second branch of the graph); outputs and every gradient match the float64 oracle either way, and
    the side stream is the one that ran it."""
    from kernels import fused_lora

    monkeypatch.setattr(fused_lora, "DA_SIDE_STREAM", True)
    case = make_case([290, 1160], [16, 64], 4096, 4096, dtype=torch.bfloat16, device="cuda", bias=False, pad_rows=86)
    want = oracle_fp64(case, device="cuda")
    live = int(case.offsets[-1])

    def check(got: dict) -> None:
        got = {**got, "y": got["y"][:live], "dx": got["dx"][:live]}
        errs = rel_errors(got, {**want, "y": want["y"][:live], "dx": want["dx"][:live]})
        assert all(e <= TOL for e in errs.values()), f"{errs} for {case.describe()}"

    if form == "arena":
        got, stray = run_arena(case, multilora_linear_arena, form="fused", aligned=True)
        check(got)
        assert stray == 0
    else:
        x = case.x.detach().clone().requires_grad_(True)
        a = case.lora_a.detach().clone().requires_grad_(True)
        b = case.lora_b.detach().clone().requires_grad_(True)

        def run() -> torch.Tensor:
            y = fused_lora.multilora_linear_fused(x, case.weight, None, a, b, case.scales, case.ranks, case.offsets,
                                                  gemm="cublas")
            y.backward(case.dy)
            return y

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm: compiles and loads outside the capture
            run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        x.grad = a.grad = b.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = run()
        graph.replay()
        torch.cuda.synchronize()
        check({"y": y, "dx": x.grad, "dA": a.grad, "dB": b.grad})
    assert torch.cuda.current_device() in fused_lora._SIDE_STREAMS
