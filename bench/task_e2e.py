"""Time to the best adapter, end to end (issue 15): one device run, one table.

A grid of 32 LoRA configurations (ranks 8-64, batch sizes 1-16, learning rates 1e-4..1e-1, the
last one diverging) trained on the same data four ways, each timed from "executor starts" to
"every job finished":
  (a) loraplex's real executor (trainer.executor.Executor) with early exit (default settings),
  (b) the same without early exit,
  (c) one configuration at a time with PEFT and a standard training loop (dynamic padding, the
      same evaluation cadence and data order), timed on one configuration per batch size and
      extrapolated to the grid,
  and the backbone alone on the same packed batches as (b)'s steps (the floor).

Speed is measured on a Llama-3.1-8B-shaped model (width, heads, vocabulary of the real model,
random weights, `--layers` decoder layers); random weights give meaningless loss curves, so the
losses the executor SEES in (a) and (b) at that shape are replayed from a small Llama that really
learns: it is pretrained here on a synthetic Markov-chain language (chain A), then the grid's
LoRA jobs learn a changed chain (B) with the same files, tokenizer, lengths, steps and eval
points through the same executor. Every exit decision, the ranking and the best adapter of the
large runs therefore come from real curves, and the large runs check that they reproduce the
small runs' decisions exactly. Quality (best validation loss of (a) vs (b)) is the small model's.

    python bench/task_e2e.py --out bench/results/task_e2e_h100.md [--layers 4] [--json FILE]
    python bench/task_e2e.py --pack-only   # CPU: shapes and padding only (free, buckets, varlen)

`--pack-only` runs (b)'s executor on the CPU with the backbone replaced by zeros (a toy model
loads; every step and evaluation is packed exactly as on the device, at the admission width of
`--max-total-batch` sequences, the device run's) and reports the distinct [rows, length] shapes
of the backbone forwards (what attention builds plans for) and the padding of training steps.

The task and models are in task_e2e_data.py, the executor runs in task_e2e_runs.py, the floor and
(c) in task_e2e_peft.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import task_e2e_data as te  # noqa: E402
from task_e2e_peft import peft_job  # noqa: E402
from task_e2e_runs import large_run, pack_only, quality  # noqa: E402

from trainer.data import read_jsonl, tokenize_all  # noqa: E402


def main() -> None:  # noqa: PLR0915
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--n-train", type=int, default=128)
    ap.add_argument("--n-val", type=int, default=64)
    ap.add_argument("--eval-every-samples", type=int, default=64)
    ap.add_argument("--pretrain-steps", type=int, default=300)
    ap.add_argument("--floor-steps", type=int, default=24)
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip what is left after this")
    ap.add_argument("--work", default="/tmp/task_e2e")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile-out", default="", help="torch.profiler table of 3 steps of (b)")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (checks the script)")
    ap.add_argument("--speed-only", action="store_true",
                    help="(b) at the large shape with its own losses, the floor and PEFT at batch "
                         "sizes 1 and 16: no quality runs, no (a)")
    ap.add_argument("--pack-only", action="store_true",
                    help="CPU: (b)'s packed shapes and padding only (no model compute)")
    ap.add_argument("--max-total-batch", type=int, default=88,
                    help="--pack-only: sequences per step admitted (the H100 run's at 4 layers)")
    ap.add_argument("--no-shape-buckets", dest="shape_buckets", action="store_false",
                    help="the engine packs steps in free shapes (MultiLoraEngine.shape_buckets=None)")
    ap.add_argument("--attention", choices=("rows", "varlen"), default="rows",
                    help="the engine's packing and attention (MultiLoraEngine.set_attention)")
    ap.add_argument("--compare-attention", action="store_true",
                    help="after (c), (b) again with the other attention (if the deadline allows)")
    ap.add_argument("--sync-writes", dest="async_writes", action="store_false",
                    help="checkpoints and exports written in the step loop (ExecutorConfig.async_writes off)")
    ap.add_argument("--no-cudnn-attention", dest="cudnn_attention", action="store_false",
                    help="the executor turns SDPA's cuDNN backend off (ExecutorConfig.cudnn_attention)")
    args = ap.parse_args()
    te.SMOKE["on"] = args.smoke
    root = Path(args.work)
    root.mkdir(parents=True, exist_ok=True)
    cache = root / "memory_profiles.json"
    cache.unlink(missing_ok=True)
    res: dict[str, Any] = {"args": vars(args),
                           "gpu": torch.cuda.get_device_name() if te.DEV.type == "cuda" else "cpu",
                           "torch": torch.__version__}

    def dump() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1, default=str))

    chain_a, chain_b = te.chains()
    tok = te.make_tokenizer()
    data = te.write_data(root, chain_b, args.n_train, args.n_val, args.seq)
    jobs = te.grid(args.n_train)
    if args.pack_only:
        res["pack_only"] = pack_only(args, root, data, jobs, tok)
        dump()
        return
    trace = None
    if not args.speed_only:
        trace = quality(args, root, tok, chain_a, data, jobs, cache, res, dump)
    run_names = (("b", False),) if args.speed_only else (("b", False), ("a", True))
    peft_sizes = (1, 16) if args.speed_only else sorted({j.batch_size for j in jobs})

    # ---- speed at the large shape: (b) first (it profiles and stores), then (a) (reuses)
    large_dir = te.large_model(root / "large", args.layers, tok)
    te.log("large model saved")
    runs = res["runs"] = {}

    def run_large(name: str, ee: bool, attention: str) -> None:
        runs[name] = large_run(name, ee, attention, args=args, root=root, large_dir=large_dir,
                               data=data, jobs=jobs, trace=trace, cache=cache, res=res)
        dump()

    for name, ee in run_names:
        run_large(name, ee, args.attention)

    # ---- (c) PEFT one configuration at a time: one job per batch size, extrapolated
    from transformers import AutoModelForCausalLM

    te.sync()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(large_dir, dtype=torch.bfloat16, device_map={"": te.DEV})
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    load_s = time.perf_counter() - t0
    train = tokenize_all(tok, read_jsonl(data[0]), args.seq)
    val = tokenize_all(tok, read_jsonl(data[1]), args.seq)[: args.n_val]
    measured = {}
    for bs in peft_sizes:
        if time.perf_counter() - te.T0 > args.deadline_s:
            te.log("deadline: PEFT batch size", bs, "not measured")
            continue
        sample = next(j for j in jobs if j.batch_size == bs and j.lora_rank in (16, 64) and j.learning_rate == 1e-3)
        measured[bs], model = peft_job(model, sample, train, val, args.eval_every_samples)
        te.log("peft", measured[bs])
    extrapolated = load_s + sum(measured[j.batch_size]["seconds"] for j in jobs
                                if j.batch_size in measured)  # speed-only: bs 1 and 16 only
    res["peft"] = {"load_s": load_s, "measured": measured, "grid_s": extrapolated}
    dump()
    del model
    te.free()
    if args.compare_attention:
        # (b) again with the other packing and attention, if the deadline leaves room for it
        other = "varlen" if args.attention == "rows" else "rows"
        if time.perf_counter() - te.T0 + runs["b"]["wall_outer_s"] * 1.2 < args.deadline_s:
            run_large(f"b_{other}", False, other)
        else:
            te.log("deadline: (b) with attention", other, "not run")
    if args.out and not args.speed_only:
        Path(args.out).write_text(render(res))
    te.log("done")


def render(res: dict) -> str:
    a, b, q, p = res["runs"]["a"], res["runs"]["b"], res["quality"], res["peft"]
    lines = [f"device: {res['gpu']}, torch {res['torch']}; settings: {json.dumps(res['args'])}", ""]
    lines.append("| run | wall s | load | profile | train steps | eval | checkpoints | exports | idle |"
                 " first step s | samples |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in (("(a) early exit", a), ("(b) no early exit", b)):
        lines.append(f"| {name} | {r['wall_s']:.1f} | {r['load_s']:.1f} | {r['profile_s']:.1f} | "
                     f"{r['train_s']:.1f} | {r['eval_s']:.1f} | {r['checkpoint_s']:.1f} | "
                     f"{r['export_s']:.1f} | {r['idle_s'] + r['admit_s']:.1f} | {r['first_step_s']:.1f} | "
                     f"{r['samples']} |")
    lines.append(f"| (c) PEFT one at a time (extrapolated) | {p['grid_s']:.1f} | {p['load_s']:.1f} | | | | | | | | "
                 f"{q['samples_b']} |")
    for name, r in (("(a)", a), ("(b)", b)):
        sh = r["attention_shapes"]
        lines.append(f"\n{name}: {sh['total']} distinct backbone-forward shapes ({sh['train']} training, "
                     f"{sh['eval']} evaluation) over {sh['forwards']} forwards; padded cells per step "
                     f"{r['padding']:.1%}")
    for name, r in res["runs"].items():
        if name.startswith("b_"):
            lines.append(f"\n{name}: train steps {r['train_s']:.1f} s vs (b) {b['train_s']:.1f} s; wall "
                         f"{r['wall_s']:.1f} s; floor {r['floor']['engine_s'] / r['floor']['floor_s']:.2f}x; "
                         f"padding {r['padding']:.1%}")
    fl = b["floor"]
    lines.append(f"\nfloor on {fl['steps']} of (b)'s steps: engine {fl['engine_s']:.2f} s vs backbone "
                 f"{fl['floor_s']:.2f} s = {fl['engine_s'] / fl['floor_s']:.2f}x; padding {fl['padding']:.1%}")
    lines.append(f"\nquality: best val (a) {q['best_a']:.4f} ({q['best_job_a']}), (b) {q['best_b']:.4f} "
                 f"({q['best_job_b']}); ratio {q['best_a'] / q['best_b']:.4f}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
