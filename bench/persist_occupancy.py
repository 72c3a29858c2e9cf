"""Two programs a streaming multiprocessor for the persistent fused GEMM (issue 40: large steps).

The persistent TMA GEMM (`kernels.fused_lora._gemm_lora_persist_jit`) launches one program per SM;
its epilogue (the LoRA term and the store) runs with nothing beside it on the SM (one CTA at 128x256
tiles and 8 warps). In search (a) this GEMM is ~75% of the GPU's time at 8k-row passes and 150k-row
evaluation forwards, at ~560-600 TFLOP/s. This probe times the GEMM calls of the arena operator's
forward and backward (the dX GEMM) at large row counts with the table's configuration (one program
an SM) against tiles small enough for two resident programs an SM (`NUM_SMS` = 2 x the SMs: one
program's main loop runs beside the other's epilogue), and checks each output against the table's.

    python bench/persist_occupancy.py [--tokens 8192,32768] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from tune_kernels import SHAPES, case, projections  # noqa: E402

from kernels import fused_lora as fl  # noqa: E402
from kernels.testing import run_arena  # noqa: E402

TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): two fit an SM's registers and shared memory
    (128, 128, 64, 4, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 2), (256, 128, 64, 8, 2)]


def captured_calls(tokens: int, d_in: int, d_out: int) -> list[tuple]:
    """The fused GEMM launches (forward, dX) of one forward + backward of the arena operator."""
    calls, real = [], fl._gemm_launch

    def spy(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        calls.append((args, kw))
        return real(*args, **kw)

    fl._gemm_launch = spy
    try:
        run_arena(case(tokens, 64, d_in, d_out), fl.multilora_linear_arena_fused, aligned=True)
    finally:
        fl._gemm_launch = real
    return calls


def timed(args: tuple, kw: dict, cfg, per_sm: int) -> tuple[float, torch.Tensor]:  # noqa: ANN001
    import triton.testing as tt

    kernel, sms = fl._gemm_lora_persist, fl._num_sms(args[1].device)
    real_choose, real_sms = kernel.choose, fl._num_sms
    if cfg is not None:
        kernel.choose = lambda grid, a, meta: cfg
    fl._num_sms = lambda device: sms * per_sm
    try:
        out = fl._gemm_launch(*args, **kw)
        ms = tt.do_bench(lambda: fl._gemm_launch(*args, **kw), warmup=10, rep=60)
    finally:
        kernel.choose, fl._num_sms = real_choose, real_sms
    return ms, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--shapes", default="llama8b")
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    lines = [f"# Persistent fused GEMM, one or two programs an SM ({torch.cuda.get_device_name(dev)})", "",
             "8 adapters of mixed ranks (largest 64), bf16, aligned arena; median ms of do_bench; TFLOP/s of "
             "the base GEMM's FLOPs. `table`: the shipped table's configuration, one program an SM.", "",
             "| d_in x d_out | T | GEMM | table ms | TFLOP/s | best 2/SM tile | ms | TFLOP/s | table / best | max rel diff |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for shape in args.shapes.split(","):
        for d_in, d_out in projections(*SHAPES[shape]):
            for tokens in (int(t) for t in args.tokens.split(",")):
                for which, (call, kw) in zip(("fwd", "dX"), captured_calls(tokens, d_in, d_out), strict=False):
                    flops = 2 * tokens * d_in * d_out
                    base_ms, ref = timed(call, kw, None, 1)
                    best = None
                    for bm, bn, bk, w, s in TILES:
                        cfg = fl._cfg(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s,
                                      **({"BLOCK_R": 32} if "BLOCK_R" in fl._GEMM_CONFIGS[0].kwargs else {}))
                        try:
                            ms, out = timed(call, kw, cfg, 2)
                        except Exception as exc:  # noqa: BLE001 (a tile that does not fit is reported)
                            print(f"{d_in}x{d_out} T={tokens} {which} {bm}x{bn}x{bk} w{w} s{s}: {type(exc).__name__}")
                            continue
                        diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()
                        print(f"{d_in}x{d_out} T={tokens} {which} {bm}x{bn}x{bk} w{w} s{s}: {ms:.3f} ms "
                              f"(table {base_ms:.3f}) diff {diff:.2e}", flush=True)
                        if best is None or ms < best[0]:
                            best = (ms, f"{bm}x{bn}x{bk} w{w} s{s}", diff)
                    if best is None:
                        continue
                    row = dict(shape=f"{d_in}x{d_out}", tokens=tokens, gemm=which, table_ms=base_ms,
                               best=best[1], best_ms=best[0], diff=best[2])
                    rows.append(row)
                    lines.append(f"| {d_in}x{d_out} | {tokens} | {which} | {base_ms:.3f} | {flops / base_ms / 1e9:.0f} "
                                 f"| {best[1]} | {best[0]:.3f} | {flops / best[0] / 1e9:.0f} | "
                                 f"{base_ms / best[0]:.3f}x | {best[2]:.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
