"""Benchmark of one multi-LoRA linear layer, forward + backward, bf16, on one CUDA device.

(a) floor: base GEMM and its input gradient; (b) per-adapter torch loop; (c) best plain-torch
batched path (baddbmm); (d) kernels.multilora_linear (Triton). One run prints one table.
Usage: python3 bench/lora_op.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import multilora_linear  # noqa: E402
from kernels.testing import make_case, oracle_fp64, rel_errors, run_op  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
RANKS = {"r16": [16], "mixed": [16, 32, 64]}


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
    s3 = scales.view(n, 1, 1).to(torch.bfloat16)

    def op(x, weight, bias, a, b, *_args):
        y = F.linear(x, weight, bias)
        shrink = torch.bmm(x.view(n, per, -1), a) * s3
        return torch.baddbmm(y.view(n, per, -1), shrink, b).view(n * per, -1)
    return op


def triton_op(x, weight, bias, a, b, scales, ranks, offsets):
    return multilora_linear(x, weight, bias, a, b, scales, ranks, offsets, backend="triton")


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


def bench_case(d_in, d_out, n, per, rank_name, counts=None, rep_ms=60):
    rank_set = RANKS[rank_name]
    ranks = [rank_set[i % len(rank_set)] for i in range(n)]
    counts = counts or [per] * n
    case = make_case(counts, ranks, d_in, d_out, r_max=max(ranks), dtype=torch.bfloat16, device="cuda",
                     bias=False, nan_padding=False)
    for i, r in enumerate(ranks):  # zero padding: what (b) and (c) rely on; (d) masks anyway
        case.lora_a[i, :, r:] = 0
        case.lora_b[i, r:, :] = 0
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    equal = len(set(counts)) == 1
    ops = {"a": floor_op, "b": make_loop_op(bounds, ranks, case.scales.tolist()), "d": triton_op}
    if equal:
        ops["c"] = make_bmm_op(n, per, case.scales)
    # correctness of every LoRA path, same inputs, vs the fp64 oracle (on the GPU, float64)
    want = oracle_fp64(case, device="cuda")
    errs = {}
    for k in ("b", "c", "d"):
        if k in ops:
            errs[k] = max(rel_errors(run_op(case, ops[k]), want).values())
    del want
    times = {k: time_fwd_bwd(op, case, rep_ms) for k, op in ops.items()}
    for k in ("a", "d"):
        times[k + "g"] = time_fwd_bwd(ops[k], case, rep_ms, graph=True)
    return times, errs


def bandwidth_gbs() -> float:
    from triton.testing import do_bench

    src = torch.empty(1 << 29, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() / ms / 1e6


def breakdown(d_in: int, d_out: int, n: int, per: int, r: int, gbs: float) -> list[str]:
    """Time each stage of (d) apart and compare the LoRA stages with their bytes at `gbs`."""
    from triton.testing import do_bench_cudagraph

    from kernels.triton_lora import lora_backward, lora_forward

    def do_bench(fn, return_mode):
        fn()
        return do_bench_cudagraph(fn, rep=60, return_mode=return_mode)

    case = make_case([per] * n, [r] * n, d_in, d_out, dtype=torch.bfloat16, device="cuda", bias=False,
                     nan_padding=False)
    t = n * per
    off = case.offsets
    x, w, a, b, dy = case.x, case.weight, case.lora_a, case.lora_b, case.dy
    y = F.linear(x, w)
    s_buf = lora_forward(x, a, b, case.scales, case.ranks, off, y)
    dx = dy @ w
    ms = {
        "fwd GEMM (cuBLAS)": do_bench(lambda: F.linear(x, w), return_mode="median"),
        "fwd kernel: shrink+expand (ours)": do_bench(lambda: lora_forward(x, a, b, case.scales, case.ranks, off, y),
                                         return_mode="median"),
        "dX GEMM (cuBLAS)": do_bench(lambda: dy @ w, return_mode="median"),
        "bwd kernel: dS+dB, dX+dA (ours)": do_bench(lambda: lora_backward(x, dy, s_buf, a, b, case.scales, case.ranks, off, dx,
                                                              True, True), return_mode="median"),
        "fwd+bwd (a) eager": time_fwd_bwd(floor_op, case, 60),
        "fwd+bwd (d) eager": time_fwd_bwd(triton_op, case, 60),
    }
    byts = {  # fewest bytes each LoRA stage must move (bf16 activations; weights and S are small)
        "fwd kernel: shrink+expand (ours)": 2 * t * d_in + 4 * t * d_out,
        "bwd kernel: dS+dB, dX+dA (ours)": 2 * t * d_out + 2 * t * d_in + 4 * t * d_in,
    }
    out = [f"stage breakdown (CUDA-graph replay, GPU time only) at {d_in}x{d_out}, N={n}, {per} tok, r={r}:", "",
           "| stage | ms | bytes floor ms at measured bandwidth |", "|---|---|---|"]
    for k, v in ms.items():
        fl = f"{byts[k] / gbs / 1e6:.3f}" if k in byts else "-"
        out.append(f"| {k} | {v:.3f} | {fl} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only d=4096 cases")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(int(time.time()))
    dev = torch.cuda.get_device_name()
    import triton

    gbs = bandwidth_gbs()
    print(f"measured copy bandwidth (read+write): {gbs:.0f} GB/s", flush=True)
    stages = breakdown(4096, 4096, 8, 1024, 16, gbs)  # first, so a cut-off run still reports it
    print("\n".join(stages), flush=True)
    lines = [f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}; bf16; fwd+bwd median ms",
             f"measured copy bandwidth (read+write): {gbs:.0f} GB/s", "",
             "| d_in x d_out | N | tok/adapter | ranks | (a) floor | (b) loop | (c) bmm | (d) ours | d/a | b/d | c/d"
             " | (a) graph | (d) graph | d/a graph | max rel err b/c/d |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    shapes = SHAPES[:1] if args.quick else SHAPES
    results = {}
    for d_in, d_out in shapes:
        for n in (8, 32):
            for per in (256, 1024):
                for rn in RANKS:
                    t, e = bench_case(d_in, d_out, n, per, rn)
                    results[(d_in, d_out, n, per, rn)] = t
                    c = t.get("c", float("nan"))
                    lines.append(
                        f"| {d_in}x{d_out} | {n} | {per} | {rn} | {t['a']:.3f} | {t['b']:.3f} | {c:.3f} | {t['d']:.3f}"
                        f" | {t['d'] / t['a']:.2f} | {t['b'] / t['d']:.2f} | {c / t['d']:.2f}"
                        f" | {t['ag']:.3f} | {t['dg']:.3f} | {t['dg'] / t['ag']:.2f}"
                        f" | {e['b']:.1e}/{e.get('c', float('nan')):.1e}/{e['d']:.1e} |")
                    print(lines[-1], flush=True)
    # one ragged step (counts drawn from 0..2048, one adapter empty): (c) has no bmm form here
    counts = [int(v) for v in torch.randint(0, 2049, (8,))]
    counts[3] = 0
    t, e = bench_case(4096, 4096, 8, 0, "mixed", counts=counts)
    lines.append(f"| 4096x4096 ragged {counts} | 8 | ragged | mixed | {t['a']:.3f} | {t['b']:.3f} | n/a | {t['d']:.3f}"
                 f" | {t['d'] / t['a']:.2f} | {t['b'] / t['d']:.2f} | n/a | {t['ag']:.3f} | {t['dg']:.3f}"
                 f" | {t['dg'] / t['ag']:.2f} | {e['b']:.1e}/-/{e['d']:.1e} |")
    key = results.get((4096, 4096, 8, 1024, "r16"))
    lines.append("")
    if key:
        lines.append(f"target 1: (d)/(a) <= 1.15 at 4096, N=8, 1024 tok, r16: eager {key['d'] / key['a']:.3f},"
                     f" graph {key['dg'] / key['ag']:.3f}")
    t3 = [results[k]["b"] / results[k]["d"] for k in results if k[2] == 32 and k[3] == 256]
    lines.append(f"target 2: (b)/(d) >= 3 at N=32, 256 tok: min {min(t3):.2f}, max {max(t3):.2f}")
    t4 = [results[k]["c"] / results[k]["d"] for k in results if k[4] == "mixed"]
    lines.append(f"target 3: (c)/(d) >= 1.25 with mixed ranks: min {min(t4):.2f}, max {max(t4):.2f}")
    lines += [""] + stages
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
