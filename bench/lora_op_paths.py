"""The paths of bench/lora_op.py's multi-LoRA linear ((a) floor, (b) loop, (c) bmm, (d) compose,
(e) fused and its variants), their inputs, the oracle check and the fwd+bwd timer (eager or CUDA
graph)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import multilora_linear  # noqa: E402
from kernels.testing import make_case, oracle_fp64, rel_errors, run_op  # noqa: E402

RANKS = {"r16": [16], "mixed": [16, 32, 64]}
DEVICE, DTYPE = "cuda", torch.bfloat16  # --check switches to the CPU (interpreter) and fp32
# (read as lora_op_paths.DEVICE and .DTYPE in the other modules: --check rebinds them here)


def floor_op(x, weight, bias, *_args):
    return F.linear(x, weight, bias)


def make_loop_op(bounds: list[int], ranks: list[int], scales: list[float]):
    """(b): one pair of small matmuls per adapter (what a naive multi-LoRA layer does)."""
    def op(x, weight, bias, a, b, *_args):
        y = F.linear(x, weight, bias)
        parts = [scales[i] * ((x[bounds[i]:bounds[i + 1]] @ a[i, :, :r]) @ b[i, :r]) for i, r in enumerate(ranks)]
        return y + torch.cat(parts, 0)
    return op


def make_bmm_op(n: int, per: int, scales: torch.Tensor):
    """(c): equal token counts, so two bmm's; padded ranks computed (padding is zero), add fused."""
    def op(x, weight, bias, a, b, *_args):
        s3 = scales.view(n, 1, 1).to(x.dtype)
        y = F.linear(x, weight, bias)
        shrink = torch.bmm(x.view(n, per, -1), a) * s3
        return torch.baddbmm(y.view(n, per, -1), shrink, b).view(n * per, -1)
    return op


def compose_op(x, weight, bias, a, b, scales, ranks, offsets):
    return multilora_linear(x, weight, bias, a, b, scales, ranks, offsets, backend="triton", form="compose")


def fused_op(x, weight, bias, a, b, scales, ranks, offsets):
    return multilora_linear(x, weight, bias, a, b, scales, ranks, offsets, backend="triton", form="fused")


def fused_twopass_op(x, weight, bias, a, b, scales, ranks, offsets):
    from kernels.fused_lora import multilora_linear_fused

    return multilora_linear_fused(x, weight, bias, a, b, scales, ranks, offsets, onepass=False)


E3 = "tma"  # the GEMM variant of column (e3) (--e3)
ONLY: list[str] = []  # --variants: only these (--only), e.g. those a probe compiled


def fused_variant_op(variant: str):
    def op(x, weight, bias, a, b, scales, ranks, offsets):
        from kernels.fused_lora import multilora_linear_fused

        return multilora_linear_fused(x, weight, bias, a, b, scales, ranks, offsets, gemm=variant)
    return op


def fused_tma_op(x, weight, bias, a, b, scales, ranks, offsets):
    return fused_variant_op(E3)(x, weight, bias, a, b, scales, ranks, offsets)


def time_fwd_bwd(op, case, rep_ms: int, graph: bool = False) -> float:
    """Median ms of forward+backward: eager (host launches included) or replayed as a CUDA graph."""
    from triton.testing import do_bench, do_bench_cudagraph

    x = case.x.detach().clone().requires_grad_()
    a = case.lora_a.detach().clone().requires_grad_()
    b = case.lora_b.detach().clone().requires_grad_()

    def step():
        y = op(x, case.weight, case.bias, a, b, case.scales, case.ranks, case.offsets)
        y.backward(case.dy)
    if graph:
        step()  # warm: compile and autotune outside the capture
        try:
            return do_bench_cudagraph(step, rep=rep_ms, grad_to_none=[x, a, b], return_mode="median")
        except Exception as exc:  # capture can fail on some torch builds; report, do not die
            print(f"cuda graph timing failed: {exc!r}", flush=True)
            return float("nan")
    return do_bench(step, warmup=25, rep=rep_ms, grad_to_none=[x, a, b], return_mode="median")


def build_case(d_in, d_out, n, counts, rank_name):
    device, dtype = DEVICE, DTYPE
    rank_set = RANKS[rank_name]
    ranks = [rank_set[i % len(rank_set)] for i in range(n)]
    case = make_case(counts, ranks, d_in, d_out, r_max=max(ranks), dtype=dtype, device=device,
                     bias=False, nan_padding=False)
    for i, r in enumerate(ranks):  # zero padding: what (b) and (c) rely on; (d) and (e) mask anyway
        case.lora_a[i, :, r:] = 0
        case.lora_b[i, r:, :] = 0
    return case, ranks


def make_ops(case, n, counts, ranks, loop: bool) -> dict:
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    ops = {"a": floor_op, "d": compose_op, "e": fused_op, "e2": fused_twopass_op, "e3": fused_tma_op}
    if loop:
        ops["b"] = make_loop_op(bounds, ranks, case.scales.tolist())
    if len(set(counts)) == 1:
        ops["c"] = make_bmm_op(n, counts[0], case.scales)
    return ops


def oracle_check(case, ops: dict, where: str) -> dict[str, float]:
    """Max relative error of every LoRA path in `ops` (all but the floor "a") vs the fp64 oracle,
    same inputs. A path that fails (e.g. a kernel that does not compile here) is removed from
    `ops` with error inf: it costs its own cells only."""
    want = oracle_fp64(case, device=DEVICE)
    errs = {}
    for k, op in list(ops.items()):
        if k == "a":
            continue
        try:
            errs[k] = max(rel_errors(run_op(case, op), want).values())
        except Exception as exc:
            print(f"({k}) failed at {where}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            errs[k] = float("inf")
            del ops[k]
    return errs


def stage_inputs(d_in: int, d_out: int, n: int, per: int, r: int | list[int],
                 counts: list[int] | None = None, pad_rows: int = 0) -> SimpleNamespace:
    """Inputs of the GEMMs and LoRA passes timed apart: n adapters of `per` tokens (or of `counts`)
    at rank r (a list: cycled over the adapters), then `pad_rows` rows no adapter owns (a graph key's
    padding, zero upstream gradient), the forward's S, the fused kernels' contexts with the adapters
    (c) and without (c0: the bare Triton GEMM), and the rank-major strides of A and B."""
    from kernels.fused_lora import _Ctx, _stacked_a, _stacked_b
    from kernels.triton_lora import lora_forward

    ranks = [r[i % len(r)] for i in range(n)] if isinstance(r, list) else [r] * n
    r = max(ranks)
    case = make_case(counts or [per] * n, ranks, d_in, d_out, dtype=DTYPE, device=DEVICE, bias=False,
                     nan_padding=False, pad_rows=pad_rows)
    x, w, a, b, off = case.x, case.weight, case.lora_a, case.lora_b, case.offsets
    y = F.linear(x, w)
    return SimpleNamespace(
        case=case, x=x, w=w, a=a, b=b, dy=case.dy, off=off, y=y,
        s_buf=lora_forward(x, a, b, case.scales, case.ranks, off, y),
        c=_Ctx(x, n, r, off, case.ranks, case.scales), c0=_Ctx(x, 0, r, off[:1], case.ranks[:0], case.scales[:0]),
        sa=_stacked_a(a), sb=_stacked_b(b))


def bench_case(d_in, d_out, n, per, rank_name, counts=None, rep_ms=60, loop=False):
    counts = counts or [per] * n
    case, ranks = build_case(d_in, d_out, n, counts, rank_name)
    ops = make_ops(case, n, counts, ranks, loop)
    errs = oracle_check(case, ops, f"{d_in}x{d_out} N={n}")
    times = {k: float("nan") for k in errs if k not in ops}
    times.update({k: time_fwd_bwd(op, case, rep_ms) for k, op in ops.items()})
    for k in ("a", "d", "e"):
        times[k + "g"] = time_fwd_bwd(ops[k], case, rep_ms, graph=True) if k in ops else float("nan")
    return times, errs


def bandwidth_gbs() -> float:
    from triton.testing import do_bench

    src = torch.empty(1 << 29, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() / ms / 1e6


def graph_ms(fn) -> float:
    from triton.testing import do_bench_cudagraph

    fn()  # compile + autotune outside the capture
    return do_bench_cudagraph(fn, rep=60, return_mode="median")
