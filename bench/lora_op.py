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

The paths and the timer are in lora_op_paths.py, the kernels timed apart in lora_op_stages.py, the
table rows and targets in lora_op_table.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lora_op_paths as paths  # noqa: E402
from lora_op_stages import breakdown, engine_stages, variants  # noqa: E402
from lora_op_table import HEADER, row_line, targets  # noqa: E402

from kernels.testing import oracle_fp64, rel_errors, run_op  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]


def check() -> int:
    """--check: every path vs the fp64 oracle on small shapes (CPU under TRITON_INTERPRET=1, or
    CUDA), then the table, target and breakdown code on tiny shapes with a stand-in timer (one
    call per measurement), so a device run cannot die on a typo after the first rows."""
    if not torch.cuda.is_available():
        paths.DEVICE, paths.DTYPE = "cpu", torch.float32
    tol = 1.5e-2 if paths.DTYPE == torch.bfloat16 else 3e-6
    bad = 0
    for d_in, d_out, n, per, rn in [(48, 40, 4, 16, "r16"), (40, 56, 3, 20, "mixed")]:
        counts = [per] * n
        case, ranks = paths.build_case(d_in, d_out, n, counts, rn)
        want = oracle_fp64(case, device=paths.DEVICE)
        for k, op in paths.make_ops(case, n, counts, ranks, loop=True).items():
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
    for rn in paths.RANKS:
        t, e = paths.bench_case(32, 48, 2, 16, rn, loop=True)
        bad += max(e.values()) > tol
        results[(4096, 4096, 8, 1024, rn)] = t
        lines.append(row_line("dry 32x48", 2, 16, rn, t, e, results.get((4096, 4096, 8, 1024, "r16"))
                              if rn != "r16" else None))
    t, e = paths.bench_case(32, 48, 3, 0, "mixed", counts=[5, 0, 19])
    lines.append(row_line("dry ragged", 3, "ragged", "mixed", t, e))
    lines += [""] + targets(results) + [""] + breakdown(32, 48, 2, 16, 16, 1000.0)
    lines += [""] + variants(1e9, cases=[(32, 48, 2, 16, "r16"), (40, 56, 3, 20, "mixed")], gemm_case=(32, 48, 2, 16, 16))
    print("\n".join(lines), flush=True)
    bad += sum("failed" in ln for ln in lines)
    return 1 if bad else 0


def main() -> None:
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
    paths.E3 = args.e3
    paths.ONLY[:] = [v for v in args.only.split(",") if v]
    HEADER[0] = HEADER[0].replace("(e3) fused TMA", f"(e3) fused {paths.E3}")
    if args.check:
        raise SystemExit(check())
    start = time.time()
    torch.manual_seed(int(time.time()))
    dev = torch.cuda.get_device_name()
    import triton

    from kernels.form_choice import FormTable

    gbs = paths.bandwidth_gbs()
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
                for rn in paths.RANKS:
                    if time.time() - start > args.budget_s:
                        cut = True
                        break
                    t, e = paths.bench_case(d_in, d_out, n, per, rn, loop=args.loop)
                    results[(d_in, d_out, n, per, rn)] = t
                    r_max = max(paths.RANKS[rn])
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
        t, e = paths.bench_case(4096, 4096, 8, 0, "mixed", counts=counts, loop=args.loop)
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
