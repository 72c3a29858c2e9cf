"""Every candidate launch configuration of the fused form's LoRA passes at one step's layout, timed apart.

The shipped tables (kernels/configs/<GPU>.json) pick one configuration per (kernel, row bucket, width,
largest rank), tuned offline on eight-adapter cases with a cold L2 (`kernels.tuned._bench`). A small step
of the 200-step task is two adapters (~1.4-1.6k rows), and each pass then reads an input its previous
kernel has just written. This script times, at such a layout (default: the host profile's 2-job step,
rank 16 x 290 rows + rank 64 x 1160 rows, padded to the 1,536-row graph key as a replayed step is), each
pass of one projection with the table's choice and with every candidate configuration of its kernel,
as CUDA-graph replays (`triton.testing.do_bench_cudagraph`, medians), and sums them per step
(32 layers, the 8B shape's 7 projections a layer, no recompute). Both backward schedules of dB: one pass
(dS and dB from one read of dY, atomics per row tile: what the engine runs) and two passes (dS, then
dB by the work-list `_wgrad`). The base GEMM's three forms sit beside them (cuBLAS alone; the fused
persistent GEMM; the store pass + cuBLAS, "auto"'s choice on small steps), and the bytes each LoRA pass
must move at the measured copy bandwidth.

    python3 bench/lora_sweep.py [--layout 290x16,1160x64] [--pad-to 1536] [--budget-s 200] [--extra] [--engine-passes]
                                [--out FILE.md]

--store times instead the "cublas" variant's store pass (`kernels.fused_lora.store_launch`: the LoRA term
written for cuBLAS to add the base GEMM onto; the forward's s P B^T at d_out columns and the backward's dS A at
d_in columns) at every candidate tile of STORE_TILES, each checked against a float64 reference in the same run,
and prints the tile of the least time a step (`--best-out FILE` writes it as $LORAPLEX_LORA_STORE_TILE reads it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lora_op_paths as paths  # noqa: E402
from lora_op_stages import ENGINE_SHAPES, arena_inputs  # noqa: E402

PASSES = ("fwd shrink", "dS + dB one pass", "dS alone", "dB pass", "dA pass")


def _parse_layout(text: str) -> tuple[list[int], list[int]]:
    counts, ranks = [], []
    for item in text.split(","):
        rows, rank = item.lower().split("x")
        counts.append(int(rows))
        ranks.append(int(rank))
    return counts, ranks


def _passes(si, ai) -> dict:  # noqa: ANN001
    """Each pass as (Tuned kernel, launch thunk), on the engine's arena layout."""
    from kernels import fused_lora as fl

    c, x, dy, s_buf = si.c, si.x, si.dy, si.s_buf
    return {
        "fwd shrink": (fl._shrink, lambda: fl._shrink_launch(c, x, ai.arena, ai.sa, ai.ao, s_buf, ai.mode)),
        "dS + dB one pass": (fl._shrink_wgrad, lambda: fl._shrink_launch(c, dy, ai.arena, ai.sb, ai.bo, ai.ds, ai.mode,
                                                                         wgrad=(s_buf, ai.grad, ai.bo))),
        "dS alone": (fl._shrink, lambda: fl._shrink_launch(c, dy, ai.arena, ai.sb, ai.bo, ai.ds, ai.mode)),
        "dB pass": (fl._wgrad, lambda: fl._wgrad_launch(c, s_buf, dy, ai.grad, ai.sb, ai.bo, ai.mode)),
        "dA pass": (fl._wgrad, lambda: fl._wgrad_launch(c, ai.ds, x, ai.grad, ai.sa, ai.ao, ai.mode)),
    }


def _gemms(si, ai) -> dict:  # noqa: ANN001
    """The forward's base GEMM of one projection in its three forms."""
    from kernels.fused_lora import _gemm_launch

    x, w, c, s_buf = si.x, si.w, si.c, si.s_buf

    def fused(variant: str):  # noqa: ANN202
        return lambda: _gemm_launch(c, x, w.t(), None, s_buf, ai.arena, ai.sb, ai.bo, ai.mode, x.dtype, gemm=variant)

    return {"cuBLAS alone": lambda: F.linear(x, w), "persist": fused("persist"), "store + cuBLAS": fused("cublas")}


def _extra() -> dict:
    """--extra: configurations no table offers yet, beside each kernel's candidates (marked "new" where best):
    taller row tiles for the one-pass dB (fewer fp32 atomics per column), longer column splits, and
    shorter row chunks with deeper pipelines for the work-list weight gradients. Session 52's winners
    among them are candidates now (kernels.fused_lora's small-step lists), so they left this list."""
    from kernels.fused_lora import _cfg

    shrink = [_cfg(BLOCK_M=256, BLOCK_K=64, BLOCK_R=64, SPLIT_C=8, num_warps=8),
              _cfg(BLOCK_M=256, BLOCK_K=64, BLOCK_R=16, SPLIT_C=8, num_warps=8),
              _cfg(BLOCK_M=64, BLOCK_K=256, BLOCK_R=16, SPLIT_C=16),
              _cfg(BLOCK_M=32, BLOCK_K=256, BLOCK_R=16, SPLIT_C=16, num_stages=4)]
    wgrad = [_cfg(BLOCK_M=64, BLOCK_N=128, CHUNK=256, BLOCK_R=64, num_stages=5),
             _cfg(BLOCK_M=32, BLOCK_N=64, CHUNK=128, BLOCK_R=16, num_stages=5),
             _cfg(BLOCK_M=128, BLOCK_N=128, CHUNK=512, BLOCK_R=64, num_warps=8)]
    return {"shrink": shrink, "shrink_wgrad": shrink, "wgrad": wgrad}


def _forced(kernel, cfg, fn) -> float:  # noqa: ANN001
    """fn's graph-replay milliseconds with `kernel` launched at `cfg` (inf where it fails)."""
    kernel.choose = lambda *_a, **_k: cfg
    try:
        return paths.graph_ms(fn)
    except Exception:  # noqa: BLE001 (a configuration that does not compile or fit is skipped)
        return float("inf")
    finally:
        del kernel.choose


def _label(cfg) -> str:  # noqa: ANN001
    kw = cfg.kwargs
    parts = [f"{k.removeprefix('BLOCK_')}{v}" if k.startswith("BLOCK") else f"{k}={v}" for k, v in kw.items()]
    return " ".join(parts) + f" w{cfg.num_warps} s{cfg.num_stages}"


def _bytes(name: str, t: int, d_in: int, d_out: int) -> int:
    """The fewest bytes a pass moves (bf16 inputs read once)."""
    return 2 * t * (d_in if name in ("fwd shrink", "dA pass") else d_out)


ENGINE_PASSES = ("fwd shrink", "dS + dB one pass", "dA pass")  # what the engine runs (one-pass dB)


def sweep(counts: list[int], ranks: list[int], pad_to: int, gbs: float, budget_s: float, layers: int,
          extra: bool = False, only: tuple[str, ...] = PASSES) -> list[str]:
    t0 = time.time()
    more = _extra() if extra else {}
    t = sum(counts)
    pad = max(0, pad_to - t)
    need = max(16, 1 << (max(ranks) - 1).bit_length())
    out = [f"layout {', '.join(f'{n} rows at rank {r}' for n, r in zip(counts, ranks, strict=True))}; {pad} rows of "
           f"padding no adapter owns ({t + pad} rows); {layers} layers; copy bandwidth {gbs:.0f} GB/s", ""]
    totals = {"tuned": dict.fromkeys(PASSES, 0.0), "best": dict.fromkeys(PASSES, 0.0)}
    gemm = {"cuBLAS alone": 0.0, "persist": 0.0, "store + cuBLAS": 0.0}
    floor = dict.fromkeys(PASSES, 0.0)
    detail = []
    for d_in, d_out, count in ENGINE_SHAPES:
        torch.manual_seed(0)
        si = paths.stage_inputs(d_in, d_out, len(counts), 0, ranks, counts=counts, pad_rows=pad)
        ai = arena_inputs(si)
        per = count * layers
        for name, fn in _gemms(si, ai).items():
            gemm[name] += paths.graph_ms(fn) * per
        detail += [f"### {d_in}x{d_out} (x{count} a layer)", "", "| pass | table's choice | ms | best candidate | ms | "
                   "bytes floor ms | candidates timed |", "|---|---|---|---|---|---|---|"]
        for name, (kernel, fn) in _passes(si, ai).items():
            if name not in only:
                continue
            tuned_ms = paths.graph_ms(fn)
            args_cfg = _chosen(kernel, fn)
            fresh = more.get(kernel.name, [])
            cands = [cfg for cfg in kernel.configs + fresh if cfg.kwargs.get("BLOCK_R", 16) <= need]
            timed = []
            for cfg in cands:
                if time.time() - t0 > budget_s:
                    break
                timed.append((_forced(kernel, cfg, fn), cfg))
            best_ms, best_cfg = min(timed, key=lambda p: p[0]) if timed else (tuned_ms, args_cfg)
            best_ms = min(best_ms, tuned_ms)
            fl_ms = _bytes(name, sum(counts), d_in, d_out) / gbs / 1e6
            totals["tuned"][name] += tuned_ms * per
            totals["best"][name] += best_ms * per
            floor[name] += fl_ms * per
            new = " (new)" if any(best_cfg is c for c in fresh) else ""
            detail.append(f"| {name} | {_label(args_cfg) if args_cfg else '-'} | {tuned_ms:.4f} | "
                          f"{_label(best_cfg) if best_cfg else '-'}{new} | {best_ms:.4f} | {fl_ms:.4f} | "
                          f"{len(timed)}/{len(cands)} |")
            print(detail[-1], flush=True)
        detail.append("")
    out += ["Per step (ms, the shapes' passes times their count a layer times the layers):", "",
            "| pass | table's choices | best candidates | bytes floor |", "|---|---|---|---|"]
    out += [f"| {k} | {totals['tuned'][k]:.2f} | {totals['best'][k]:.2f} | {floor[k]:.2f} |" for k in only]
    for label, key in (("one pass (fwd shrink + dS+dB + dA)", ("fwd shrink", "dS + dB one pass", "dA pass")),
                       ("two passes (fwd shrink + dS + dB + dA)", ("fwd shrink", "dS alone", "dB pass", "dA pass"))):
        if not set(key) <= set(only):
            continue
        out.append(f"| {label} | {sum(totals['tuned'][k] for k in key):.2f} | "
                   f"{sum(totals['best'][k] for k in key):.2f} | {sum(floor[k] for k in key):.2f} |")
    out += ["", "The forward's base GEMM a step (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in gemm.items()), ""]
    out += detail
    out.append(f"sweep took {time.time() - t0:.0f} s (budget {budget_s:.0f} s: cells past it time only the "
               "table's choice)")
    return out


# "BLOCK_M,BLOCK_N,num_warps[,BLOCK_R cap]" ($LORAPLEX_LORA_STORE_TILE's form); the first is the default
STORE_TILES = ("64,256,4", "64,128,4", "32,128,4", "32,256,4", "64,64,4", "32,64,2", "16,128,2", "128,128,8",
               "64,128,4,64", "32,128,4,64", "64,256,4,64", "32,256,8,64")


STORE_TOL = 2e-2  # a tile's worst error against float64 (bf16 output) for its time to count


def _store_cfg(tile: str, r_max: int):  # noqa: ANN202
    """The store pass's configuration for a tile string, with the rank tile the process would give it at
    `r_max` (`_store_config`, `_store_rank_tile`: the config carries it, as the launch's meta would)."""
    from kernels.fused_lora import _store_config, _store_rank_tile

    v = [int(x) for x in tile.split(",")]
    cfg = _store_config(v)
    cfg.kwargs.update(_store_rank_tile(r_max, v))
    return cfg


def _store_ref(si, p: torch.Tensor, weights: str) -> torch.Tensor:  # noqa: ANN001
    """float64 s_i P[rows_i, :r_i] W_i: W_i = B_i (forward, `weights` "b") or A_i^T (backward, "a"); 0 elsewhere."""
    case = si.case
    width = si.w.shape[0] if weights == "b" else si.w.shape[1]
    out = torch.zeros(p.shape[0], width, dtype=torch.float64, device=p.device)
    off, ranks, scales = case.offsets.tolist(), case.ranks.tolist(), case.scales.tolist()
    for i, r in enumerate(ranks):
        w = case.lora_b[i, :r, :] if weights == "b" else case.lora_a[i, :, :r].t()
        out[off[i]:off[i + 1]] = scales[i] * p[off[i]:off[i + 1], :r].double() @ w.double()
    return out


def store_sweep(counts: list[int], ranks: list[int], pad_to: int, gbs: float, layers: int,
                tiles: tuple[str, ...] = STORE_TILES) -> tuple[list[str], str | None]:
    """Every tile's store pass, forward and backward, at ENGINE_SHAPES: the table and the tile of the least
    time a step (only tiles whose every output matched the reference; None where none did)."""
    from kernels import fused_lora as fl

    t = sum(counts)
    pad = max(0, pad_to - t)
    totals = dict.fromkeys(tiles, 0.0)
    worst = dict.fromkeys(tiles, 0.0)
    floor = 0.0
    rows = ["| shape | pass | bytes floor us | " + " | ".join(tiles) + " |", "|---|---|---|" + "---|" * len(tiles)]
    for d_in, d_out, count in ENGINE_SHAPES:
        torch.manual_seed(0)
        si = paths.stage_inputs(d_in, d_out, len(counts), 0, ranks, counts=counts, pad_rows=pad)
        ai = arena_inputs(si)
        ai.ds.copy_(torch.randn_like(ai.ds))  # never time on zeros
        for name, p, b_kn, width, w_strides, woff, weights in (
                ("fwd s P B^T", si.s_buf, si.w.t(), d_out, ai.sb, ai.bo, "b"),
                ("bwd dS A", ai.ds, si.w, d_in, ai.sa, ai.ao, "a")):
            out = torch.empty(t + pad, width, dtype=si.x.dtype, device=si.x.device)
            ref = _store_ref(si, p, weights)
            fl_us = 2 * (t + pad) * width / gbs / 1e3
            floor += fl_us * count * layers / 1e3
            cells = []
            for tile in tiles:
                cfg = _store_cfg(tile, si.c.r_max)
                fl._lora_store.choose = lambda *_a, _c=cfg, **_k: _c
                try:
                    def fn(si=si, ai=ai, p=p, b_kn=b_kn, out=out, w_strides=w_strides, woff=woff) -> None:  # noqa: ANN001
                        fl.store_launch(si.c, si.x, b_kn, out, None, p, ai.arena, w_strides, woff, ai.mode)
                    out.fill_(float("nan"))  # a tile that leaves part of it unwritten fails the check
                    fn()
                    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                    us = paths.graph_ms(fn) * 1e3 if err < STORE_TOL else float("inf")
                except Exception as exc:  # noqa: BLE001 (a tile that does not compile or fit is left out)
                    print(f"tile {tile} at {d_in}x{d_out} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    err, us = float("nan"), float("inf")
                finally:
                    del fl._lora_store.choose
                totals[tile] += us * count * layers / 1e3
                worst[tile] = max(worst[tile], err if err == err else float("inf"))
                cells.append(f"{us:.1f}" + ("" if err < STORE_TOL else f" (err {err:.1e})"))
            rows.append(f"| {d_in}x{d_out} (x{count}) | {name} | {fl_us:.1f} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    measured = [k for k in tiles if totals[k] < float("inf")]
    best = min(measured, key=lambda k: totals[k]) if measured else None
    out = [f"layout {', '.join(f'{n} rows at rank {r}' for n, r in zip(counts, ranks, strict=True))}; {pad} rows of "
           f"padding ({t + pad} rows); {layers} layers; copy bandwidth {gbs:.0f} GB/s. Microseconds a call "
           "(CUDA-graph medians); tile = BLOCK_M,BLOCK_N,warps[,rank tile cap].", "", *rows, "",
           "| tile | ms a step (forward + backward stores, every projection) | worst relative error |", "|---|---|---|"]
    out += [f"| {k} | {totals[k]:.2f} | {worst[k]:.1e} |" for k in tiles]
    out += [f"| bytes floor | {floor:.2f} | - |", ""]
    out.append(f"best: {best} ({totals[best]:.2f} ms a step against the default {tiles[0]}'s {totals[tiles[0]]:.2f})"
               if best else "best: none (no tile ran correctly at every shape)")
    return out, best


def _chosen(kernel, fn):  # noqa: ANN001, ANN202
    """The configuration the table gives this call (fn run once with `choose` observed)."""
    seen = []
    own = kernel.choose

    def spy(*a, **k):  # noqa: ANN002, ANN003, ANN202
        cfg = own(*a, **k)
        seen.append(cfg)
        return cfg

    kernel.choose = spy
    try:
        fn()
    finally:
        del kernel.choose
    return seen[0] if seen else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="290x16,1160x64", help="rows x rank of each adapter")
    ap.add_argument("--pad-to", type=int, default=1536, help="rows of the graph key (padding no adapter owns)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop timing candidates after this many seconds")
    ap.add_argument("--extra", action="store_true", help="also time configurations no table offers yet (_extra)")
    ap.add_argument("--engine-passes", action="store_true", help="only the passes the engine runs (one-pass dB)")
    ap.add_argument("--store", action="store_true", help="time the store pass's tiles instead (STORE_TILES)")
    ap.add_argument("--best-out", default=None, help="with --store: write the best tile to this file")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import triton

    counts, ranks = _parse_layout(args.layout)
    gbs = paths.bandwidth_gbs()
    if args.store:
        lines, best = store_sweep(counts, ranks, args.pad_to, gbs, args.layers)
        text = "\n".join([f"# The store pass's tiles at a small step's layout ({torch.cuda.get_device_name()}; "
                          f"torch {torch.__version__}, triton {triton.__version__}; bf16)", "", *lines])
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text + "\n")
        if args.best_out and best:
            Path(args.best_out).write_text(best + "\n")
        return
    text = "\n".join([f"# The fused form's LoRA passes at a small step's layout ({torch.cuda.get_device_name()}; "
                      f"torch {torch.__version__}, triton {triton.__version__}; bf16; CUDA-graph medians)", ""]
                     + sweep(counts, ranks, args.pad_to, gbs, args.budget_s, args.layers, args.extra,
                           ENGINE_PASSES if args.engine_passes else PASSES))
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
