"""Benchmark of one multi-LoRA linear layer, forward + backward, bf16, on one CUDA device.

(a) floor: the frozen linear alone (cuBLAS GEMM and its input gradient); (b) per-adapter torch
loop (with --loop); (c) best plain-torch batched path (bmm, equal token counts only);
(d) compose: cuBLAS + the grouped Triton LoRA passes (kernels.triton_lora); (e) fused: Triton
GEMMs with the LoRA terms in their epilogues (kernels.fused_lora), one-pass dS+dB; (e2) the fused
form with dB from its own pass (no atomics per row tile); (e3) the fused form with another GEMM
variant (--e3, default "tma": TMA main loops; kernels.fused_lora.GEMM_VARIANTS). A path that fails
prints why and leaves its cells "nan". Mixed ranks cycle 16/32/64; "e/e16"
compares each row with the same shape at uniform rank 16. One run prints one table, a stage
breakdown of both Triton forms, and the issue-20 target lines.

Usage (GPU):  python3 bench/lora_op.py [--quick] [--shapes 4096x4096,...] [--out FILE.md]
                                     [--timings kernels/lora_forms.json]
              --timings writes (or extends) the compose/fused timings that form="auto" chooses from
              (CUDA-graph GPU time: what an engine step that keeps the GPU busy sees).
              --variants: instead, every fused GEMM variant side by side (op fwd+bwd, eager and
              CUDA graph, vs the floor, correctness in the same run) and each variant's GEMMs timed
              apart at 4096x4096, 8 x 1024 tokens, r16.
Usage (CPU):  TRITON_INTERPRET=1 python3 bench/lora_op.py --check
              correctness of every path on small fp32 shapes vs the fp64 oracle, no timing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import multilora_linear  # noqa: E402
from kernels.testing import make_case, oracle_fp64, rel_errors, run_op  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
RANKS = {"r16": [16], "mixed": [16, 32, 64]}
KEY = (4096, 4096, 8, 1024)
DEVICE, DTYPE = "cuda", torch.bfloat16  # --check switches to the CPU (interpreter) and fp32


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


def stage_inputs(d_in: int, d_out: int, n: int, per: int, r: int | list[int]) -> SimpleNamespace:
    """Inputs of the GEMMs and LoRA passes timed apart: n adapters of `per` tokens at rank r (a
    list: cycled over the adapters), the forward's S, the fused kernels' contexts with the
    adapters (c) and without (c0: the bare Triton GEMM), and the rank-major strides of A and B."""
    from kernels.fused_lora import _Ctx, _stacked_a, _stacked_b
    from kernels.triton_lora import lora_forward

    ranks = [r[i % len(r)] for i in range(n)] if isinstance(r, list) else [r] * n
    r = max(ranks)
    case = make_case([per] * n, ranks, d_in, d_out, dtype=DTYPE, device=DEVICE, bias=False, nan_padding=False)
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


def _graph_ms(fn) -> float:
    from triton.testing import do_bench_cudagraph

    fn()  # compile + autotune outside the capture
    return do_bench_cudagraph(fn, rep=60, return_mode="median")


def breakdown(d_in: int, d_out: int, n: int, per: int, r: int, gbs: float) -> list[str]:
    """Each stage of (d) and (e) timed apart (CUDA-graph replay); GEMMs with their TFLOP/s, LoRA
    passes with the fewest bytes they must move at the measured bandwidth."""
    from kernels.fused_lora import (
        _gemm_launch,
        _shrink_launch,
        _stacked_a,
        _stacked_b,
        _wgrad_launch,
    )
    from kernels.triton_lora import lora_backward, lora_forward

    si = stage_inputs(d_in, d_out, n, per, r)
    case, off, x, w, a, b, dy, y, s_buf = si.case, si.off, si.x, si.w, si.a, si.b, si.dy, si.y, si.s_buf
    c, c0, sa, sb = si.c, si.c0, si.sa, si.sb
    t = n * per
    dx = dy @ w
    ds = torch.empty_like(s_buf)
    ga = torch.zeros(a.shape, dtype=torch.float32, device=DEVICE)
    gb = torch.zeros(b.shape, dtype=torch.float32, device=DEVICE)
    flops = 2 * t * d_in * d_out
    stages = [  # (name, fn, kind) kind: "gemm" (TFLOP/s) or bytes floor of a LoRA pass
        ("fwd GEMM, cuBLAS", lambda: F.linear(x, w), "gemm"),
        ("fwd GEMM, Triton, no LoRA", lambda: _gemm_launch(c0, x, w.t(), None, s_buf, b, sb, off, False, x.dtype),
         "gemm"),
        ("fwd GEMM, Triton + expand epilogue (e)", lambda: _gemm_launch(c, x, w.t(), None, s_buf, b, sb, off, False,
                                                                          x.dtype), "gemm"),
        ("dX GEMM, cuBLAS", lambda: dy @ w, "gemm"),
        ("dX GEMM, Triton, no LoRA", lambda: _gemm_launch(c0, dy, w, None, ds, a, sa, off, False, dy.dtype), "gemm"),
        ("fwd GEMM, Triton TMA, no LoRA", lambda: _gemm_launch(c0, x, w.t(), None, s_buf, b, sb, off, False, x.dtype,
                                                               gemm="tma"), "gemm"),
        ("dX GEMM, Triton TMA, no LoRA", lambda: _gemm_launch(c0, dy, w, None, ds, a, sa, off, False, dy.dtype,
                                                              gemm="tma"), "gemm"),
        ("dX GEMM, Triton + dS A epilogue (e)", lambda: _gemm_launch(c, dy, w, None, ds, a, sa, off, False, dy.dtype),
         "gemm"),
        ("(d) fwd LoRA pass: shrink+expand", lambda: lora_forward(x, a, b, case.scales, case.ranks, off, y),
         2 * t * d_in + 4 * t * d_out),
        ("(d) bwd LoRA pass: dS+dB, dX+dA", lambda: lora_backward(x, dy, s_buf, a, b, case.scales, case.ranks, off,
                                                                  dx, True, True), 2 * t * d_out + 6 * t * d_in),
        ("(e) fwd shrink S = X A^T", lambda: _shrink_launch(c, x, a, sa, off, s_buf, False), 2 * t * d_in),
        ("(e) bwd dS = dY B, one pass with dB", lambda: _shrink_launch(c, dy, b, sb, off, ds, False,
                                                                       wgrad=(s_buf, gb, off)), 2 * t * d_out),
        ("(e2) bwd dS = dY B alone", lambda: _shrink_launch(c, dy, b, sb, off, ds, False), 2 * t * d_out),
        ("(e2) bwd dB = s S^T dY", lambda: _wgrad_launch(c, s_buf, dy, gb, _stacked_b(gb), off, False), 2 * t * d_out),
        ("(e) bwd dA = s dS^T X", lambda: _wgrad_launch(c, ds, x, ga, _stacked_a(ga), off, False), 2 * t * d_in),
    ]
    out = [f"stage breakdown (CUDA-graph replay, GPU time only) at {d_in}x{d_out}, N={n}, {per} tok, r={r}:", "",
           "| stage | ms | TFLOP/s (GEMM) or bytes-floor ms (LoRA pass) |", "|---|---|---|"]
    for name, fn, kind in stages:
        try:
            ms = _graph_ms(fn)
        except Exception as exc:  # one failing stage must not hide the others
            out.append(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:120]} | - |")
            continue
        extra = f"{flops / ms / 1e9:.0f} TFLOP/s" if kind == "gemm" else f"floor {kind / gbs / 1e6:.3f}"
        out.append(f"| {name} | {ms:.3f} | {extra} |")
    return out


def _engine_kernels(si: SimpleNamespace) -> list:
    """engine_stages' kernels on one shape's inputs, in its column order, on the engine's layout:
    every adapter's A [r, d_in] and B^T [r, d_out] blocks in one arena at 16-element-aligned
    offsets, gradients added into a gradient arena."""
    from kernels.fused_lora import _arena_rank_major, _gemm_launch, _shrink_launch, _wgrad_launch

    x, w, a, b, dy, s_buf, c = si.x, si.w, si.a, si.b, si.dy, si.s_buf, si.c
    d_in, d_out = x.shape[1], w.shape[0]
    pieces, a_off, b_off, pos = [], [], [], 0
    for i, r in enumerate(si.case.ranks.tolist()):
        for block, offs in ((a[i, :, :r].t(), a_off), (b[i, :r, :], b_off)):
            offs.append(pos)
            pieces.append(block.reshape(-1))
            pos += block.numel()
            pad = -pos % 16
            pieces.append(torch.zeros(pad, dtype=a.dtype, device=DEVICE))
            pos += pad
    arena = torch.cat(pieces)
    grad = torch.zeros(arena.numel(), dtype=torch.float32, device=DEVICE)
    ao, bo = (torch.tensor(o, dtype=torch.int64, device=DEVICE) for o in (a_off, b_off))
    sa, sb = _arena_rank_major(d_in), _arena_rank_major(d_out)
    ds = torch.empty_like(s_buf)
    # the kernels' arena mode as the engine runs them: 16 (offsets 16-element aligned, vouched for by
    # the engine) unless $LORAPLEX_BENCH_ARENA says 1 (offsets of unknown alignment)
    mode = int(os.environ.get("LORAPLEX_BENCH_ARENA", "16"))
    assert all(o % 16 == 0 for o in a_off + b_off)
    return [lambda: F.linear(x, w),
            lambda: _gemm_launch(c, x, w.t(), None, s_buf, arena, sb, bo, mode, x.dtype),
            lambda: _shrink_launch(c, x, arena, sa, ao, s_buf, mode),
            lambda: dy @ w,
            lambda: _gemm_launch(c, dy, w, None, ds, arena, sa, ao, mode, dy.dtype),
            lambda: _shrink_launch(c, dy, arena, sb, bo, ds, mode, wgrad=(s_buf, grad, bo)),
            lambda: _shrink_launch(c, dy, arena, sb, bo, ds, mode),
            lambda: _wgrad_launch(c, s_buf, dy, grad, sb, bo, mode),
            lambda: _wgrad_launch(c, ds, x, grad, sa, ao, mode)]


# Llama-3.1-8B's adapted projections (d_in, d_out, per layer), as bench/engine_step.py runs them
ENGINE_SHAPES = [(4096, 4096, 2), (4096, 1024, 2), (4096, 14336, 2), (14336, 4096, 1)]


def engine_stages(gbs: float, layers: int = 32, n: int = 8, per: int = 1024) -> list[str]:
    """Every kernel of one fused operator call apart (CUDA-graph replay) at the engine step's shapes
    and rank mix (8 jobs x 1024 tokens, ranks 16/32/64 cycled), next to cuBLAS, and summed as the
    engine step runs them: forward kernels twice (gradient checkpointing recomputes the forward),
    backward ones once, per layer and projection. Compare with `engine_step.py --profile`."""
    ranks = [16, 32, 64]
    names = ["fwd GEMM cuBLAS", "fwd GEMM fused + expand", "fwd shrink S", "dX GEMM cuBLAS",
             "dX GEMM fused + dS A", "dS + dB one pass", "dS alone", "dB pass", "dA pass"]
    fwd = {0, 1, 2}  # run twice per step
    out = [f"kernels of one fused call apart (CUDA graph, ms; arena layout) at the engine step's shapes: {n} adapters x {per} "
           f"tokens, ranks {'/'.join(map(str, ranks))} cycled; floor = bytes the pass must move at {gbs:.0f} GB/s", "",
           "| d_in x d_out | " + " | ".join(names) + " | LoRA floor (fwd x2 + bwd) |", "|" + "---|" * (len(names) + 2)]
    step = dict.fromkeys(names, 0.0)
    floor_step = 0.0
    for d_in, d_out, count in ENGINE_SHAPES:
        t = n * per
        fns = _engine_kernels(stage_inputs(d_in, d_out, n, per, ranks))
        cells = []
        for name, fn in zip(names, fns, strict=True):
            try:
                ms = _graph_ms(fn)
            except Exception as exc:  # one failing kernel must not hide the others
                print(f"{name} at {d_in}x{d_out} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                ms = float("nan")
            cells.append(ms)
            step[name] += ms * count * layers * (2 if names.index(name) in fwd else 1)
        # fewest bytes of the one-pass LoRA passes: X twice (forward, recompute) + X for dA + dY once
        floor_ms = (3 * 2 * t * d_in + 2 * t * d_out) / gbs / 1e6
        floor_step += floor_ms * count * layers
        out.append(f"| {d_in}x{d_out} (x{count}) | " + " | ".join(f"{v:.3f}" for v in cells) + f" | {floor_ms:.3f} |")
        print(out[-1], flush=True)
    out.append(f"| per step ({layers} layers, forward kernels x2) | "
               + " | ".join(f"{step[k]:.1f}" for k in names) + f" | {floor_step:.1f} |")
    base = step["fwd GEMM cuBLAS"] + step["dX GEMM cuBLAS"]
    fused = step["fwd GEMM fused + expand"] + step["dX GEMM fused + dS A"]
    one = step["fwd shrink S"] + step["dS + dB one pass"] + step["dA pass"]
    two = step["fwd shrink S"] + step["dS alone"] + step["dB pass"] + step["dA pass"]
    out += ["", f"Per step: base GEMMs cuBLAS {base:.1f} ms, fused GEMMs {fused:.1f} ms ({fused / base:.3f}x); "
            f"LoRA passes one-pass dB {one:.1f} ms, two-pass dB {two:.1f} ms, bytes floor {floor_step:.1f} ms "
            "(the first layer's dX GEMMs, which the engine skips, are counted)."]
    return out


def _ratio(p: float, q: float) -> str:
    return f"{p / q:.2f}" if q and math.isfinite(p) and math.isfinite(q) else "n/a"


def row_line(label, n, per, rn, t, e, r16=None) -> str:
    c = t.get("c", float("nan"))
    b = t.get("b", float("nan"))
    e16 = _ratio(t["e"], r16["e"]) if r16 else "-"
    errs = "/".join(f"{e[k]:.1e}" if k in e else "-" for k in ("b", "c", "d", "e", "e2", "e3"))
    return (f"| {label} | {n} | {per} | {rn} | {t['a']:.3f} | {b:.3f} | {c:.3f} | {t['d']:.3f} | {t['e']:.3f}"
            f" | {t['e2']:.3f} | {t['e3']:.3f} | {_ratio(t['d'], t['a'])} | {_ratio(t['e'], t['a'])} | {_ratio(c, t['e'])}"
            f" | {e16} | {t['ag']:.3f} | {t['dg']:.3f} | {t['eg']:.3f} | {_ratio(t['dg'], t['ag'])}"
            f" | {_ratio(t['eg'], t['ag'])} | {errs} |")


HEADER = ["| d_in x d_out | N | tok/adapter | ranks | (a) floor | (b) loop | (c) bmm | (d) compose | (e) fused"
          " | (e2) fused 2-pass dB | (e3) fused TMA | d/a | e/a | c/e | e/e16 | (a) graph | (d) graph | (e) graph"
          " | d/a graph | e/a graph | max rel err b/c/d/e/e2/e3 |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def targets(results: dict) -> list[str]:
    """The issue-20 targets from the table's rows (eager and graph ratios side by side)."""
    out = []
    key = results.get(KEY + ("r16",))
    if key:
        out.append(f"target: fused (e)/(a) <= 1.15 at 4096, N=8, 1024 tok, r16: eager {key['e'] / key['a']:.3f},"
                   f" graph {key['eg'] / key['ag']:.3f} (compose (d)/(a): {key['d'] / key['a']:.3f},"
                   f" graph {key['dg'] / key['ag']:.3f})")
    ea = [t["e"] / t["a"] for t in results.values()]
    eag = [t["eg"] / t["ag"] for t in results.values() if math.isfinite(t["eg"])]
    if ea:
        out.append(f"target: (e)/(a) <= 1.2 across the table: max eager {max(ea):.2f}"
                   + (f", max graph {max(eag):.2f}" if eag else ""))
    mix = [(k, t["e"] / results[k[:4] + ("r16",)]["e"]) for k, t in results.items()
           if k[4] == "mixed" and k[:4] + ("r16",) in results]
    if mix:
        out.append(f"target: mixed within 1.1x of uniform r16 (e mixed / e r16): max {max(v for _, v in mix):.2f},"
                   f" min {min(v for _, v in mix):.2f}")
    cm = [t["c"] / t["e"] for k, t in results.items() if k[4] == "mixed" and "c" in t]
    if cm:
        out.append(f"target: (c)/(e) >= 1.25 with mixed ranks: min {min(cm):.2f}, max {max(cm):.2f}")
    best = [min(t["d"], t["e"]) / t["a"] for t in results.values()]
    if best:
        out.append(f"per-shape choice (faster of d and e, what form='auto' picks): max ratio to (a) {max(best):.2f}")
    return out


def check() -> int:
    """--check: every path vs the fp64 oracle on small shapes (CPU under TRITON_INTERPRET=1, or
    CUDA), then the table, target and breakdown code on tiny shapes with a stand-in timer (one
    call per measurement), so a device run cannot die on a typo after the first rows."""
    global DEVICE, DTYPE
    if not torch.cuda.is_available():
        DEVICE, DTYPE = "cpu", torch.float32
    tol = 1.5e-2 if DTYPE == torch.bfloat16 else 3e-6
    bad = 0
    for d_in, d_out, n, per, rn in [(48, 40, 4, 16, "r16"), (40, 56, 3, 20, "mixed")]:
        counts = [per] * n
        case, ranks = build_case(d_in, d_out, n, counts, rn)
        want = oracle_fp64(case, device=DEVICE)
        for k, op in make_ops(case, n, counts, ranks, loop=True).items():
            if k == "a":
                continue
            err = max(rel_errors(run_op(case, op), want).values())
            ok = err <= tol
            bad += not ok
            print(f"{d_in}x{d_out} N={n} {per} tok {rn} ({k}): max rel err {err:.1e} {'ok' if ok else 'FAIL'}",
                  flush=True)
    import triton.testing as tt

    def once(fn, *_a, **_k) -> float:
        fn()
        return 1.0 + 0.01 * len(results)
    tt.do_bench, tt.do_bench_cudagraph = once, once
    results: dict = {}
    lines = list(HEADER)
    for rn in RANKS:
        t, e = bench_case(32, 48, 2, 16, rn, loop=True)
        bad += max(e.values()) > tol
        results[(4096, 4096, 8, 1024, rn)] = t
        lines.append(row_line("dry 32x48", 2, 16, rn, t, e, results.get((4096, 4096, 8, 1024, "r16"))
                              if rn != "r16" else None))
    t, e = bench_case(32, 48, 3, 0, "mixed", counts=[5, 0, 19])
    lines.append(row_line("dry ragged", 3, "ragged", "mixed", t, e))
    lines += [""] + targets(results) + [""] + breakdown(32, 48, 2, 16, 16, 1000.0)
    lines += [""] + variants(1e9, cases=[(32, 48, 2, 16, "r16"), (40, 56, 3, 20, "mixed")], gemm_case=(32, 48, 2, 16, 16))
    print("\n".join(lines), flush=True)
    bad += sum("failed" in ln for ln in lines)
    return 1 if bad else 0


VARIANT_CASES = [(4096, 4096, 8, 1024, "r16"), (4096, 4096, 8, 1024, "mixed"), (4096, 4096, 32, 256, "mixed"),
                 (4096, 14336, 8, 1024, "r16")]


def variants(budget_s: float, cases=VARIANT_CASES, gemm_case=(4096, 4096, 8, 1024, 16)) -> list[str]:
    """Every fused GEMM variant side by side: the whole op (fwd+bwd) at a few shapes, eager and as
    a CUDA graph, against the floor (a) and compose (d) of the same run; then each variant's two
    GEMMs (with their LoRA epilogues) and the bare main loops timed apart at the key shape."""
    from kernels.fused_lora import GEMM_VARIANTS, _gemm_launch

    start = time.time()
    vs = [v for v in GEMM_VARIANTS if v in ONLY] if ONLY else list(GEMM_VARIANTS)
    out = ["fused GEMM variants, fwd+bwd median ms (eager | CUDA graph); ratio to (a) of the same mode;"
           " max rel err vs the fp64 oracle", "",
           "| shape | N x tok | ranks | (a) | (d) compose | " + " | ".join(vs) + " | (a) graph | (d) graph | "
           + " | ".join(v + " graph" for v in vs) + " | best eager / (a) | best graph / (a) | max rel err |",
           "|" + "---|" * (10 + 2 * len(vs))]
    for d_in, d_out, n, per, rn in cases:
        if time.time() - start > budget_s:
            out.append(f"(cut at the {budget_s:.0f} s budget)")
            break
        counts = [per] * n
        case, _ranks = build_case(d_in, d_out, n, counts, rn)
        ops = {"a": floor_op, "d": compose_op, **{v: fused_variant_op(v) for v in vs}}
        errs = oracle_check(case, ops, f"{d_in}x{d_out} N={n}")
        err = max((e for k, e in errs.items() if k in ops), default=0.0)
        te = {k: time_fwd_bwd(op, case, 60) for k, op in ops.items()}
        tg = {k: time_fwd_bwd(op, case, 60, graph=True) for k, op in ops.items()}
        cell = lambda t, k: f"{t[k]:.3f}" if k in t else "failed"  # noqa: E731
        best_e = min((te[v] for v in vs if v in te), default=float("nan"))
        best_g = min((tg[v] for v in vs if v in tg and math.isfinite(tg[v])), default=float("nan"))
        out.append(f"| {d_in}x{d_out} | {n} x {per} | {rn} | {te['a']:.3f} | {te['d']:.3f} | "
                   + " | ".join(cell(te, v) for v in vs) + f" | {tg['a']:.3f} | {tg['d']:.3f} | "
                   + " | ".join(cell(tg, v) for v in vs)
                   + f" | {_ratio(best_e, te['a'])} | {_ratio(best_g, tg['a'])} | {err:.1e} |")
        print(out[-1], flush=True)
    # host time per eager fwd+bwd (launches, autograd, allocation; no sync inside the loop) against
    # the same calls' wall time to a sync: host-bound where the two meet
    d_in, d_out, n, per, rn = cases[0]
    case, _ranks = build_case(d_in, d_out, n, [per] * n, rn)
    out += ["", f"host time per eager fwd+bwd at {d_in}x{d_out}, {n} x {per} tok, {rn} (30 calls, ms per call):", "",
            "| path | host (launch) ms | wall to sync ms |", "|---|---|---|"]
    for k, op in {"a": floor_op, "d": compose_op, **{v: fused_variant_op(v) for v in vs}}.items():
        x = case.x.detach().clone().requires_grad_()
        a = case.lora_a.detach().clone().requires_grad_()
        b = case.lora_b.detach().clone().requires_grad_()

        def step(op=op, x=x, a=a, b=b):
            op(x, case.weight, case.bias, a, b, case.scales, case.ranks, case.offsets).backward(case.dy)
            x.grad = a.grad = b.grad = None
        try:
            sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
            for _ in range(3):
                step()
            sync()
            t0 = time.perf_counter()
            for _ in range(30):
                step()
            host = (time.perf_counter() - t0) / 30
            sync()
            wall = (time.perf_counter() - t0) / 30
            out.append(f"| {k} | {host * 1e3:.3f} | {wall * 1e3:.3f} |")
        except Exception as exc:
            out.append(f"| {k} | failed: {type(exc).__name__} | - |")
        print(out[-1], flush=True)
    # each variant's GEMMs apart (CUDA graph, GPU time only)
    d_in, d_out, n, per, r = gemm_case
    si = stage_inputs(d_in, d_out, n, per, r)
    x, w, a, b, dy, off, s_buf = si.x, si.w, si.a, si.b, si.dy, si.off, si.s_buf
    c, c0, sa, sb = si.c, si.c0, si.sa, si.sb
    ds = torch.randn_like(s_buf)
    flops = 2 * n * per * d_in * d_out
    out += ["", f"each variant's GEMMs apart (CUDA graph) at {d_in}x{d_out}, N={n}, {per} tok, r={r}:", "",
            "| GEMM | " + " | ".join(["cuBLAS"] + vs) + " |", "|" + "---|" * (2 + len(vs))]
    rows = [("fwd, no LoRA", lambda v: (lambda: _gemm_launch(c0, x, w.t(), None, s_buf, b, sb, off, False, x.dtype,
                                                             gemm=v)), lambda: F.linear(x, w)),
            ("fwd + expand epilogue", lambda v: (lambda: _gemm_launch(c, x, w.t(), None, s_buf, b, sb, off, False,
                                                                      x.dtype, gemm=v)), lambda: F.linear(x, w)),
            ("dX, no LoRA", lambda v: (lambda: _gemm_launch(c0, dy, w, None, ds, a, sa, off, False, dy.dtype,
                                                            gemm=v)), lambda: dy @ w),
            ("dX + dS A epilogue", lambda v: (lambda: _gemm_launch(c, dy, w, None, ds, a, sa, off, False, dy.dtype,
                                                                   gemm=v)), lambda: dy @ w)]
    for name, make, ref in rows:
        cells = []
        for fn in [ref] + [make(v) for v in vs]:
            try:
                ms = _graph_ms(fn)
                cells.append(f"{ms:.3f} ({flops / ms / 1e9:.0f})")
            except Exception as exc:
                cells.append(f"failed: {type(exc).__name__}")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
        print(out[-1], flush=True)
    out.append("(ms, and TFLOP/s of the base GEMM in parentheses)")
    return out


def main() -> None:
    global E3
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the first shape")
    ap.add_argument("--shapes", default=",".join(f"{a}x{b}" for a, b in SHAPES),
                    help="d_in x d_out list, e.g. 4096x1024 for k/v projections")
    ap.add_argument("--loop", action="store_true", help="also time (b), the per-adapter loop (slow)")
    ap.add_argument("--check", action="store_true", help="correctness only, small shapes (runs on CPU)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timings", default=None,
                    help="compose/fused timings for form='auto' (JSON; an existing file is extended)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop adding rows after this many seconds")
    ap.add_argument("--e3", default="tma", help="GEMM variant of column (e3) (kernels.fused_lora.GEMM_VARIANTS)")
    ap.add_argument("--variants", action="store_true", help="only the table of fused GEMM variants")
    ap.add_argument("--only", default="", help="--variants: comma-separated variants to time (default all)")
    ap.add_argument("--engine-stages", action="store_true",
                    help="only each fused kernel apart at the engine step's shapes, summed per step")
    args = ap.parse_args()
    E3 = args.e3
    ONLY[:] = [v for v in args.only.split(",") if v]
    HEADER[0] = HEADER[0].replace("(e3) fused TMA", f"(e3) fused {E3}")
    if args.check:
        raise SystemExit(check())
    start = time.time()
    torch.manual_seed(int(time.time()))
    dev = torch.cuda.get_device_name()
    import triton

    from kernels.form_choice import FormTable

    gbs = bandwidth_gbs()
    print(f"measured copy bandwidth (read+write): {gbs:.0f} GB/s", flush=True)
    if args.variants or args.engine_stages:
        import os

        tiles = os.environ.get("LORAPLEX_FUSED_RANK_TILES", "tuned")
        text = "\n".join([f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}; bf16; "
                          f"rank tiles {tiles}", ""]
                         + (engine_stages(gbs) if args.engine_stages else variants(args.budget_s)))
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return
    lines = [f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}; bf16; fwd+bwd median ms",
             f"measured copy bandwidth (read+write): {gbs:.0f} GB/s", ""] + HEADER
    print("\n".join(HEADER), flush=True)
    shapes = [tuple(int(v) for v in item.split("x")) for item in args.shapes.split(",")]
    shapes = shapes[:1] if args.quick else shapes
    results: dict = {}
    table = FormTable.load(args.timings) if args.timings and Path(args.timings).exists() else FormTable()
    cut = False
    for d_in, d_out in shapes:
        for n in (8, 32):
            for per in (256, 1024):
                for rn in RANKS:
                    if time.time() - start > args.budget_s:
                        cut = True
                        break
                    t, e = bench_case(d_in, d_out, n, per, rn, loop=args.loop)
                    results[(d_in, d_out, n, per, rn)] = t
                    r_max = max(RANKS[rn])
                    # GPU time (CUDA-graph replay): the engine keeps the GPU busy (idle ~2% of a step,
                    # engine_step.py --profile), so the eager columns' host time would bias the choice
                    table.add(dev, d_in, d_out, n * per, r_max, "compose", t["dg"])
                    table.add(dev, d_in, d_out, n * per, r_max, "fused", t["eg"])
                    lines.append(row_line(f"{d_in}x{d_out}", n, per, rn, t, e, results.get((d_in, d_out, n, per, "r16"))
                                          if rn != "r16" else None))
                    print(lines[-1], flush=True)
    if not cut and time.time() - start < args.budget_s:
        # one ragged step (counts drawn from 0..2048, one adapter empty): (c) has no bmm form here
        counts = [int(v) for v in torch.randint(0, 2049, (8,))]
        counts[3] = 0
        t, e = bench_case(4096, 4096, 8, 0, "mixed", counts=counts, loop=args.loop)
        lines.append(row_line(f"4096x4096 ragged {counts}", 8, "ragged", "mixed", t, e))
    lines += [""] + targets(results)
    if cut:
        lines.append(f"(cut at the {args.budget_s:.0f} s budget: rows after the last one were not run)")
    table_text = "\n".join(lines)
    print("\n" + table_text, flush=True)
    if args.out:
        Path(args.out).write_text(table_text + "\n")
    if args.timings:
        table.save(args.timings)
    if time.time() - start < args.budget_s + 30:
        stages = breakdown(4096, 4096, 8, 1024, 16, gbs)
        print("\n".join(stages), flush=True)
        if args.out:
            Path(args.out).write_text(table_text + "\n\n" + "\n".join(stages) + "\n")


if __name__ == "__main__":
    main()
