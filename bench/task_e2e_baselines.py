"""Issue 33's sequential baselines beside bench/task_e2e.py's executor arms: (c1) plain PEFT one
configuration at a time, (c2) PEFT with padding-free packing, varlen flash attention, Liger and
fused AdamW, (c3) (c2) under successive halving with loraplex's warmup-ranking rung (see
bench/baselines.py), on task_e2e's data, tokenizer, evaluation policy and quality model.

Two phases, in one device call or in several (their JSON files are merged into one table):
  quality  per --seed: the small Llama pretrained on chain A (task_e2e_data.small_model), then
           the grid through loraplex's executor without (b) and with (a) early exit
           (task_e2e_runs.run_small), and through c1, c2 and c3 for real: best validation loss of
           every arm, its ratio to (b)'s, c3's decisions; the step-0 check (engine vs c1 vs c2 on
           one batch).
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
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import baselines as bl  # noqa: E402
from baselines_liger import LIGER, REPO, load_liger  # noqa: E402
from task_e2e_baselines_quality import quality  # noqa: E402
from task_e2e_baselines_report import merge, merge_one  # noqa: E402
from task_e2e_baselines_setup import SMALL_SHAPE, left  # noqa: E402
from task_e2e_baselines_timing import timing  # noqa: E402
from task_e2e_data import DEV, SMOKE, T0, log, make_tokenizer  # noqa: E402

from trainer import step_graphs, task_eval  # noqa: E402
from worker.processes import CUBLAS_WORKSPACE  # noqa: E402

ARMS = ("a", "b", "c1", "c2", "c3")


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
    ap.add_argument("--liger-wheels", default=str(REPO / ".whl"))
    ap.add_argument("--work", default="/tmp/task_e2e_baselines")
    ap.add_argument("--write-buffer-gb", type=float, default=None,
                    help="ExecutorConfig.write_buffer_bytes of (a) and (b), in GiB (default: the product's): "
                    "the snapshots the writer may hold before the loop waits")
    ap.add_argument("--train-while-waiting", action="store_true",
                    help="EarlyExitSettings.train_while_waiting: jobs waiting for the ranking train on "
                    "(the product's default until session 42) rather than park")
    ap.add_argument("--one-stage-ranking", action="store_true",
                    help="the warmup ranking evaluates every job on its whole subset at once (before session "
                    "43) rather than staged (trainer.task_eval: a lead quarter first)")
    ap.add_argument("--capture-transient", action="store_true",
                    help="capture a training key at its job set's last step too (before session 43; "
                    "trainer.step_graphs.TRANSIENT_MIN_TOKENS)")
    ap.add_argument("--bare-env", action="store_true",
                    help="leave CUBLAS_WORKSPACE_CONFIG unset (before session 44): a node sets it for every "
                    "GPU process (worker.processes.spawn), which puts the samples' prefill on SDPA's math "
                    "backend (trainer.sampling.repeatable); unset, torch picked cuDNN's and search (a)'s "
                    "prefill of 4.4k tokens took 1.1-1.7 s where the 60-step task's 5.9k took 0.3 s")
    ap.add_argument("--runs-dir", default="", help="the large runs' executor folders (checkpoints, exports): "
                    "default under --work; e.g. /dev/shm where (a)'s first checkpoint outgrows the disk")
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
    SMOKE["on"] = args.smoke
    if not args.bare_env:  # as worker.processes.spawn gives every GPU process of a node (before any cuBLAS call)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if args.one_stage_ranking:  # every executor of this process (both phases): no ranking subset is staged
        task_eval.LEAD_MIN_SUBSET = 1 << 30
    if args.capture_transient:
        step_graphs.TRANSIENT_MIN_TOKENS = 1 << 62
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
    liger = load_liger(DEV, Path(args.liger_wheels), args.liger)
    log("Liger:", liger)
    res: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "merge"},
                           "env": bl.env_versions(), "liger": liger, "quality": {}}

    def dump() -> None:
        res["liger"] = LIGER["status"]
        res["wall_s"] = time.perf_counter() - T0
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1, default=str))

    tok = make_tokenizer()
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


def smoke_asserts(res: dict, arms: list[str]) -> None:
    checks = [q["check"] for q in res["quality"].values()] + ([res["timing"]["check"]] if "timing" in res else [])
    for c in checks:
        assert c["ok"] or not c["verdict"], c["verdict"]  # no verdict: no baseline arm to compare
        assert abs(c["engine_lora"] - c["engine"]) > 1e-4, "the perturbed adapter must change the loss"
    for q in res["quality"].values():
        for a in [a for a in arms if a in q]:  # the quality phase's arms (--quality-arms; b and a always)
            assert math.isfinite(q[a]["best"]), (a, q[a])
        if "c3" in arms:
            assert len(q["c3"]["keep"]) == math.ceil(0.25 * q["jobs"] - 1e-9)
    print("smoke: step-0 agreement and every arm's results OK", flush=True)


if __name__ == "__main__":
    main()
