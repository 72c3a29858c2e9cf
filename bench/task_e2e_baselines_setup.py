"""What every phase of bench/task_e2e_baselines.py shares: task_e2e's task for a seed (data, grid,
evaluation settings), the train and evaluation sets as the executor reads them, the two
evaluation policies, the model load, the deadline, and the step-0 check of the baselines'
losses against loraplex's engine."""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import baselines as bl  # noqa: E402
from baselines_liger import LIGER, liger_failed  # noqa: E402
from baselines_policy import EvalPolicy, grid_for  # noqa: E402
from baselines_runs import check_verdict, step0_losses  # noqa: E402
from task_e2e_data import DEV, T0, chains, free, log, write_data  # noqa: E402
from task_e2e_runs import executor_cfg  # noqa: E402

from trainer.data import read_jsonl, tokenize_all  # noqa: E402

SMALL_SHAPE = "256x4"  # the quality model's WIDTHxDEPTH unless --small-shape says otherwise


def small_shape(args: argparse.Namespace) -> tuple[int, int]:
    width, depth = (int(x) for x in getattr(args, "small_shape", SMALL_SHAPE).lower().split("x"))
    return width, depth


def left(args: argparse.Namespace) -> float:
    return args.deadline_s - (time.perf_counter() - T0)


# ----------------------------------------------------------------------------- data and settings
def task(args: argparse.Namespace, root: Path, seed: int) -> dict[str, Any]:
    """task_e2e's task for this seed: chains(seed) (seed 0: task_e2e's), its files, the grid."""
    root.mkdir(parents=True, exist_ok=True)
    chain_a, chain_b = chains(seed)
    data = write_data(root, chain_b, args.n_train, args.n_val, args.seq)
    cfg = executor_cfg(root, data, root / "unused", [], False, args, None)
    return {"chain_a": chain_a, "data": data, "ev": cfg.settings.eval, "ee": cfg.settings.early_exit,
            "split_seed": cfg.settings.seed, "jobs": grid_for(args.configs, args.n_train, seed)}


def examples(tok: Any, t: dict[str, Any], args: argparse.Namespace) -> tuple[list, list]:
    """Train and evaluation sets as the executor reads them (TaskRun.read): the validation file
    in the split seed's shuffled order, its first eval_max_samples."""
    train = tokenize_all(tok, read_jsonl(t["data"][0]), args.seq)
    val = tokenize_all(tok, read_jsonl(t["data"][1]), args.seq)
    random.Random(t["split_seed"]).shuffle(val)
    cap = t["ev"].eval_max_samples
    return train, (val[:cap] if cap else val)


def policies(t: dict[str, Any], n_val: int, n_train: int) -> tuple[EvalPolicy, EvalPolicy]:
    """(no ranking: (b), c1, c2; with the warmup ranking's rung: (a), c3)."""
    return tuple(EvalPolicy.for_jobs(t["ev"], t["ee"], n_val, t["jobs"], n_train, ranked)
                 for ranked in (False, True))


def load(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map={"": DEV})


# ----------------------------------------------------------------------------- step 0
def check_spec(jobs: list) -> Any:
    return next((j for j in jobs if j.batch_size == 4 and j.learning_rate == 1e-3), jobs[0])


def step0(model_dir: Path, jobs: list, train: list, pad: int, arms: list[str]) -> dict[str, Any]:
    """The step-0 losses of the engine, c1 and c2 (one configuration, one batch); if Liger's
    patched model fails or disagrees, Liger is turned off for this process and it runs again."""
    names = [a for a in ("c1", "c2") if a in arms or (a == "c2" and "c3" in arms)]
    fp32 = DEV.type != "cuda"
    for _ in range(2):
        model = load(model_dir)
        mk = {"c1": bl.c1_arm, "c2": lambda: bl.c2_arm(DEV)}
        try:
            out = step0_losses(model, check_spec(jobs), train, pad, [mk[a]() for a in names])
            error = None
        except Exception as exc:  # noqa: BLE001 - Liger's forward is the one part that may not run here
            out, error = {}, exc
        del model
        free()
        verdict = check_verdict(out, names, fp32)
        liger_bad = "c2" in names and LIGER["module"] is not None and (
            error is not None or not all(v["ok"] for k, v in verdict.items() if k.startswith("c2")))
        if not liger_bad:
            if error is not None:  # recorded, not raised: the call's other measurements go on
                out = {"job": check_spec(jobs).job_id, "tokens": 0, "error": f"{type(error).__name__}: {error}"}
            break
        liger_failed(error or RuntimeError(f"its step-0 losses differ from the engine's: {verdict}"))
        log("Liger off:", LIGER["status"])
    out.update({"verdict": verdict, "ok": bool(verdict) and all(v["ok"] for v in verdict.values()), "fp32": fp32,
                "liger": LIGER["status"]})
    log("step 0", out)
    return out
