"""The persistent fused GEMM's short last round shared out by main-loop steps ($LORAPLEX_STREAM_K), side by side
with the forms it would replace, per GEMM of a 2-job step at the row counts its graphs replay.

A persistent program walks whole 128 x 256 tiles; a 1,536-row step's 14336-wide GEMM is 672 of them on 132 SMs,
5.09 rounds in 6, and "auto" sends a GEMM whose last round is under CUBLAS_BELOW full to the LoRA store pass +
cuBLAS instead. With stream-K the last round's tiles are split into equal runs of main-loop steps, one per program,
and a second pass (`kernels.fused_lora._streamk_fixup_jit`) adds each tile's partial sums and runs its epilogue.

For each layout (rank 16 and rank 64 adapters in a 1:4 row split, padded to the graph key's rows) and each
projection of the 8B shape (`ENGINE_SHAPES`), forward (x W^T + s P B) and dX (dY W + s dS A), CUDA-graph medians of:
cuBLAS alone (no LoRA term: the floor), "persist" (whole tiles), "persist + stream-K", "store + cuBLAS", "auto"
and "auto + stream-K", summed a step (each shape's count a layer x the layers). Every LoRA form's output on the
adapters' rows is checked against a float64 reference of the base GEMM plus the LoRA term in the same run.

    python3 bench/gemm_tail.py [--layouts 1536:1450,2048:1800] [--layers 32] [--out FILE.md] [--json FILE]
    TRITON_INTERPRET=1 python3 bench/gemm_tail.py --smoke   # the same code path on the CPU, small shapes, no timing
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lora_op_paths as paths  # noqa: E402
from lora_op_stages import ENGINE_SHAPES, arena_inputs  # noqa: E402

FORMS = ("cuBLAS alone", "persist", "persist + stream-K", "store + cuBLAS", "auto", "auto + stream-K")
TOL = 1e-2  # bf16 output against float64


def _layout(rows: int) -> tuple[list[int], list[int]]:
    """A 2-job step's adapters (rank 16 : rank 64 rows as 1 : 4, the host profile's step)."""
    small = rows // 5
    return [small, rows - small], [16, 64]


def _reference(a: torch.Tensor, b_kn: torch.Tensor, p: torch.Tensor, arena: torch.Tensor, woff: torch.Tensor,
               case) -> torch.Tensor:  # noqa: ANN001
    """float64: a @ b_kn + s_i p[rows_i, :r_i] W_i, W_i the adapter's [r_i, cols] block of the arena."""
    out = a.double() @ b_kn.double()
    cols = out.shape[1]
    bounds = case.offsets.tolist()
    for i, r in enumerate(case.ranks.tolist()):
        lo, hi = bounds[i], bounds[i + 1]
        block = arena[int(woff[i]): int(woff[i]) + r * cols].view(r, cols).double()
        out[lo:hi] += float(case.scales[i]) * (p[lo:hi, :r].double() @ block)
    return out


def _forms(si, ai, direction: str) -> tuple[dict, tuple]:  # noqa: ANN001
    """Each form's thunk for one GEMM, and (a, b_kn, p, woff) for its reference."""
    from kernels import fused_lora as fl

    c, x, w = si.c, si.x, si.w
    if direction == "fwd":
        a, b_kn, p, strides, woff = x, w.t(), si.s_buf, ai.sb, ai.bo
    else:
        a, b_kn, p, strides, woff = si.dy, w, ai.ds, ai.sa, ai.ao

    def fused(variant: str, stream_k: bool):  # noqa: ANN202
        def run() -> torch.Tensor:
            fl.STREAM_K = stream_k  # read at launch: a captured graph keeps the choice it was captured with
            return fl._gemm_launch(c, a, b_kn, None, p, ai.arena, strides, woff, ai.mode, a.dtype, gemm=variant)
        return run

    forms = {"cuBLAS alone": lambda: a @ b_kn, "persist": fused("persist", False),
             "persist + stream-K": fused("persist", True), "store + cuBLAS": fused("cublas", False),
             "auto": fused("auto", False), "auto + stream-K": fused("auto", True)}
    return forms, (a, b_kn, p, woff)


def _time_ms(fn, smoke: bool) -> float:  # noqa: ANN001
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return paths.graph_ms(fn)


def run(layouts: list[tuple[int, int]], layers: int, smoke: bool) -> dict:
    from kernels import fused_lora as fl

    shapes = [(40, 56, 2), (160, 48, 1)] if smoke else ENGINE_SHAPES
    keep = fl.STREAM_K
    rows_out, worst = [], 0.0
    try:
        for key_rows, live in layouts:
            counts, ranks = _layout(live)
            totals = dict.fromkeys(FORMS, 0.0)
            for d_in, d_out, count in shapes:
                torch.manual_seed(0)
                si = paths.stage_inputs(d_in, d_out, len(counts), 0, ranks, counts=counts, pad_rows=key_rows - live)
                ai = arena_inputs(si)
                ai.ds.copy_(torch.randn_like(ai.ds) * 0.05)  # dS: the dX GEMM's LoRA operand (never time on zeros)
                for direction in ("fwd", "dx"):
                    forms, (a, b_kn, p, woff) = _forms(si, ai, direction)
                    want = _reference(a, b_kn, p, ai.arena, woff, si.case)[:live]
                    errs = {}
                    for name, fn in forms.items():
                        if name != "cuBLAS alone":
                            got = fn()[:live].double()
                            errs[name] = ((got - want).norm() / want.norm()).item()
                        ms = _time_ms(fn, smoke)
                        totals[name] += ms * count * layers
                        rows_out.append({"key_rows": key_rows, "live": live, "shape": f"{d_in}x{d_out}",
                                         "dir": direction, "form": name, "ms": ms, "err": errs.get(name)})
                    worst = max(worst, *errs.values())
                    line = " | ".join(f"{r['form']} {r['ms'] * 1e3:.1f} us" for r in rows_out[-len(FORMS):])
                    print(f"{key_rows}:{live} {d_in}x{d_out} {direction}: {line}; worst error "
                          f"{max(errs.values()):.1e}", flush=True)
            rows_out.append({"key_rows": key_rows, "live": live, "step_ms": totals})
    finally:
        fl.STREAM_K = keep
    return {"rows": rows_out, "worst_error": worst, "ok": worst <= TOL}


def table(res: dict, layers: int) -> list[str]:
    steps = [r for r in res["rows"] if "step_ms" in r]
    out = [f"Per step ({layers} layers, forward + dX of every projection; ms, CUDA-graph medians):", "",
           "| graph key rows : live rows | " + " | ".join(FORMS) + " | stream-K saves (auto) |",
           "|---" * (len(FORMS) + 2) + "|"]
    for r in steps:
        t = r["step_ms"]
        out.append(f"| {r['key_rows']} : {r['live']} | " + " | ".join(f"{t[f]:.2f}" for f in FORMS)
                   + f" | {t['auto'] - t['auto + stream-K']:.2f} |")
    out += ["", f"Worst relative error of a LoRA form's output against float64: {res['worst_error']:.2e} "
            f"({'ok' if res['ok'] else 'FAILED'}: at most {TOL:g})", "", "Per GEMM (us):", "",
            "| key : live | shape | dir | " + " | ".join(FORMS) + " |", "|---" * (len(FORMS) + 3) + "|"]
    per = [r for r in res["rows"] if "form" in r]
    for i in range(0, len(per), len(FORMS)):
        g = per[i:i + len(FORMS)]
        out.append(f"| {g[0]['key_rows']} : {g[0]['live']} | {g[0]['shape']} | {g[0]['dir']} | "
                   + " | ".join(f"{x['ms'] * 1e3:.1f}" for x in g) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="1024:960,1536:1200,1536:1450,2048:1800,2048:2000",
                    help="KEY_ROWS:LIVE_ROWS,... (a graph key's rows and the adapters' rows in it)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1: small shapes, no timing")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    layouts = [tuple(int(v) for v in item.split(":")) for item in args.layouts.split(",")]
    if args.smoke:
        paths.DEVICE, paths.DTYPE = "cpu", torch.float32
        layouts = [(76, 70), (45, 45)]
    elif not torch.cuda.is_available():
        raise SystemExit("gemm_tail needs a GPU (or --smoke under TRITON_INTERPRET=1)")
    res = run(layouts, args.layers, args.smoke)
    device = "CPU (interpreter, smoke)" if args.smoke else torch.cuda.get_device_name()
    text = "\n".join([f"# The persistent GEMM's last round by main-loop steps ({device})", ""] + table(res, args.layers))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    if not res["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
