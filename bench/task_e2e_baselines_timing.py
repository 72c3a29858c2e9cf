"""The timing phase of bench/task_e2e_baselines.py at the Llama-3.1-8B shape: the step-0 check,
(a) and (b) through the real executor replaying the quality phase's curves, and per baseline arm
the model load, its one-time costs and one configuration per (batch size, rank) trained whole."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import baselines as bl  # noqa: E402
from baselines_liger import LIGER  # noqa: E402
from baselines_policy import EvalPolicy  # noqa: E402
from baselines_runs import ConfigRecord, run_config  # noqa: E402
from task_e2e_baselines_quality import TRACES  # noqa: E402
from task_e2e_baselines_setup import examples, left, load, policies, step0, task  # noqa: E402
from task_e2e_data import DEV, free, large_model, log  # noqa: E402
from task_e2e_runs import large_run  # noqa: E402

from trainer.data import JobDataStream  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402


# ----------------------------------------------------------------------------- timing
def jobs_meta(jobs: list, train: list, pol_b: EvalPolicy, pol_a: EvalPolicy) -> list[dict]:
    """Every configuration's steps, rung, tokens (exact, from its data order) and evaluations."""
    out = []
    for j in jobs:
        total, stream, toks = j.total_steps(len(train)), JobDataStream(len(train), j.seed), []
        for _ in range(total):
            toks.append(sum(len(train[i].input_ids) for i in stream.next_indices(j.batch_size)))
        rung = pol_a.rung(total)
        out.append({"job": j.job_id, "bs": j.batch_size, "rank": j.lora_rank, "lr": j.learning_rate, "total": total,
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
        key = (j.batch_size, j.lora_rank)
        if key not in by or abs(math.log10(j.learning_rate) + 3) < abs(math.log10(by[key].learning_rate) + 3):
            by[key] = j
    ranks = {bs: sorted(r for b, r in by if b == bs) for bs, _ in by}
    first = [by[(bs, rs[len(rs) // 2])] for bs, rs in sorted(ranks.items())]
    return first + [j for k, j in sorted(by.items()) if j not in first]


def probe_checkpointing(model: torch.nn.Module, arm: bl.Arm, jobs: list, train: list, pad: int) -> dict:
    """c2 trains without activation checkpointing where it fits: one forward + backward of each
    batch size's worst micro-batch (its longest examples) at the grid's largest rank, largest
    batch size first; where it runs out of memory, that batch size and larger ones checkpoint."""
    out = {}
    rank = max(j.lora_rank for j in jobs)
    longest = sorted(train, key=lambda e: -len(e.input_ids))
    fits = True
    for bs in sorted({j.batch_size for j in jobs}, reverse=True):
        if fits:
            spec = TrainJob("probe", lora_rank=rank, lora_alpha=2.0 * rank, batch_size=bs)
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


def record_dict(rec: ConfigRecord) -> dict:
    return {"setup_s": rec.setup_s, "train_s": rec.train_s, "eval_s": rec.eval_s,
            "teardown_s": rec.teardown_s, "steps": rec.steps, "tokens": rec.tokens,
            "rung_train_s": rec.rung_train_s, "evals": len(rec.val)}


def park_resume(model: torch.nn.Module, arm: bl.Arm, jobs: list, train: list, pad: int) -> tuple:
    """(c3) per rank: seconds to park a configuration (state to the host, detach) and to resume
    it (attach, state back), after 2 steps of its smallest batch size."""
    out = {}
    for rank in sorted({j.lora_rank for j in jobs}):
        spec = next(j for j in sorted(jobs, key=lambda j: j.batch_size) if j.lora_rank == rank)
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
             pol_b: EvalPolicy, with_park: bool) -> dict:
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
        out.update(load_s=time.perf_counter() - t0, setup=info, liger=LIGER["status"] if arm.liger else "not used")
        if arm.packed and DEV.type == "cuda":
            t1 = time.perf_counter()
            out["checkpointing"] = probe_checkpointing(model, arm, t["jobs"], train, pad)
            out["probe_s"] = time.perf_counter() - t1
        pairs = measured_pairs(t["jobs"])
        warm = max(pairs, key=lambda j: (j.batch_size, -abs(j.lora_rank - 16)))
        run = bl.JobRun(model, warm, arm, train, pad)
        bl.sync(DEV)
        t1 = time.perf_counter()
        for _ in range(min(3, run.total)):
            run.train_step()
        run.evaluate(val)
        bl.sync(DEV)
        out["first_use"] = {"seconds": time.perf_counter() - t1, "steps": min(3, run.total),
                            "bs": warm.batch_size, "rank": warm.lora_rank, "eval_size": len(val)}
        model = run.close()
        durations: dict[str, list[float]] = {}
        for spec in pairs:
            key = f"{spec.batch_size},{spec.lora_rank}"
            if left(args) < args.reserve_s:
                out["skipped"].append(key)
                continue
            try:
                model, rec = run_config(model, spec, arm, train, val, pol_b, pad)
            except torch.cuda.OutOfMemoryError:  # a batch worse than the probe's: checkpoint it
                free()
                arm.checkpointing[spec.batch_size] = True
                out.setdefault("oom_retried", []).append(key)
                model, rec = run_config(model, spec, arm, train, val, pol_b, pad)
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
    large_dir = large_model(root / "large", args.layers, tok)
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
        tm[name] = large_run(name, ee, "auto", args=args, root=root, large_dir=large_dir, data=t["data"],
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
