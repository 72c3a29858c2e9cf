"""The quality phase of bench/task_e2e_baselines.py, per seed: the small Llama pretrained on chain
A, the grid through loraplex's executor without (b) and with (a) early exit and through c1, c2
and c3 for real; best validation losses, c3's decisions, and the traces the timing phase replays."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import baselines as bl  # noqa: E402
from baselines_runs import run_config, successive_halving  # noqa: E402
from task_e2e_baselines_setup import examples, load, policies, small_shape, step0, task  # noqa: E402
from task_e2e_data import DEV, free, log, small_model  # noqa: E402
from task_e2e_runs import Record, replay_trace, run_small, summarize_statuses  # noqa: E402

TRACES: dict[int, Record] = {}  # per quality seed: the small model's curves the large runs replay


# ----------------------------------------------------------------------------- quality
def curves_summary(val: dict[str, dict[int, float]], samples: int, ref: dict | None = None) -> dict:
    """Best validation loss over every evaluation of every configuration (finite ones)."""
    pts = [(v, j) for j, c in val.items() for v in c.values() if math.isfinite(v)]
    best, job = min(pts) if pts else (math.nan, None)
    out = {"best": best, "best_job": job, "evals": sum(len(c) for c in val.values()), "samples": samples,
           "best_per_job": {j: min([v for v in c.values() if math.isfinite(v)] or [math.nan])
                            for j, c in val.items()},
           "curves": {j: {str(s): v for s, v in c.items()} for j, c in val.items()}}
    if ref is not None:  # the same configurations trained by (b): how close the curves are
        d = [abs(out["best_per_job"][j] - r) for j, r in ref["best_per_job"].items()
             if j in out["best_per_job"] and math.isfinite(r) and math.isfinite(out["best_per_job"][j])]
        out["vs_b_abs_delta"] = {"median": statistics.median(d), "max": max(d)} if d else None
        out["ratio_to_b"] = best / ref["best"]
    return out


def quality(args: argparse.Namespace, root: Path, tok: Any, seed: int, arms: list[str]) -> dict:
    t = task(args, root, seed)
    jobs = t["jobs"]
    width, depth = small_shape(args)
    small_dir, pre = small_model(root / "small", t["chain_a"], tok, args.pretrain_steps, width, depth)
    out: dict[str, Any] = {"pretrain_loss": pre, "jobs": len(jobs)}
    log(f"seed {seed}: small model pretrained, loss {pre:.4f}")
    train, val = examples(tok, t, args)
    n_train = len(train)
    spec = {j.job_id: j for j in jobs}
    recs = {}
    for name, ee in (("b", False), ("a", True)):
        rec, _, ex = run_small(small_dir, t["data"], root, jobs, ee, args, root / "profiles.json")
        recs[name] = rec
        samples = sum(max(c) * spec[j].batch_size for j, c in rec.train.items())
        out[name] = {**curves_summary(rec.val, samples, out.get("b")), "timings": ex.timings(),
                     "statuses": summarize_statuses(rec.states)}
        out[name]["keep"] = next((d["keep"] for _, m, d in rec.events if m == "warmup_ranking"), None)
        log(f"seed {seed} ({name})", {k: v for k, v in out[name].items() if k not in ("best_per_job", "statuses")})
        del ex
        free()
    # what (a) and (b) replay at the large shape: (a)'s own losses where (a) has them, (b)'s for the
    # steps only (b) ran, train and evaluation alike (replaying (b)'s train losses beside (a)'s
    # evaluations gave (a)'s overfitting detector another train average than the small (a) run had:
    # one lr-0.1 configuration's decision differed in session 32)
    TRACES[seed] = replay_trace(recs["b"], recs["a"])
    out["statuses_a"] = out["a"]["statuses"]
    pad = tok.pad_token_id
    out["check"] = step0(small_dir, jobs, train, pad, arms)
    pol_b, pol_a = policies(t, len(val), n_train)
    samples = sum(j.total_steps(n_train) * j.batch_size for j in jobs)
    if "c1" in arms:
        model, curves = load(small_dir), {}
        arm = bl.c1_arm()
        for j in jobs:
            model, rec = run_config(model, j, arm, train, val, pol_b, pad, bl.lora_init(model, j))
            curves[j.job_id] = rec.val
        out["c1"] = curves_summary(curves, samples, out["b"])
        log(f"seed {seed} c1 best {out['c1']['best']:.4f} ({out['c1']['best_job']})")
        del model
        free()
    if "c2" in arms or "c3" in arms:
        model = load(small_dir)
        arm = bl.c2_arm(DEV)
        with bl.arm_model(model, arm) as info:
            out["c2_setup"] = info
            if "c2" in arms:
                curves = {}
                for j in jobs:
                    model, rec = run_config(model, j, arm, train, val, pol_b, pad, bl.lora_init(model, j))
                    curves[j.job_id] = rec.val
                out["c2"] = curves_summary(curves, samples, out["b"])
                log(f"seed {seed} c2 best {out['c2']['best']:.4f} ({out['c2']['best_job']})")
            if "c3" in arms:
                arm3 = bl.c2_arm(DEV, "c3")
                model, sh = successive_halving(model, jobs, arm3, train, val, pol_a, pad,
                                                  inits=lambda j: bl.lora_init(model, j))
                recs = sh["records"]
                c3_samples = sum(r.steps * spec[j].batch_size for j, r in recs.items())
                out["c3"] = {**curves_summary({j: r.val for j, r in recs.items()}, c3_samples, out["b"]),
                             "keep": sh["keep"], "rung_loss": sh["rung_loss"],
                             "keep_same_as_a": sorted(sh["keep"]) == sorted(out["a"]["keep"] or [])}
                if "c2" in arms:  # the survivors' curves are c2's: same code, state parked exactly
                    c2c, c3c = out["c2"]["curves"], out["c3"]["curves"]
                    d = [abs(c3c[j][s] - v) for j in sh["keep"] for s, v in c2c[j].items()
                         if s in c3c[j] and math.isfinite(v)]
                    out["c3"]["survivors_vs_c2_max_abs_delta"] = max(d) if d else None
                log(f"seed {seed} c3 best {out['c3']['best']:.4f} keep {sh['keep']}")
        del model
        free()
    return out
