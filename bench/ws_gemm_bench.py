"""The warp-specialised Gluon GEMM (`kernels/ws_gemm.py`) side by side with cuBLAS and the product's GEMMs, per GEMM of
a 2-job step at the row counts its graphs replay.

For each graph key : live rows and each projection of the 8B shape (`ENGINE_SHAPES`), forward (x W^T) and dX (dY W),
CUDA-graph medians (`do_bench_cudagraph`) of:
- "cuBLAS": `a @ b` over the key's rows (what a graph replays; no LoRA term);
- "auto" and "persist": the product's fused GEMM + LoRA (`kernels.fused_lora._gemm_launch`; two adapters, ranks
  16 and 64 in a 1:4 row split of the live rows, as `bench/gemm_tail.py` laid them out);
- each `ws_gemm.VARIANTS` entry: the base GEMM alone over the live rows, and with --lora "+lora": with the same
  LoRA term as the product's forms (its epilogue, rank blocks of --block-r).
Each Gluon output's live rows are checked against a float64 reference in the same run (relative Frobenius error; the
row tiles past the live rows must hold zeros, from an output filled with NaN);
the product forms are checked against the reference with their LoRA term. TFLOP/s counts the live rows' FLOPs.

    python3 bench/ws_gemm_bench.py [--layouts 1536:1450,2048:1800] [--variants coop,pingpong] [--json FILE]
    python3 bench/ws_gemm_bench.py --report FILE.json   # its tables again from a run's JSON (no GPU)
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

TOL = 1e-2  # bf16 output against float64


def _time_ms(fn) -> float:  # noqa: ANN001
    from triton.testing import do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=60, return_mode="median")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def run(layouts: list[tuple[int, int]], variants: list[str], layers: int, product: bool, lora: bool,
        block_r: int) -> dict:
    import lora_op_paths as paths
    from lora_op_stages import ENGINE_SHAPES, arena_inputs

    from kernels import ws_gemm

    rows_out, totals, worst = [], {}, 0.0
    for key_rows, live in layouts:
        small = live // 5
        step = {}
        for d_in, d_out, count in ENGINE_SHAPES:
            torch.manual_seed(0)
            si = paths.stage_inputs(d_in, d_out, 2, 0, [16, 64], counts=[small, live - small], pad_rows=key_rows - live)
            ai = arena_inputs(si)
            ai.ds.copy_(torch.randn_like(ai.ds) * 0.05)
            m_live = torch.tensor([live], dtype=torch.int32, device="cuda")
            for direction in ("fwd", "dx"):
                from kernels import fused_lora as fl

                if direction == "fwd":
                    a, b, b_nk, b_kn, p, strides, woff = si.x, si.w, True, si.w.t(), si.s_buf, ai.sb, ai.bo
                else:
                    a, b, b_nk, b_kn, p, strides, woff = si.dy, si.w, False, si.w, ai.ds, ai.sa, ai.ao
                k, nc = a.shape[1], b_kn.shape[1]
                flop = 2.0 * live * k * nc
                base = (a[:live].double() @ b_kn.double())
                forms = {"cuBLAS": (lambda a=a, b_kn=b_kn: a @ b_kn, None)}
                if product:
                    want = base.clone()
                    bounds = si.case.offsets.tolist()
                    for i, r in enumerate(si.case.ranks.tolist()):
                        lo, hi = bounds[i], bounds[i + 1]
                        blk = ai.arena[int(woff[i]): int(woff[i]) + r * nc].view(r, nc).double()
                        want[lo:hi] += float(si.case.scales[i]) * (p[lo:hi, :r].double() @ blk)
                    for form in ("auto", "persist"):
                        forms[form] = (lambda form=form, a=a, b_kn=b_kn, p=p, strides=strides, woff=woff, si=si, ai=ai:
                                       fl._gemm_launch(si.c, a, b_kn, None, p, ai.arena, strides, woff, ai.mode,
                                                       a.dtype, gemm=form), want)
                for v in variants:
                    out = torch.full((a.shape[0], nc), float("nan"), dtype=a.dtype, device="cuda")
                    forms[v] = (lambda v=v, a=a, b=b, b_nk=b_nk, out=out, m_live=m_live:
                                ws_gemm.ws_gemm(a, b, out, b_nk, m_live, variant=v), base)
                    if lora and product:
                        term = (p, ai.arena, woff, si.case.offsets, si.case.ranks, si.case.scales, 64, block_r)
                        out2 = torch.full((a.shape[0], nc), float("nan"), dtype=a.dtype, device="cuda")
                        forms[v + "+lora"] = (lambda v=v, a=a, b=b, b_nk=b_nk, out=out2, term=term, m_live=m_live:
                                              ws_gemm.ws_gemm(a, b, out, b_nk, m_live, variant=v, lora=term), want)
                line = []
                for name, (fn, ref) in forms.items():
                    err = None
                    try:
                        if ref is not None:
                            got = fn()
                            err = _rel(got[:live], ref)
                            if name in variants or name.endswith("+lora"):  # row tiles past the live ones: zeros
                                bm = ws_gemm.VARIANTS[name.split("+")[0]][0]
                                tail = got[-(-live // bm) * bm:]
                                err = max(err, float(tail.abs().max().nan_to_num(1.0)) if tail.numel() else 0.0)
                            worst = max(worst, err)
                        ms = _time_ms(fn)
                    except Exception as e:  # a variant that fails to compile or run is reported, not fatal
                        print(f"  {name} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
                        ms, err = float("nan"), float("nan")
                    step[name] = step.get(name, 0.0) + ms * count * layers
                    rows_out.append({"key_rows": key_rows, "live": live, "shape": f"{d_in}x{d_out}", "dir": direction,
                                     "form": name, "ms": ms, "tflops": flop / ms / 1e9, "err": err})
                    line.append(f"{name} {ms * 1e3:.1f} us {flop / ms / 1e9:.0f} TF" + (f" err {err:.1e}" if err is not None else ""))
                print(f"{key_rows}:{live} {d_in}x{d_out} {direction}: " + " | ".join(line), flush=True)
        totals[f"{key_rows}:{live}"] = step
        print(f"{key_rows}:{live} a step ({layers} layers, ms): " +
              " | ".join(f"{k} {v:.2f}" for k, v in step.items()), flush=True)
    return {"rows": rows_out, "step_ms": totals, "worst_err": worst, "ok": worst < TOL}


def report(path: str) -> None:
    """A run's tables from its JSON: the GEMMs summed a step per form, then each GEMM's microseconds per form."""
    res = json.loads(Path(path).read_text())
    for layout, step in res["step_ms"].items():
        print(f"{layout} a step (ms): " + " | ".join(f"{k} {v:.2f}" for k, v in step.items()))
    cells: dict[tuple, dict] = {}
    for r in res["rows"]:
        if "form" in r:
            cells.setdefault((r["key_rows"], r["live"], r["shape"], r["dir"]), {})[r["form"]] = r["ms"] * 1e3
    for (key, live, shape, d), forms in cells.items():
        print(f"{key}:{live} {shape} {d}: " + " | ".join(f"{k} {v:.1f}" for k, v in forms.items()))
    print(f"worst error {res['worst_err']:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="1024:960,1536:1450,2048:1800,2560:2400")
    ap.add_argument("--variants", default="coop,pingpong,pingpong_n256")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--no-product", action="store_true", help="skip the product's fused forms")
    ap.add_argument("--lora", action="store_true", help="each variant also with the LoRA term (+lora)")
    ap.add_argument("--block-r", type=int, default=32, help="the Gluon epilogue's rank block")
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", default=None, help="print a run's tables from its JSON and stop")
    args = ap.parse_args()
    if args.report:
        report(args.report)
        return
    layouts = [tuple(int(v) for v in x.split(":")) for x in args.layouts.split(",")]
    t0 = time.time()
    res = run(layouts, args.variants.split(","), args.layers, not args.no_product, args.lora, args.block_r)
    res.update(device=torch.cuda.get_device_name(), torch=torch.__version__, seconds=time.time() - t0,
               args=vars(args))
    import triton

    res["triton"] = triton.__version__
    print(f"worst error {res['worst_err']:.2e} ({'ok' if res['ok'] else 'FAILED'}); {res['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
