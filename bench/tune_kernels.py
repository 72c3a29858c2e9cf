"""Offline tuning of the fused multi-LoRA kernels: writes kernels/configs/<GPU name>.json.

Runs the fused arena operator (forward + backward, bf16, aligned arena, the engine's form) on
every projection shape of the named model shapes, at token buckets 2^9..2^15 and largest ranks
8..64 (several adapters of mixed ranks and uneven token counts, like a packed step), with tuning
on (`kernels.tuned`): each new key is benchmarked over its candidates once, here, and the best
configuration goes into the device's table, which executors then read (no tuning in a task).

    python bench/tune_kernels.py [--shapes llama8b,qwen7b] [--variants persist] [--out FILE]
    python bench/tune_kernels.py --retune shrink,shrink_wgrad,wgrad   # those kernels' entries again
    # another GPU's table, its small-step entries tuned on this one (session 40, the H200), then reduced offline:
    LORAPLEX_KERNEL_CONFIGS=DIR python bench/tune_kernels.py --shapes llama8b --tokens 128,256,512,1024,2048 \
        --ranks 16,64 --fresh-below 2048 --max-configs 0 --cublas      # DIR holds the other GPU's table
    python bench/tune_kernels.py --reduce DIR/<GPU name>.json --out kernels/configs/<GPU name>.json \
        --max-configs 3 --fresh-below 2048
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["LORAPLEX_TUNE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels import fused_lora as fl  # noqa: E402
from kernels import tuned  # noqa: E402
from kernels.testing import make_case, run_arena  # noqa: E402

# (hidden, intermediate, kv width) of the model shapes the engine trains
SHAPES = {"llama8b": (4096, 14336, 1024), "qwen7b": (3584, 18944, 512), "qwen32b": (5120, 27648, 1024),
          "llama70b": (8192, 28672, 1024)}


def projections(hidden: int, inter: int, kv: int) -> list[tuple[int, int]]:
    """(d_in, d_out) of q, k/v, o, gate/up, down."""
    return sorted({(hidden, hidden), (hidden, kv), (hidden, inter), (inter, hidden)})


def case(tokens: int, r_max: int, d_in: int, d_out: int) -> object:
    """Eight adapters of mixed ranks (r_max among them) and uneven token counts summing to tokens."""
    ranks = [r_max, max(8, r_max // 2), max(8, r_max // 4), r_max, 8, 16 if r_max >= 16 else 8, r_max, 8]
    weights = [1, 2, 1, 4, 1, 2, 3, 2]
    counts = [tokens * w // sum(weights) for w in weights]
    counts[0] += tokens - sum(counts)
    return make_case(counts, ranks, d_in, d_out, dtype=torch.bfloat16, device="cuda", bias=False, seed=tokens + r_max)


def configs_above(rows: list[dict], fresh_below: int) -> list[dict]:
    """The distinct configurations of a kernel's entries of T_BUCKET > fresh_below (those a
    --fresh-below run leaves as they were)."""
    return [dict(c) for c in {tuned._ident(r["config"]) for r in rows
                              if r["key"].get("T_BUCKET", 0) > fresh_below}]


def reduce_scope(kept: list[dict], fresh_below: int) -> tuple:
    """`Table.reduce`'s (keep, scope) after --fresh-below: the entries left alone keep their
    configurations (already shipped), the retuned ones choose among those and --max-configs more."""
    if not fresh_below:
        return (), None
    return kept, lambda key: key.get("T_BUCKET", 0) <= fresh_below


def reduce_file(path: Path, out: Path, max_configs: int, fresh_below: int) -> int:
    """--reduce: a tuned table's kernels reduced offline (no GPU), each entry's time against its best
    per token bucket printed."""
    table = tuned.Table.read(path)
    for kernel, rows in sorted(table.kernels.items()):
        kept = configs_above(rows, fresh_below) if fresh_below else []
        chosen = table.reduce(kernel, max_configs, *reduce_scope(kept, fresh_below)) if max_configs else []
        loss: dict[int, list[float]] = {}
        for r in rows:
            ms = {tuned._ident(t["config"]): t["ms"] for t in r.get("timings", [])}
            mine = ms.get(tuned._ident(r["config"]))
            if mine:
                loss.setdefault(r["key"]["T_BUCKET"], [0.0, 0.0])
                loss[r["key"]["T_BUCKET"]][0] += mine
                loss[r["key"]["T_BUCKET"]][1] += min(ms.values())
        print(f"{kernel}: {len(kept)} kept + {len(chosen)} chosen {chosen}; time / best by T: "
              + " ".join(f"{t}:{a / b:.2f}" for t, (a, b) in sorted(loss.items())))
    table.write(out)  # with the tuning run's versions (Table.read kept them), not this process's
    return 0


def cublas_lines(table: tuned.Table, shapes: list[str], tokens: list[int]) -> None:
    """Per projection and token count: cuBLAS's forward GEMM and input-gradient GEMM (bf16, no LoRA,
    median of do_bench) beside the fastest tuned fused GEMM of each (the table's timings, LoRA epilogue
    included, R_MAX 16)."""
    import triton.testing as tt

    best = {}
    for row in table.kernels.get("gemm_lora_persist", []):
        k = row["key"]
        if row.get("timings") and k["R_MAX"] == 16:
            best[(k["T_BUCKET"], k["K"], k["NC"], k["B_NK"])] = min(t["ms"] for t in row["timings"])
    print("| d_in x d_out | T | cuBLAS fwd us | fused fwd us (best) | cuBLAS dX us | fused dX us (best) |")
    print("|---|---|---|---|---|---|")
    for shape in shapes:
        for d_in, d_out in projections(*SHAPES[shape]):
            w = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16)
            for t in tokens:
                x = torch.randn(t, d_in, device="cuda", dtype=torch.bfloat16)
                dy = torch.randn(t, d_out, device="cuda", dtype=torch.bfloat16)
                fwd = tt.do_bench(lambda x=x, w=w: torch.nn.functional.linear(x, w), warmup=5, rep=30)
                dgrad = tt.do_bench(lambda dy=dy, w=w: dy @ w, warmup=5, rep=30)
                b = tuned.row_bucket(t)  # the kernels' T_BUCKET
                ff, fd = best.get((b, d_in, d_out, 1)), best.get((b, d_out, d_in, 0))
                print(f"| {d_in}x{d_out} | {t} | {fwd * 1e3:.1f} | {ff * 1e3 if ff else float('nan'):.1f} "
                      f"| {dgrad * 1e3:.1f} | {fd * 1e3 if fd else float('nan'):.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama8b,qwen7b")
    ap.add_argument("--variants", default="persist", help="fused GEMM variants to tune (kernels.fused_lora)")
    ap.add_argument("--tokens", default="512,1024,2048,4096,8192,16384,32768")
    ap.add_argument("--ranks", default="8,16,32,64")
    ap.add_argument("--out", default="", help="table file (default kernels/configs/<GPU name>.json)")
    ap.add_argument("--max-configs", type=int, default=3,
                    help="distinct configurations kept per kernel (each is a compile on a cold node); 0: all. "
                    "With --fresh-below: the retuned entries' configurations besides those of the entries kept")
    ap.add_argument("--retune", default="", help="kernels whose table entries are dropped first, so tuned again "
                    "(new candidates); only they are reduced. Default: none dropped, every kernel reduced")
    ap.add_argument("--fresh-below", type=int, default=0, help="drop every kernel's entries of T_BUCKET <= this "
                    "first (tuned again on this device; the larger ones kept as the table has them)")
    ap.add_argument("--cublas", action="store_true", help="print cuBLAS's forward and input-gradient GEMMs "
                    "(no LoRA) at each shape and token count beside the tuned fused GEMMs' best")
    ap.add_argument("--reduce", default="", help="no tuning: reduce this table file (its timings) as --max-configs "
                    "and --fresh-below say, and write it to --out")
    args = ap.parse_args()
    if args.reduce:
        raise SystemExit(reduce_file(Path(args.reduce), Path(args.out or args.reduce), args.max_configs,
                                     args.fresh_below))
    dev = torch.device("cuda")
    retune = [k for k in args.retune.split(",") if k]
    for kernel in retune:
        tuned.table_for(dev).kernels.pop(kernel, None)
    kept_configs: dict[str, list[dict]] = {}
    if args.fresh_below:
        for kernel, rows in tuned.table_for(dev).kernels.items():
            rows[:] = [r for r in rows if r["key"].get("T_BUCKET", 0) > args.fresh_below]
            kept_configs[kernel] = configs_above(rows, args.fresh_below)
    t0 = time.perf_counter()
    for variant in args.variants.split(","):
        fl.GEMM_DEFAULT = variant  # the variant every call of this run launches
        for shape in args.shapes.split(","):
            for d_in, d_out in projections(*SHAPES[shape]):
                for tokens in map(int, args.tokens.split(",")):
                    for r_max in map(int, args.ranks.split(",")):
                        before = len(tuned.BENCHMARKS)
                        run_arena(case(tokens, r_max, d_in, d_out), fl.multilora_linear_arena_fused, aligned=True)
                        torch.cuda.synchronize()
                        print(f"[{time.perf_counter() - t0:7.1f}s] {variant} {shape} {d_in}x{d_out} T={tokens} "
                              f"r_max={r_max}: {len(tuned.BENCHMARKS) - before} keys tuned", flush=True)
                # saved as it goes: a run stopped at its time limit keeps what it tuned
                tuned.save_table(dev, Path(args.out) if args.out else None)
    table = tuned.table_for(dev)
    if args.max_configs:
        for kernel in sorted(retune or table.kernels):
            kept = table.reduce(kernel, args.max_configs, *reduce_scope(kept_configs.get(kernel, []), args.fresh_below))
            print(f"{kernel}: kept {len(kept)} configurations: {kept}")
    path = tuned.save_table(dev, Path(args.out) if args.out else None)
    if args.cublas:
        cublas_lines(table, args.shapes.split(","), [int(t) for t in args.tokens.split(",")])
    print(f"wrote {path}: " + ", ".join(f"{k} {len(v)}" for k, v in sorted(table.kernels.items()))
          + f" entries; {len(tuned.BENCHMARKS)} keys benchmarked in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
