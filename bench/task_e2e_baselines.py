"""Issue 33's sequential baselines beside bench/task_e2e.py's executor arms: (c1) plain PEFT one
configuration at a time, (c2) PEFT with padding-free packing, varlen flash attention, Liger and
fused AdamW, (c3) (c2) under successive halving with loraplex's warmup-ranking rung (see
bench/baselines.py), on task_e2e's data, tokenizer, evaluation policy and quality model.

Two phases, in one device call or in several (their JSON files are merged into one table):
  quality  per --seed: the small Llama pretrained on chain A (task_e2e.small_model), then the grid
           through loraplex's executor without (b) and with (a) early exit (task_e2e.run_small),
           and through c1, c2 and c3 for real: best validation loss of every arm, its ratio to
           (b)'s, c3's decisions; the step-0 check (engine vs c1 vs c2 on one batch).
  timing   the Llama-3.1-8B shape with random bf16 weights and --layers layers: the step-0 check
           at that shape, then per arm the model load (timed) and ONE configuration per
           (batch size, rank) of the grid trained whole (all its steps and evaluations; steps
           timed in blocks between evaluations, device-synced at block ends only); every other
           configuration's time is its measured twin's (same batch size and rank: the same steps,
           one epoch of the same examples, the same evaluations); c3's from c2's twins cut at the
           rung, plus the measured park/resume of a configuration, replaying the decisions of
           the quality phase (each seed's). One-time costs (compilation, first allocations) are
           measured once per arm on a warm-up configuration and added once.

    python bench/task_e2e_baselines.py --arms c1,c2,c3 --layers 4 --configs 48 --seed 0 --json q0.json
    python bench/task_e2e_baselines.py --phase timing --arms c1 --layers 32 --json t32_c1.json
    python bench/task_e2e_baselines.py --merge q0.json q1.json t4.json t32_c1.json ... --out table.md
    python bench/task_e2e_baselines.py --smoke     # CPU, toy sizes, every arm, asserts step 0
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import baselines as bl  # noqa: E402
import task_e2e as te  # noqa: E402

from trainer.data import JobDataStream, read_jsonl, tokenize_all  # noqa: E402

DEV = te.DEV
log = te.log
ARMS = ("a", "b", "c1", "c2", "c3")
TRACES: dict[int, te.Record] = {}  # per quality seed: the small model's curves the large runs replay


def free() -> None:
    gc.collect()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


SMALL_SHAPE = "256x4"  # the quality model's WIDTHxDEPTH unless --small-shape says otherwise


def small_shape(args: argparse.Namespace) -> tuple[int, int]:
    width, depth = (int(x) for x in getattr(args, "small_shape", SMALL_SHAPE).lower().split("x"))
    return width, depth


def left(args: argparse.Namespace) -> float:
    return args.deadline_s - (time.perf_counter() - te.T0)


# ----------------------------------------------------------------------------- data and settings
def task(args: argparse.Namespace, root: Path, seed: int) -> dict[str, Any]:
    """task_e2e's task for this seed: chains(seed) (seed 0: task_e2e's), its files, the grid."""
    root.mkdir(parents=True, exist_ok=True)
    chain_a, chain_b = te.chains(seed)
    data = te.write_data(root, chain_b, args.n_train, args.n_val, args.seq)
    cfg = te.executor_cfg(root, data, root / "unused", [], False, args, None)
    return {"chain_a": chain_a, "data": data, "ev": cfg.eval, "ee": cfg.early_exit,
            "split_seed": cfg.split_seed, "jobs": bl.grid_for(args.configs, args.n_train, seed)}


def examples(tok: Any, t: dict[str, Any], args: argparse.Namespace) -> tuple[list, list]:
    """Train and evaluation sets as the executor reads them (TaskRun.read): the validation file
    in the split seed's shuffled order, its first eval_max_samples."""
    train = tokenize_all(tok, read_jsonl(t["data"][0]), args.seq)
    val = tokenize_all(tok, read_jsonl(t["data"][1]), args.seq)
    random.Random(t["split_seed"]).shuffle(val)
    cap = t["ev"].eval_max_samples
    return train, (val[:cap] if cap else val)


def policies(t: dict[str, Any], n_val: int, n_train: int) -> tuple[bl.EvalPolicy, bl.EvalPolicy]:
    """(no ranking: (b), c1, c2; with the warmup ranking's rung: (a), c3)."""
    return tuple(bl.EvalPolicy.for_jobs(t["ev"], t["ee"], n_val, t["jobs"], n_train, ranked)
                 for ranked in (False, True))


def load(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map={"": DEV})


# ----------------------------------------------------------------------------- step 0
def check_spec(jobs: list) -> Any:
    return next((j for j in jobs if j.batch_size == 4 and j.lr == 1e-3), jobs[0])


def step0(model_dir: Path, jobs: list, train: list, pad: int, arms: list[str]) -> dict[str, Any]:
    """The step-0 losses of the engine, c1 and c2 (one configuration, one batch); if Liger's
    patched model fails or disagrees, Liger is turned off for this process and it runs again."""
    names = [a for a in ("c1", "c2") if a in arms or (a == "c2" and "c3" in arms)]
    fp32 = DEV.type != "cuda"
    for _ in range(2):
        model = load(model_dir)
        mk = {"c1": bl.c1_arm, "c2": lambda: bl.c2_arm(DEV)}
        try:
            out = bl.step0_losses(model, check_spec(jobs), train, pad, [mk[a]() for a in names])
            error = None
        except Exception as exc:  # noqa: BLE001 - Liger's forward is the one part that may not run here
            out, error = {}, exc
        del model
        free()
        verdict = bl.check_verdict(out, names, fp32)
        liger_bad = "c2" in names and bl.LIGER["module"] is not None and (
            error is not None or not all(v["ok"] for k, v in verdict.items() if k.startswith("c2")))
        if not liger_bad:
            if error is not None:  # recorded, not raised: the call's other measurements go on
                out = {"job": check_spec(jobs).job_id, "tokens": 0, "error": f"{type(error).__name__}: {error}"}
            break
        bl.liger_failed(error or RuntimeError(f"its step-0 losses differ from the engine's: {verdict}"))
        log("Liger off:", bl.LIGER["status"])
    out.update({"verdict": verdict, "ok": bool(verdict) and all(v["ok"] for v in verdict.values()), "fp32": fp32,
                "liger": bl.LIGER["status"]})
    log("step 0", out)
    return out


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
    small_dir, pre = te.small_model(root / "small", t["chain_a"], tok, args.pretrain_steps, width, depth)
    out: dict[str, Any] = {"pretrain_loss": pre, "jobs": len(jobs)}
    log(f"seed {seed}: small model pretrained, loss {pre:.4f}")
    train, val = examples(tok, t, args)
    n_train = len(train)
    spec = {j.job_id: j for j in jobs}
    recs = {}
    for name, ee in (("b", False), ("a", True)):
        rec, _, ex = te.run_small(small_dir, t["data"], root, jobs, ee, args, root / "profiles.json")
        recs[name] = rec
        samples = sum(max(c) * spec[j].batch_size for j, c in rec.train.items())
        out[name] = {**curves_summary(rec.val, samples, out.get("b")), "timings": ex.timings(),
                     "statuses": te.summarize_statuses(rec.states)}
        out[name]["keep"] = next((d["keep"] for _, m, d in rec.events if m == "warmup_ranking"), None)
        log(f"seed {seed} ({name})", {k: v for k, v in out[name].items() if k not in ("best_per_job", "statuses")})
        del ex
        free()
    # what (a) and (b) replay at the large shape: (b)'s train curves, both runs' evaluations
    TRACES[seed] = te.Record(train=recs["b"].train, val={
        j: {**recs["b"].val.get(j, {}), **recs["a"].val.get(j, {})} for j in recs["b"].val})
    out["statuses_a"] = out["a"]["statuses"]
    pad = tok.pad_token_id
    out["check"] = step0(small_dir, jobs, train, pad, arms)
    pol_b, pol_a = policies(t, len(val), n_train)
    samples = sum(j.total_steps(n_train) * j.batch_size for j in jobs)
    if "c1" in arms:
        model, curves = load(small_dir), {}
        arm = bl.c1_arm()
        for j in jobs:
            model, rec = bl.run_config(model, j, arm, train, val, pol_b, pad, bl.lora_init(model, j))
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
                    model, rec = bl.run_config(model, j, arm, train, val, pol_b, pad, bl.lora_init(model, j))
                    curves[j.job_id] = rec.val
                out["c2"] = curves_summary(curves, samples, out["b"])
                log(f"seed {seed} c2 best {out['c2']['best']:.4f} ({out['c2']['best_job']})")
            if "c3" in arms:
                arm3 = bl.c2_arm(DEV, "c3")
                model, sh = bl.successive_halving(model, jobs, arm3, train, val, pol_a, pad,
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


# ----------------------------------------------------------------------------- timing
def jobs_meta(jobs: list, train: list, pol_b: bl.EvalPolicy, pol_a: bl.EvalPolicy) -> list[dict]:
    """Every configuration's steps, rung, tokens (exact, from its data order) and evaluations."""
    out = []
    for j in jobs:
        total, stream, toks = j.total_steps(len(train)), JobDataStream(len(train), j.seed), []
        for _ in range(total):
            toks.append(sum(len(train[i].input_ids) for i in stream.next_indices(j.batch_size)))
        rung = pol_a.rung(total)
        out.append({"job": j.job_id, "bs": j.batch_size, "rank": j.rank, "lr": j.lr, "total": total,
                    "rung": rung, "tokens_total": sum(toks), "tokens_rung": sum(toks[:rung]), "step_tokens": toks,
                    "evals_full": [s for _, s in pol_b.evals(total, j.batch_size)],
                    "evals_rung": [s for _, s in pol_a.evals(total, j.batch_size, 0, rung)],
                    "evals_rest": [s for _, s in pol_a.evals(total, j.batch_size, rung, total)]})
    return out


def measured_pairs(jobs: list) -> list[Any]:
    """One configuration per (batch size, rank) (lr 1e-3 where the grid has it: never the
    diverging end): first each batch size's middle rank, then the others (a deadline leaves every
    batch size measured)."""
    by = {}
    for j in jobs:
        key = (j.batch_size, j.rank)
        if key not in by or abs(math.log10(j.lr) + 3) < abs(math.log10(by[key].lr) + 3):
            by[key] = j
    ranks = {bs: sorted(r for b, r in by if b == bs) for bs, _ in by}
    first = [by[(bs, rs[len(rs) // 2])] for bs, rs in sorted(ranks.items())]
    return first + [j for k, j in sorted(by.items()) if j not in first]


def probe_checkpointing(model: torch.nn.Module, arm: bl.Arm, jobs: list, train: list, pad: int) -> dict:
    """c2 trains without activation checkpointing where it fits: one forward + backward of each
    batch size's worst micro-batch (its longest examples) at the grid's largest rank, largest
    batch size first; where it runs out of memory, that batch size and larger ones checkpoint."""
    out = {}
    rank = max(j.rank for j in jobs)
    longest = sorted(train, key=lambda e: -len(e.input_ids))
    fits = True
    for bs in sorted({j.batch_size for j in jobs}, reverse=True):
        if fits:
            spec = bl.JobSpec("probe", rank=rank, alpha=2.0 * rank, batch_size=bs)
            run = bl.JobRun(model, spec, arm, train, pad)
            try:
                run.loss(longest[:bs]).backward()
                bl.sync(DEV)
            except torch.cuda.OutOfMemoryError:
                fits = False
            model = run.close()
            free()
        arm.checkpointing[bs] = not fits
        out[str(bs)] = {"checkpointing": not fits, "tokens": sum(len(e.input_ids) for e in longest[:bs])}
    log("c2 activation checkpointing by batch size", out)
    return out


def record_dict(rec: bl.ConfigRecord) -> dict:
    return {"setup_s": rec.setup_s, "train_s": rec.train_s, "eval_s": rec.eval_s,
            "teardown_s": rec.teardown_s, "steps": rec.steps, "tokens": rec.tokens,
            "rung_train_s": rec.rung_train_s, "evals": len(rec.val)}


def park_resume(model: torch.nn.Module, arm: bl.Arm, jobs: list, train: list, pad: int) -> tuple:
    """(c3) per rank: seconds to park a configuration (state to the host, detach) and to resume
    it (attach, state back), after 2 steps of its smallest batch size."""
    out = {}
    for rank in sorted({j.rank for j in jobs}):
        spec = next(j for j in sorted(jobs, key=lambda j: j.batch_size) if j.rank == rank)
        run = bl.JobRun(model, spec, arm, train, pad)
        for _ in range(2):
            run.train_step()
        bl.sync(DEV)
        t0 = time.perf_counter()
        model, state = run.park()
        bl.sync(DEV)
        t1 = time.perf_counter()
        run = bl.JobRun(model, spec, arm, train, pad, parked=state)
        bl.sync(DEV)
        out[str(rank)] = {"park_s": t1 - t0, "resume_s": time.perf_counter() - t1}
        model = run.close()
    return model, out


def time_arm(name: str, model_dir: Path, tok: Any, t: dict, args: argparse.Namespace,
             pol_b: bl.EvalPolicy, with_park: bool) -> dict:
    """One arm at the large shape: load (timed: weights to the device, data tokenised, the arm's
    patches), c2's checkpointing probe (reported, not counted), a warm-up configuration (3 steps
    and an evaluation: the one-time costs), then each measured (batch size, rank) trained whole."""
    bl.sync(DEV)
    t0 = time.perf_counter()
    model = load(model_dir)
    train, val = examples(tok, t, args)
    arm = bl.c1_arm() if name == "c1" else bl.c2_arm(DEV)
    pad = tok.pad_token_id
    out: dict[str, Any] = {"n_backbone": bl.backbone_params(model), "pairs": {}, "skipped": []}
    with bl.arm_model(model, arm) as info:
        bl.sync(DEV)
        out.update(load_s=time.perf_counter() - t0, setup=info, liger=bl.LIGER["status"] if arm.liger else "not used")
        if arm.packed and DEV.type == "cuda":
            t1 = time.perf_counter()
            out["checkpointing"] = probe_checkpointing(model, arm, t["jobs"], train, pad)
            out["probe_s"] = time.perf_counter() - t1
        pairs = measured_pairs(t["jobs"])
        warm = max(pairs, key=lambda j: (j.batch_size, -abs(j.rank - 16)))
        run = bl.JobRun(model, warm, arm, train, pad)
        bl.sync(DEV)
        t1 = time.perf_counter()
        for _ in range(min(3, run.total)):
            run.train_step()
        run.evaluate(val)
        bl.sync(DEV)
        out["first_use"] = {"seconds": time.perf_counter() - t1, "steps": min(3, run.total),
                            "bs": warm.batch_size, "rank": warm.rank, "eval_size": len(val)}
        model = run.close()
        durations: dict[str, list[float]] = {}
        for spec in pairs:
            key = f"{spec.batch_size},{spec.rank}"
            if left(args) < args.reserve_s:
                out["skipped"].append(key)
                continue
            try:
                model, rec = bl.run_config(model, spec, arm, train, val, pol_b, pad)
            except torch.cuda.OutOfMemoryError:  # a batch worse than the probe's: checkpoint it
                free()
                arm.checkpointing[spec.batch_size] = True
                out.setdefault("oom_retried", []).append(key)
                model, rec = bl.run_config(model, spec, arm, train, val, pol_b, pad)
            out["pairs"][key] = {"job": spec.job_id, "checkpointing": arm.checkpoint(spec.batch_size),
                                 **record_dict(rec)}
            for size, s in rec.eval_durations:
                durations.setdefault(str(size), []).append(s)
            log(name, key, out["pairs"][key])
        out["eval_by_size"] = durations
        if with_park:
            model, out["park_resume"] = park_resume(model, arm, t["jobs"], train, pad)
    del model
    free()
    return out


def timing(args: argparse.Namespace, root: Path, tok: Any, arms: list[str], res: dict, dump) -> None:  # noqa: ANN001
    t = task(args, root, args.seeds[0])
    train, val = examples(tok, t, args)
    pol_b, pol_a = policies(t, len(val), len(train))
    tm = res["timing"] = {"layers": args.layers, "seed": args.seeds[0],
                          "jobs": jobs_meta(t["jobs"], train, pol_b, pol_a)}
    large_dir = te.large_model(root / "large", args.layers, tok)
    log("large model saved", args.layers, "layers")
    tm["check"] = step0(large_dir, t["jobs"], train, tok.pad_token_id, arms)
    dump()
    for name, ee in (("b", False), ("a", True)):
        if name not in arms:
            continue
        if left(args) < args.reserve_s or args.seeds[0] not in TRACES:
            tm[name] = {"skipped": "deadline" if args.seeds[0] in TRACES else "no quality phase to replay"}
            continue
        q = {"quality": {"statuses_a": res["quality"][str(args.seeds[0])]["statuses_a"]}}
        tm[name] = te.large_run(name, ee, "auto", args=args, root=root, large_dir=large_dir, data=t["data"],
                                jobs=t["jobs"], trace=TRACES[args.seeds[0]], cache=root / "profiles_large.json",
                                res=q, floor=False)
        dump()
    for name in [a for a in ("c2", "c1") if a in arms or (a == "c2" and "c3" in arms)]:
        if left(args) < args.reserve_s:
            tm[name] = {"skipped": "deadline"}
            continue
        tm[name] = time_arm(name, large_dir, tok, t, args, pol_b, with_park=name == "c2" and "c3" in arms)
        dump()
    tm["measured_as"] = {a: ("c2" if a == "c3" else a) for a in arms}


# ----------------------------------------------------------------------------- extrapolation
def _pair(arm: dict, bs: int, rank: int) -> tuple[dict, str | None]:
    """The measured twin of (bs, rank): itself, else the same batch size's nearest rank."""
    pairs = arm["pairs"]
    if f"{bs},{rank}" in pairs:
        return pairs[f"{bs},{rank}"], None
    same = [k for k in pairs if int(k.split(",")[0]) == bs]
    if not same:
        raise KeyError(f"batch size {bs} was not measured")
    k = min(same, key=lambda k: abs(math.log(int(k.split(",")[1]) / rank)))
    return pairs[k], k


def _eval_time(arm: dict, size: int) -> float:
    table = {int(k): statistics.median(v) for k, v in arm["eval_by_size"].items()}
    if size in table:
        return table[size]
    near = min(table, key=lambda k: abs(k - size))
    return table[near] * size / near  # linear in the samples evaluated


def estimate(meta: list[dict], arm: dict, kind: str, keep: list[str] | None = None) -> dict:
    """An arm's time over the whole grid from its measured twins (see the module docstring).
    kind c1 / c2: every configuration to the end; c3: every configuration to its rung (c2's twin's
    per-step time, the rung's evaluations, park), the kept ones on to the end (resume)."""
    tot = dict.fromkeys(("setup_s", "train_s", "eval_s", "park_s", "tokens", "samples"), 0.0)
    tot.update(configs_full=0, configs_rung=0, twins={})
    for m in meta:
        p, twin = _pair(arm, m["bs"], m["rank"])
        if twin:
            tot["twins"][f"{m['bs']},{m['rank']}"] = twin
        step_s = p["train_s"] / p["steps"]
        full = kind != "c3" or m["job"] in (keep or []) or m["rung"] >= m["total"]
        steps = m["total"] if full else m["rung"]
        tot["train_s"] += steps * step_s
        tot["tokens"] += m["tokens_total"] if full else m["tokens_rung"]
        tot["samples"] += steps * m["bs"]
        tot["configs_full" if full else "configs_rung"] += 1
        evals = m["evals_full"] if kind != "c3" else m["evals_rung"] + (m["evals_rest"] if full else [])
        tot["eval_s"] += sum(_eval_time(arm, s) for s in evals)
        tot["setup_s"] += p["setup_s"] + (p["teardown_s"] if full else 0.0)
        if kind == "c3" and m["rung"] < m["total"]:
            pr = arm["park_resume"][str(m["rank"])]
            tot["park_s"] += pr["park_s"] + (pr["resume_s"] if full else 0.0)
    fu = arm["first_use"]
    warm, _ = _pair(arm, fu["bs"], fu["rank"])
    tot["first_use_s"] = max(0.0, fu["seconds"] - fu["steps"] * warm["train_s"] / warm["steps"]
                             - _eval_time(arm, fu["eval_size"]))
    tot["load_s"] = arm["load_s"]
    tot["total_s"] = sum(tot[k] for k in ("load_s", "first_use_s", "setup_s", "train_s", "eval_s", "park_s"))
    tot["train_tok_s"] = tot["tokens"] / tot["train_s"]
    tot["mfu"] = 6 * arm["n_backbone"] * tot["train_tok_s"] / bl.PEAK_FLOPS
    tot["e2e_tok_s"] = tot["tokens"] / tot["total_s"]
    return tot


def _estimate(meta: list[dict], arm: dict, kind: str, keep: list[str] | None = None) -> dict | str:
    try:
        return estimate(meta, arm, kind, keep)
    except KeyError as exc:  # a batch size no call measured
        return f"incomplete: {exc}"


# ----------------------------------------------------------------------------- report
def merge(files: list[str]) -> str:
    runs = [(f, json.loads(Path(f).read_text())) for f in files]
    quality: dict[str, dict[int, dict]] = {}
    timing: dict[int, dict[str, Any]] = {}
    for f, r in runs:
        shape = r["args"].get("small_shape", SMALL_SHAPE)
        quality.setdefault(shape, {}).update({int(s): q for s, q in r.get("quality", {}).items()})
        tm = r.get("timing")
        if tm:
            slot = timing.setdefault(tm["layers"], {"meta": tm["jobs"], "arms": {}, "checks": []})
            slot["checks"].append((f, r["env"]["gpu"], tm.get("check")))
            for a in ("c1", "c2"):
                if isinstance(tm.get(a), dict) and "pairs" in tm[a]:
                    slot["arms"][a] = {**tm[a], "file": f, "device": r["env"]["gpu"]}
            slot.setdefault("exec", {}).update(executor_runs(tm, f, r["env"]["gpu"]))
            slot.setdefault("repeats", []).append(call_ratios(f, r))
    return render(runs, quality, timing)


def call_ratios(file: str, r: dict) -> dict:
    """One call's own (a) and baselines at its depth, each ratio within that call (the merged
    table takes each arm from the last call that timed it; this keeps every call's side-by-side)."""
    tm = r["timing"]
    out: dict[str, Any] = {"file": Path(file).name, "device": r["env"]["gpu"]}
    if isinstance(tm.get("a"), dict) and "wall_outer_s" in tm["a"]:
        out["a"] = tm["a"]["wall_outer_s"]
    keep = ((r.get("quality", {}).get(str(tm.get("seed", 0))) or {}).get("c3") or {}).get("keep")
    for name, arm, kind in (("c1", "c1", "c1"), ("c2", "c2", "c2"), ("c3", "c2", "c3")):
        a = tm.get(arm)
        if not (isinstance(a, dict) and "pairs" in a) or (kind == "c3" and ("park_resume" not in a or keep is None)):
            continue
        e = _estimate(tm["jobs"], a, kind, keep if kind == "c3" else None)
        if not isinstance(e, str):
            out[name] = e["total_s"]
            out[f"{name}_measured"] = f"{len(a['pairs'])} of {len(a['pairs']) + len(a['skipped'])}"
    return out


def render_repeats(repeats: list[dict]) -> list[str]:
    if len(repeats) < 2:
        return []
    out = ["", "Each call at this depth on its own (every ratio within one call; pairs measured / all):", "",
           "| call | device | (a) s | (c1) s | (c2) s | (c3) s | (c1)/(a) | (c2)/(a) | (c3)/(a) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for c in repeats:
        a = c.get("a")
        cells = [f"{c[k]:.1f} ({c[k + '_measured']})" if k in c else "-" for k in ("c1", "c2", "c3")]
        ratios = [_ratio(c[k], a) if k in c and a else "-" for k in ("c1", "c2", "c3")]
        out.append(f"| {c['file']} | {c['device']} | {_fmt(a)} | " + " | ".join(cells + ratios) + " |")
    return out


def _ratio(x: float, ref: float | None) -> str:
    return f"{x / ref:.2f}x" if ref else "-"


def executor_runs(tm: dict, file: str, device: str) -> dict:
    """(a) and (b) at the large shape, timed whole through the real executor."""
    return {a: {**tm[a], "file": file, "device": device} for a in ("a", "b")
            if isinstance(tm.get(a), dict) and "wall_outer_s" in tm[a]}


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def render(runs: list, quality: dict, timing: dict) -> str:
    first = runs[0][1]["args"]
    lines = ["# Sequential baselines (issue 33): c1, c2, c3 beside loraplex's executor", "",
             "Calls merged (each arm at each depth timed in the call named):", "",
             "| file | device | torch / transformers / peft | phase | arms | layers | configs | seeds (quality model WxD) | Liger | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for f, r in runs:
        a, e = r["args"], r["env"]
        lines.append(f"| {Path(f).name} | {e['gpu']} | {e['torch']} / {e['transformers']} / {e['peft']} | "
                     f"{a['phase']} | {a['arms']} | {a['layers'] if a['phase'] != 'quality' else '-'} | "
                     f"{a['configs']} | {a['seed']}{'' if a['phase'] == 'timing' else ' (' + a.get('small_shape', SMALL_SHAPE) + ')'} | {r.get('liger', '?')} | {_fmt(r.get('wall_s'))} |")
    lines += ["", f"Task: task_e2e's synthetic Markov language, {first['n_train']} training / {first['n_val']} "
              f"validation samples, max_seq_len {first['seq']}, evaluation every {first['eval_every_samples']} "
              "samples and at the end on the executor's evaluation policy (EvalSettings: sizes by samples "
              "trained, leading subset of one shuffled order); one epoch per configuration; early-exit "
              "defaults (warmup 5% of a job's steps, keep 25%)."]
    for layers in sorted(timing):
        lines += render_timing(layers, timing[layers], quality.get(SMALL_SHAPE, {}))
    for shape in sorted(quality, key=lambda s: s != SMALL_SHAPE):
        lines += render_quality(quality[shape], shape)
    lines += render_checks(quality, timing)
    lines += NOTES
    return "\n".join(lines) + "\n"


def _sum_opt(r: dict, *keys: str) -> float | None:
    """Sum of the keys a run reported (older runs lack the finer phases: None)."""
    vals = [r[k] for k in keys if k in r]
    return sum(vals) if vals else None


def render_timing(layers: int, slot: dict, quality: dict) -> list[str]:
    meta, arms, runs = slot["meta"], slot["arms"], slot.get("exec", {})
    out = ["", f"## Time to the best adapter, Llama-3.1-8B shape, {layers} layers", "",
           "| arm | total s | x (a) | load | first use | PEFT attach/detach | park/resume | train | eval | "
           "configs full + rung only | samples | train tokens | train tok/s | MFU (train) | tok/s end to end | measured in |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ref = runs["a"]["wall_outer_s"] if "a" in runs else None
    n_backbone = next((a["n_backbone"] for a in arms.values() if "n_backbone" in a), None)
    for key, name in (("a", "(a) loraplex executor, early exit"), ("b", "(b) loraplex executor, no early exit")):
        if key not in runs:
            continue
        r = runs[key]
        st = list(r["statuses"].values()) if isinstance(r.get("statuses"), dict) else []
        full = sum(1 for v in st if str(v).startswith("completed"))
        # tokens as the baselines count them (every token of every sample of the steps trained)
        tokens = sum(sum(m["step_tokens"][:r["job_steps"].get(m["job"], 0)]) for m in meta)
        tok_s = tokens / r["train_s"] if r.get("train_s") else math.nan
        mfu = 6 * n_backbone * tok_s / bl.PEAK_FLOPS if n_backbone else math.nan
        out.append(f"| {name} | {r['wall_outer_s']:.1f} | {_ratio(r['wall_outer_s'], ref)} | {r['load_s']:.1f} | "
                   f"{r['profile_s']:.1f} (memory profile) | {_fmt(r.get('init_s'))} (adapter init) | "
                   f"{_fmt(_sum_opt(r, 'park_s', 'resume_s'))} | {r['train_s']:.1f} | {r['eval_s']:.1f} | "
                   f"{full} + {len(st) - full} | {int(r['samples'])} | {tokens} | {tok_s:,.0f} | "
                   f"{_fmt(mfu * 100)}% | {tokens / r['wall_outer_s']:,.0f} | {Path(r['file']).name} ({r['device']}) |")
    notes = []
    for key, r in runs.items():
        notes.append(f"\n({key}): {r['steps']} engine steps, at most {r['max_total_batch']} sequences a step, "
                   f"recompute {r.get('recompute', '?')} ({r.get('no_recompute_steps', '?')} steps without), "
                   f"first step at {_fmt(r.get('first_step_s'))} s, replayed losses missing {r['missing_trace_points']}, "
                   f"other admission (bookkeeping, arena copies) {_fmt(r.get('admit_s'))} s, checkpoints "
                   f"{_fmt(r.get('checkpoint_s'))} s, exports {_fmt(r.get('export_s'))} s"
                   + (f", decisions equal the small model's: {r['decisions_match_small']}"
                      if "decisions_match_small" in r else ""))
    rows = []
    if "c1" in arms:
        rows.append(("(c1) PEFT, padded, one at a time", _estimate(meta, arms["c1"], "c1"), arms["c1"]))
    if "c2" in arms:
        rows.append(("(c2) PEFT packed + varlen + Liger + fused AdamW", _estimate(meta, arms["c2"], "c2"), arms["c2"]))
        for seed in sorted(quality):
            keep = (quality[seed].get("c3") or {}).get("keep")
            if keep is not None and "park_resume" in arms["c2"]:
                rows.append((f"(c3) (c2) + successive halving, seed {seed} decisions",
                             _estimate(meta, arms["c2"], "c3", keep), arms["c2"]))
    for name, e, a in rows:
        if isinstance(e, str):
            out.append(f"| {name} | {e} |" + " |" * 14)
            continue
        out.append(f"| {name} | {e['total_s']:.1f} | {_ratio(e['total_s'], ref)} | {e['load_s']:.1f} | {e['first_use_s']:.1f} | {e['setup_s']:.1f} | "
                   f"{e['park_s']:.1f} | {e['train_s']:.1f} | {e['eval_s']:.1f} | {e['configs_full']} + {e['configs_rung']} | "
                   f"{int(e['samples'])} | {int(e['tokens'])} | {e['train_tok_s']:,.0f} | {e['mfu']:.1%} | "
                   f"{e['e2e_tok_s']:,.0f} | {Path(a['file']).name} ({a['device']}) |")
    out += notes
    out += render_repeats(slot.get("repeats", []))
    for name, a in arms.items():
        ck = a.get("checkpointing")
        ck = (json.dumps({k: v["checkpointing"] for k, v in ck.items()}) if ck else
              "always (c1 as today)" if name == "c1" else "off (no probe off CUDA)")
        out.append(f"\n{name}: load {a['load_s']:.1f} s, attention {a['setup']['attention']}, Liger: {a.get('liger')}, "
                   f"activation checkpointing by batch size {ck}"
                   f"; measured (batch size, rank): {', '.join(a['pairs'])}"
                   + (f"; not measured (deadline: twin = nearest rank): {', '.join(a['skipped'])}" if a["skipped"] else ""))
    return out


def render_quality(quality: dict, shape: str = SMALL_SHAPE) -> list[str]:
    if not quality:
        return []
    seeds = sorted(quality)
    width, depth = shape.split("x")
    out = ["", f"## Quality: best validation loss of each arm (small Llama, {depth} layers x {width} wide, "
           f"seeds {', '.join(map(str, seeds))})", "",
           "| arm | best val, mean over seeds | ratio to (b), mean | per seed (best / ratio) | best configuration, seed "
           f"{seeds[0]} | samples trained, seed {seeds[0]} | per-configuration best val vs (b): median / max abs delta |",
           "|---|---|---|---|---|---|---|"]
    names = {"b": "(b) loraplex, no early exit", "a": "(a) loraplex, early exit", "c1": "(c1) PEFT one at a time",
             "c2": "(c2) strong sequential", "c3": "(c3) (c2) + successive halving"}
    for k, label in names.items():
        got = [(s, quality[s][k]) for s in seeds if quality[s].get(k)]
        if not got:
            continue
        bests = [q["best"] for _, q in got]
        ratios = [q["best"] / quality[s]["b"]["best"] for s, q in got]
        q0 = got[0][1]
        d = q0.get("vs_b_abs_delta")
        out.append(f"| {label} | {statistics.fmean(bests):.4f} | {statistics.fmean(ratios):.4f} | "
                   + "; ".join(f"{s}: {q['best']:.4f} / {r:.4f}" for (s, q), r in zip(got, ratios, strict=True))
                   + f" | {q0['best_job']} | {int(q0['samples'])} | "
                   + (f"{d['median']:.4f} / {d['max']:.4f}" if d else "-") + " |")
    for s in seeds:
        c3 = quality[s].get("c3")
        if c3:
            out.append(f"\nseed {s}: c3 kept {', '.join(c3['keep'])}; (a)'s ranking kept "
                       f"{', '.join(quality[s]['a'].get('keep') or [])} (same set: {c3['keep_same_as_a']}); "
                       f"c3 survivors' validation losses vs c2's at the same steps, max |delta|: {_fmt(c3.get('survivors_vs_c2_max_abs_delta'), '.2e')}")
    return out


def render_checks(quality: dict, timing: dict) -> list[str]:
    out = ["", "## Step 0: the baselines' loss equals loraplex's engine's (same configuration, same batch)", "",
           "| where | configuration | tokens | engine | c1 | c2 | engine, B != 0 | c1, B != 0 | c2, B != 0 | agree |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    items = [(f"small model {shape}, seed {s}", q.get("check"))
             for shape, by_seed in sorted(quality.items()) for s, q in sorted(by_seed.items())]
    items += [(f"{layers} layers, {f} ({gpu})", c) for layers, slot in sorted(timing.items()) for f, gpu, c in slot["checks"]]
    for where, c in items:
        if not c:
            continue
        out.append(f"| {where} | {c['job']} | {c['tokens']} | " + " | ".join(
            _fmt(c.get(k), ".6f") for k in ("engine", "c1", "c2", "engine_lora", "c1_lora", "c2_lora"))
            + f" | {'yes' if c['ok'] else 'NO'} (tolerance {'1e-4' if c['fp32'] else '1e-2 x loss'}) |")
    return out


NOTES = ["", "## How these numbers are made", "",
         "- Time of an arm = model load (weights to the device, data tokenised, the arm's patches) + one-time "
         "first-use costs (a warm-up configuration's 3 steps and one evaluation, minus their steady-state time) "
         "+ per configuration: PEFT attach (get_peft_model, init, optimizer) and detach (unload), its training "
         "steps, its evaluations, and for (c3) parking its state on the host and resuming it. Not counted: "
         "c2's one-off probe of which batch sizes need activation checkpointing (a practitioner's trial run).",
         "- Measured at the large shape: ONE configuration per (batch size, rank) of the grid, trained whole "
         "(all its steps, evaluations, attach/detach); every other configuration of that batch size and rank "
         "costs the same (one epoch of the same examples in its own order: the same steps, tokens and "
         "evaluations). Evaluation seconds per evaluation size are the medians of the measured ones. (c3) "
         "replays the quality phase's decisions (its real successive-halving run on the small model): every "
         "configuration's rung steps at its twin's mean step time, the rung and later evaluations by the "
         "policy, park/resume measured per rank. Extrapolated, as bench/task_e2e.py does for its PEFT arm.",
         "- Train tok/s = real (non-pad) tokens of the training steps / seconds of training steps; "
         "MFU = 6 x N x tokens / seconds / 989e12 with N = the backbone's matmul parameters (decoder "
         "linears + LM head, embeddings excluded), the conventional count for every arm alike: recomputed "
         "activations (checkpointing) and LoRA's own FLOPs are not counted.",
         "- Quality: the small Llama pretrained on chain A learns chain B through every arm from the engine's "
         "adapter init (JobAdapter, the job's seed), in each job's data order, with its AdamW and linear "
         "schedule; (a) and (b) are loraplex's executor on the same files. c1/c2 evaluate with the "
         "executor's policy; c3 adds the rung evaluation (a)'s ranking makes. Differences from (b) per "
         "configuration come from numerics (bf16, kernels) and from the engine skipping non-finite updates "
         "(the diverging end), which PEFT does not.",
         "- c1 differs from bench/task_e2e.py's peft_job only in using the job's own AdamW settings "
         "(weight decay 0: peft_job left torch's default 0.01) and reporting the token-mean validation loss."]


# ----------------------------------------------------------------------------- main
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="a,b,c1,c2,c3")
    ap.add_argument("--quality-arms", default=None,
                    help="baseline arms the quality phase runs on the small model (default: --arms)")
    ap.add_argument("--phase", choices=("both", "quality", "timing"), default="both")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--configs", type=int, choices=(32, 48), default=48)
    ap.add_argument("--seed", default="0", help="comma-separated quality seeds; timing uses the first")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--n-train", type=int, default=128)
    ap.add_argument("--n-val", type=int, default=64)
    ap.add_argument("--eval-every-samples", type=int, default=64)
    ap.add_argument("--pretrain-steps", type=int, default=300)
    ap.add_argument("--small-shape", default=SMALL_SHAPE,
                    help="quality model WIDTHxDEPTH (a second size shows the decisions hold)")
    ap.add_argument("--deadline-s", type=float, default=560.0, help="measure nothing new after this")
    ap.add_argument("--reserve-s", type=float, default=45.0, help="seconds kept free before the deadline")
    ap.add_argument("--no-liger", dest="liger", action="store_false")
    ap.add_argument("--liger-wheels", default=str(bl.REPO / ".whl"))
    ap.add_argument("--work", default="/tmp/task_e2e_baselines")
    ap.add_argument("--json", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--merge", nargs="+", default=None, help="JSON files of earlier calls -> --out")
    ap.add_argument("--smoke", action="store_true", help="CPU, toy sizes: every arm, asserts step 0")
    args = ap.parse_args(argv)
    args.seeds = [int(s) for s in str(args.seed).split(",")]
    if args.smoke:
        args.layers, args.seq, args.n_train, args.n_val = 2, 96, 16, 8
        args.eval_every_samples, args.pretrain_steps = 8, 5
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.merge:
        text = merge(args.merge)
        if args.out:
            Path(args.out).write_text(text)
        print(text)
        return
    te.SMOKE["on"] = args.smoke
    if args.smoke:
        torch.set_num_threads(1)
    arms = [a for a in args.arms.split(",") if a]
    if set(arms) - set(ARMS):
        raise SystemExit(f"--arms: {sorted(set(arms) - set(ARMS))} unknown; choose from {ARMS}")
    root = Path(args.work)
    marker = root / ".task_e2e_baselines"
    if root.exists() and (marker.exists() or not any(root.iterdir())):
        shutil.rmtree(root)  # our own scratch of an earlier call: the executor would resume it
    elif root.exists():
        raise SystemExit(f"--work {root} exists and is not this script's scratch directory")
    root.mkdir(parents=True)
    marker.touch()
    liger = bl.load_liger(DEV, Path(args.liger_wheels), args.liger)
    log("Liger:", liger)
    res: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "merge"},
                           "env": bl.env_versions(), "liger": liger, "quality": {}}

    def dump() -> None:
        res["liger"] = bl.LIGER["status"]
        res["wall_s"] = time.perf_counter() - te.T0
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1, default=str))

    tok = te.make_tokenizer()
    if args.phase in ("both", "quality"):
        for seed in args.seeds:
            if seed != args.seeds[0] and left(args) < args.reserve_s + 120:
                log("deadline: quality seed", seed, "not run")
                continue
            q_arms = arms if args.quality_arms is None else [a for a in args.quality_arms.split(",") if a]
            res["quality"][str(seed)] = quality(args, root / f"seed{seed}", tok, seed, q_arms)
            dump()
    if args.phase in ("both", "timing"):
        timing(args, root / f"seed{args.seeds[0]}", tok, arms, res, dump)
    dump()
    if args.smoke:
        smoke_asserts(res, arms)
    text = merge_one(res)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    log("done")


def merge_one(res: dict) -> str:
    quality = {res["args"].get("small_shape", SMALL_SHAPE): {int(s): q for s, q in res.get("quality", {}).items()}}
    timing = {}
    tm = res.get("timing")
    if tm:
        timing[tm["layers"]] = {"meta": tm["jobs"], "checks": [("this call", res["env"]["gpu"], tm.get("check"))],
                                "arms": {a: {**tm[a], "file": "this call", "device": res["env"]["gpu"]}
                                         for a in ("c1", "c2") if isinstance(tm.get(a), dict) and "pairs" in tm[a]},
                             "exec": executor_runs(tm, "this call", res["env"]["gpu"])}
    return render([("this call", res)], quality, timing)


def smoke_asserts(res: dict, arms: list[str]) -> None:
    checks = [q["check"] for q in res["quality"].values()] + ([res["timing"]["check"]] if "timing" in res else [])
    for c in checks:
        assert c["ok"], c["verdict"]
        assert abs(c["engine_lora"] - c["engine"]) > 1e-4, "the perturbed adapter must change the loss"
    for q in res["quality"].values():
        for a in arms:
            assert math.isfinite(q[a]["best"]), (a, q[a])
        if "c3" in arms:
            assert len(q["c3"]["keep"]) == math.ceil(0.25 * q["jobs"] - 1e-9)
    print("smoke: step-0 agreement and every arm's results OK", flush=True)


if __name__ == "__main__":
    main()
