"""Staged LoRA on CUDA (trainer.lora_stage, $LORAPLEX_LORA_STAGE): one staged linear in bf16 at the 8B widths, eager
and replayed from a CUDA graph, against a float64 reference; an engine's graphed staged steps against its unstaged
steps, through a change of job set that reuses the capture. The same on the CPU: tests/unit/test_lora_stage.py.
Skipped without CUDA."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from tests.gpu.test_step_graphs_gpu import _engine  # noqa: E402
from tests.helpers.engine_ref import tiny_model_dir  # noqa: E402
from tests.unit.test_step_graphs import examples, job  # noqa: E402
from trainer import graph_thread, lora_stage  # noqa: E402
from trainer.lora_stage import StageBuffers, StagePlan, staged_linear  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize(("d_in", "d_out"), [(4096, 1024), (4096, 14336)])
def test_a_staged_linear_in_bf16_eager_and_from_a_graph_is_near_float64(d_in: int, d_out: int, monkeypatch) -> None:  # noqa: ANN001
    # the weight gradients through cuBLAS's bf16 -> fp32 GEMM where this torch has it (what a Stager finds)
    monkeypatch.setitem(lora_stage.WIDE_MM, 0, lora_stage.wide_mm_available(torch.device("cuda")))
    g = torch.Generator(device="cuda").manual_seed(0)
    ranks, counts, scales, dev, bf = [16, 64], [288, 1152], [2.0, 2.0], "cuda", torch.bfloat16
    t = sum(counts)
    x = torch.randn(t, d_in, device=dev, generator=g).to(bf)
    w = (torch.randn(d_out, d_in, device=dev, generator=g) * d_in ** -0.5).to(bf)
    dy = (torch.randn(t, d_out, device=dev, generator=g) * 0.01).to(bf)
    plan_rows = 2 * 64
    bufs = StageBuffers.make(d_in, d_out, bf, torch.device(dev))
    ref_y, ref_dx = x.double() @ w.double().t(), dy.double() @ w.double()
    ref_da, ref_db, row = torch.zeros(plan_rows, d_in, dtype=torch.float64, device=dev), \
        torch.zeros(plan_rows, d_out, dtype=torch.float64, device=dev), 0
    for i, (r, c, s) in enumerate(zip(ranks, counts, scales, strict=True)):
        a = (torch.randn(r, d_in, device=dev, generator=g) * d_in ** -0.5).to(bf)
        b = (torch.randn(r, d_out, device=dev, generator=g) * r ** -0.5).to(bf)
        bufs.a[64 * i:64 * i + r], bufs.b[64 * i:64 * i + r] = a, b
        xs, dys, a64, b64 = x[row:row + c].double(), dy[row:row + c].double(), a.double(), b.double()
        ref_y[row:row + c] += s * (xs @ a64.t()) @ b64
        ds = s * dys @ b64.t()
        ref_dx[row:row + c] += ds @ a64
        ref_da[64 * i:64 * i + r], ref_db[64 * i:64 * i + r] = ds.t() @ xs, s * (xs @ a64.t()).t() @ dys
        row += c
    offsets = torch.tensor([0, counts[0], t], device=dev)
    rk, sc = torch.tensor(ranks, device=dev, dtype=torch.int32), torch.tensor(scales, device=dev)
    token = torch.zeros((), device=dev, requires_grad=True)

    def run(graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
        xx = x.detach().requires_grad_()
        y = staged_linear(xx, w, None, bufs, StagePlan(2, 64, graph=graph), 0, offsets, rk, sc, token)
        (dx,) = torch.autograd.grad(y, (xx,), dy)
        return y.detach(), dx

    for graph in (False, True):
        bufs.da.zero_()
        bufs.db.zero_()
        if graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run(True)
            torch.cuda.current_stream().wait_stream(side)
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg, capture_error_mode="thread_local"):
                y, dx = run(True)
            bufs.da.zero_()
            bufs.db.zero_()
            cg.replay()
            torch.cuda.synchronize()
        else:
            y, dx = run(False)
        # bf16 operands, float32 accumulation: ~3e-3 relative
        assert _rel(y, ref_y) < 1e-2 and _rel(dx, ref_dx) < 1e-2, graph
        assert _rel(bufs.da, ref_da) < 1e-2 and _rel(bufs.db, ref_db) < 1e-2, graph
        assert bufs.da.dtype == torch.float32


def test_graphed_staged_steps_equal_unstaged_steps_on_cuda(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(graph_thread, "ON", False)
    d = tiny_model_dir("llama", tmp_path)
    data = examples(48, 40)
    monkeypatch.setattr(lora_stage, "STAGE", False)
    plain = _engine(d, True, data, False)
    monkeypatch.setattr(lora_stage, "STAGE", True)
    staged = _engine(d, True, data, False)
    for eng in (plain, staged):
        for spec in (job("a", 8, 2, 1), job("b", 16, 2, 2)):
            eng.attach(spec)

    def both(n: int) -> None:
        for _ in range(n):
            want, got = plain.step(), staged.step()
            for j in want.losses:
                assert math.isclose(got.losses[j], want.losses[j], rel_tol=2e-2), (j, got.losses, want.losses)

    both(4)
    for eng in (plain, staged):
        eng.detach("b")
        eng.attach(job("c", 4, 2, 3, lr=1e-2))  # the same rank tile (16): the same capture
    both(3)
    g = staged.step_graphs
    assert g.captures == 1 and g.replays == 6 and {k.stage for k in g.entries} == {2}  # 2 staged slots
    for j in ("a", "c"):
        got, want = staged.jobs[j].adapter.flat.double(), plain.jobs[j].adapter.flat.double()
        assert ((got - want).norm() / want.norm()).item() < 1e-2, j
