"""bench/lora_op.py's kernels timed apart: the stage breakdown of the compose and fused forms, every
fused kernel at the engine step's shapes summed per step (--engine-stages), and the fused GEMM
variants side by side (--variants)."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lora_op_paths as paths  # noqa: E402
from lora_op_table import ratio  # noqa: E402


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

    si = paths.stage_inputs(d_in, d_out, n, per, r)
    case, off, x, w, a, b, dy, y, s_buf = si.case, si.off, si.x, si.w, si.a, si.b, si.dy, si.y, si.s_buf
    c, c0, sa, sb = si.c, si.c0, si.sa, si.sb
    t = n * per
    dx = dy @ w
    ds = torch.empty_like(s_buf)
    ga = torch.zeros(a.shape, dtype=torch.float32, device=paths.DEVICE)
    gb = torch.zeros(b.shape, dtype=torch.float32, device=paths.DEVICE)
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
            ms = paths.graph_ms(fn)
        except Exception as exc:  # one failing stage must not hide the others
            out.append(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:120]} | - |")
            continue
        extra = f"{flops / ms / 1e9:.0f} TFLOP/s" if kind == "gemm" else f"floor {kind / gbs / 1e6:.3f}"
        out.append(f"| {name} | {ms:.3f} | {extra} |")
    return out


def arena_inputs(si: SimpleNamespace) -> SimpleNamespace:
    """The engine's layout of one shape's adapters (stage_inputs): every adapter's A [r, d_in] and
    B^T [r, d_out] blocks in one arena at 16-element-aligned offsets, a gradient arena, the offsets,
    the rank-major strides, a dS buffer and the kernels' arena mode."""
    from kernels.fused_lora import _arena_rank_major

    x, w, a, b, s_buf = si.x, si.w, si.a, si.b, si.s_buf
    d_in, d_out = x.shape[1], w.shape[0]
    pieces, a_off, b_off, pos = [], [], [], 0
    for i, r in enumerate(si.case.ranks.tolist()):
        for block, offs in ((a[i, :, :r].t(), a_off), (b[i, :r, :], b_off)):
            offs.append(pos)
            pieces.append(block.reshape(-1))
            pos += block.numel()
            pad = -pos % 16
            pieces.append(torch.zeros(pad, dtype=a.dtype, device=paths.DEVICE))
            pos += pad
    arena = torch.cat(pieces)
    grad = torch.zeros(arena.numel(), dtype=torch.float32, device=paths.DEVICE)
    ao, bo = (torch.tensor(o, dtype=torch.int64, device=paths.DEVICE) for o in (a_off, b_off))
    sa, sb = _arena_rank_major(d_in), _arena_rank_major(d_out)
    ds = torch.empty_like(s_buf)
    # the kernels' arena mode as the engine runs them: 16 (offsets 16-element aligned, vouched for by
    # the engine) unless $LORAPLEX_BENCH_ARENA says 1 (offsets of unknown alignment)
    mode = int(os.environ.get("LORAPLEX_BENCH_ARENA", "16"))
    assert all(o % 16 == 0 for o in a_off + b_off)
    return SimpleNamespace(arena=arena, grad=grad, ao=ao, bo=bo, sa=sa, sb=sb, ds=ds, mode=mode)


def _engine_kernels(si: SimpleNamespace) -> list:
    """engine_stages' kernels on one shape's inputs, in its column order, on the engine's layout
    (arena_inputs)."""
    from kernels.fused_lora import _gemm_launch, _shrink_launch, _wgrad_launch

    x, w, dy, s_buf, c = si.x, si.w, si.dy, si.s_buf, si.c
    ai = arena_inputs(si)
    arena, grad, ao, bo, sa, sb, ds, mode = ai.arena, ai.grad, ai.ao, ai.bo, ai.sa, ai.sb, ai.ds, ai.mode
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
        fns = _engine_kernels(paths.stage_inputs(d_in, d_out, n, per, ranks))
        cells = []
        for name, fn in zip(names, fns, strict=True):
            try:
                ms = paths.graph_ms(fn)
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



VARIANT_CASES = [(4096, 4096, 8, 1024, "r16"), (4096, 4096, 8, 1024, "mixed"), (4096, 4096, 32, 256, "mixed"),
                 (4096, 14336, 8, 1024, "r16")]


def variants(budget_s: float, cases=VARIANT_CASES, gemm_case=(4096, 4096, 8, 1024, 16)) -> list[str]:
    """Every fused GEMM variant side by side: the whole op (fwd+bwd) at a few shapes, eager and as
    a CUDA graph, against the floor (a) and compose (d) of the same run; then each variant's two
    GEMMs (with their LoRA epilogues) and the bare main loops timed apart at the key shape."""
    from kernels.fused_lora import GEMM_VARIANTS, _gemm_launch

    start = time.time()
    vs = [v for v in GEMM_VARIANTS if v in paths.ONLY] if paths.ONLY else list(GEMM_VARIANTS)
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
        case, _ranks = paths.build_case(d_in, d_out, n, counts, rn)
        ops = {"a": paths.floor_op, "d": paths.compose_op, **{v: paths.fused_variant_op(v) for v in vs}}
        errs = paths.oracle_check(case, ops, f"{d_in}x{d_out} N={n}")
        err = max((e for k, e in errs.items() if k in ops), default=0.0)
        te = {k: paths.time_fwd_bwd(op, case, 60) for k, op in ops.items()}
        tg = {k: paths.time_fwd_bwd(op, case, 60, graph=True) for k, op in ops.items()}
        cell = lambda t, k: f"{t[k]:.3f}" if k in t else "failed"  # noqa: E731
        best_e = min((te[v] for v in vs if v in te), default=float("nan"))
        best_g = min((tg[v] for v in vs if v in tg and math.isfinite(tg[v])), default=float("nan"))
        out.append(f"| {d_in}x{d_out} | {n} x {per} | {rn} | {te['a']:.3f} | {te['d']:.3f} | "
                   + " | ".join(cell(te, v) for v in vs) + f" | {tg['a']:.3f} | {tg['d']:.3f} | "
                   + " | ".join(cell(tg, v) for v in vs)
                   + f" | {ratio(best_e, te['a'])} | {ratio(best_g, tg['a'])} | {err:.1e} |")
        print(out[-1], flush=True)
    # host time per eager fwd+bwd (launches, autograd, allocation; no sync inside the loop) against
    # the same calls' wall time to a sync: host-bound where the two meet
    d_in, d_out, n, per, rn = cases[0]
    case, _ranks = paths.build_case(d_in, d_out, n, [per] * n, rn)
    out += ["", f"host time per eager fwd+bwd at {d_in}x{d_out}, {n} x {per} tok, {rn} (30 calls, ms per call):", "",
            "| path | host (launch) ms | wall to sync ms |", "|---|---|---|"]
    for k, op in {"a": paths.floor_op, "d": paths.compose_op, **{v: paths.fused_variant_op(v) for v in vs}}.items():
        x = case.x.detach().clone().requires_grad_()
        a = case.lora_a.detach().clone().requires_grad_()
        b = case.lora_b.detach().clone().requires_grad_()

        def step(op=op, x=x, a=a, b=b):
            op(x, case.weight, case.bias, a, b, case.scales, case.ranks, case.offsets).backward(case.dy)
            x.grad = a.grad = b.grad = None
        try:
            sync = torch.cuda.synchronize if paths.DEVICE == "cuda" else (lambda: None)
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
    si = paths.stage_inputs(d_in, d_out, n, per, r)
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
                ms = paths.graph_ms(fn)
                cells.append(f"{ms:.3f} ({flops / ms / 1e9:.0f})")
            except Exception as exc:
                cells.append(f"failed: {type(exc).__name__}")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
        print(out[-1], flush=True)
    out.append("(ms, and TFLOP/s of the base GEMM in parentheses)")
    return out
