"""Where the end-of-task samples' time goes (issue 44: 3 adapters + base, 8 prompts, 128 new
tokens at 32 layers of the 8B shape must add at most 10 s to a task).

On a Llama-3.1-8B-shaped model with random bf16 weights and `--layers` layers, 3 adapters of rank
16/32/64 (B made non-zero, so the LoRA paths do real work) attached to the engine, 8 prompts of
~200 tokens: `trainer.sampling.generate` for the 32 rows (base + 3 adapters x 8 prompts) with no
EOS (every row decodes `--new` tokens), timed whole; then the same for the base model's 8 rows alone
(no LoRA: what the backbone's decode costs); then a profile of a few decode steps (host wall per
step, kernel time per step, launches per step). Greedy rows are checked to repeat exactly.

    python bench/samples_decode.py [--layers 32] [--new 128] [--out FILE.md]
    python bench/samples_decode.py --smoke     # CPU, toy sizes: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import task_e2e_data as te  # noqa: E402

from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402
from trainer.sampling import generate  # noqa: E402
from worker.processes import CUBLAS_WORKSPACE  # noqa: E402


def timed(fn):  # noqa: ANN001, ANN201
    te.sync()
    t0 = time.perf_counter()
    out = fn()
    te.sync()
    return out, time.perf_counter() - t0


def decode_variant(run, rows, form: str, sdpa: str, new: int, gqa: bool = True) -> dict:  # noqa: ANN001
    """The same rows decoded with the LoRA operator's `form` and the attention backends `sdpa`
    (gqa=False: transformers' SDPA function as it is, LORAPLEX_DECODE_GQA=0): seconds (median of
    2 after a warm-up), ms per step, and the GPU's top kernels over 8 steps."""
    from kernels.multilora import set_default_form

    set_default_form(form)
    os.environ["LORAPLEX_DECODE_SDPA"] = sdpa
    os.environ["LORAPLEX_DECODE_GQA"] = "1" if gqa else "0"
    try:
        run(rows[:4])
        times = sorted(timed(lambda: run(rows))[1] for _ in range(2))
        out = {"generate_s": round(times[0], 3), "ms_per_step": round(1e3 * times[0] / new, 2)}
        if te.DEV.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                timed(lambda: run(rows))
            events = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
            total = sum(e.self_device_time_total for e in events)
            out["gpu_ms_per_step"] = round(total / 1e3 / new, 2)
            out["top"] = [(e.key[:70], e.count, round(e.self_device_time_total / 1e3 / new, 3)) for e in events[:10]]
        return out
    finally:
        os.environ.pop("LORAPLEX_DECODE_SDPA", None)
        os.environ.pop("LORAPLEX_DECODE_GQA", None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--work", default="/tmp/samples_decode")
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--variants", default="",
                    help="after the default decode, the same rows per FORM:SDPA[:nogqa] (comma list, e.g. "
                         "compose:math,fused:efficient,fused:math:nogqa): the LoRA operator's form, the decode's "
                         "attention backends (LORAPLEX_DECODE_SDPA) and, with nogqa, transformers' SDPA "
                         "function as it is (LORAPLEX_DECODE_GQA=0), each timed and profiled")
    ap.add_argument("--model", default="", help="an existing model directory (not written again)")
    ap.add_argument("--skip-eager", action="store_true", help="no eager-loop comparison (saves its minutes)")
    ap.add_argument("--no-repeatable", action="store_true",
                    help="leave cuBLAS's workspace to torch (a node sets CUBLAS_WORKSPACE_CONFIG for its "
                         "processes: trainer.sampling.repeatable); set before the first cuBLAS call")
    args = ap.parse_args()
    if args.no_repeatable:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:  # as worker.processes.spawn does for every GPU process of a node
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if args.smoke:
        te.SMOKE["on"] = True
        args.layers, args.new, args.prompt_len = 2, 4, 12
    from transformers import AutoModelForCausalLM

    if args.model:  # a model another bench of the call wrote (its shape: --layers is its own)
        model_dir = Path(args.model)
    else:
        root = Path(args.work)
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        model_dir = te.large_model(root / "model", args.layers, te.make_tokenizer())
    dtype = torch.bfloat16 if te.DEV.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(te.DEV)
    vocab = model.config.vocab_size
    engine = MultiLoraEngine(model, [], 0, gradient_checkpointing=True)
    names = []
    for i, rank in enumerate((16, 32, 64)):
        name = f"a{rank}"
        engine.attach(TrainJob(name, lora_rank=rank, lora_alpha=2.0 * rank, max_steps=1, seed=i))
        with torch.no_grad():  # a trained adapter's B is not zero: the LoRA paths do real work
            for _, _, b in engine.jobs[name].adapter.pairs():
                b.normal_(0, 0.02)
        names.append(name)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(8)]
    columns = [None, *names]
    rows = [(p, c) for p in prompts for c in columns]

    def run(rows, static=True):  # noqa: ANN001, ANN202
        return generate(engine, [p for p, _ in rows], [c for _, c in rows], max_new_tokens=args.new,
                        eos_token_id=None, pad_id=0, static=static)

    run(rows[:4])  # warm-up: kernels, allocator
    first, all_s = timed(lambda: run(rows))
    again, _ = timed(lambda: run(rows))
    eager = eager_again = None
    eager_s = float("nan")
    if not args.skip_eager:
        run(rows[:4], static=False)
        eager, eager_s = timed(lambda: run(rows, static=False))
        eager_again, _ = timed(lambda: run(rows, static=False))
    base_rows = [(p, None) for p in prompts]
    _, base_s = timed(lambda: run(base_rows))
    steps = {}
    if te.DEV.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _, prof_s = timed(lambda: generate(engine, [p for p, _ in rows], [c for _, c in rows],
                                               max_new_tokens=8, eos_token_id=None, pad_id=0))
        events = prof.key_averages()
        kernel_us = sum(e.self_device_time_total for e in events)
        launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
        steps = {"profiled_new_tokens": 8, "wall_s": prof_s, "kernel_s": kernel_us / 1e6, "launches": launches,
                 "top": [(e.key, e.count, round(e.self_device_time_total / 1e3, 1))
                         for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]]}
    seeded = [generate(engine, [p for p, _ in rows], [c for _, c in rows], max_new_tokens=args.new,
                       eos_token_id=None, pad_id=0, temperature=1.0, top_p=0.9, seed=7) for _ in range(2)]
    variants = {}  # last: each sets the process's LoRA form, which the runs above leave at the default
    for spec in [v for v in args.variants.split(",") if v]:
        form, sdpa, *rest = spec.split(":")
        variants[spec] = decode_variant(run, rows, form, sdpa, args.new, gqa=rest != ["nogqa"])
    res = {"args": vars(args), "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
           "device": torch.cuda.get_device_name() if te.DEV.type == "cuda" else "cpu",
           "seeded_sampling_repeats_exactly": seeded[0] == seeded[1],
           "rows": len(rows), "new_tokens": sum(len(t) for t in first), "generate_s": all_s,
           "per_decode_step_ms": 1e3 * all_s / args.new, "base_only_8_rows_s": base_s,
           "repeats_exactly": first == again, "eager_generate_s": eager_s, "eager_repeats_exactly": None if eager is None else eager == eager_again,
           "rows_equal_to_eager": None if eager is None else sum(a == b for a, b in zip(first, eager, strict=True)),
           "profile": steps,
           "variants": variants}
    text = "\n".join([
        f"# End-of-task samples' decode at {args.layers} layers ({res['device']})", "",
        "Llama-3.1-8B shape, random bf16 weights; 3 adapters (ranks 16/32/64, B non-zero) + base, 8 prompts of "
        f"{args.prompt_len} tokens, {args.new} new tokens, no EOS, greedy. `python bench/samples_decode.py "
        + " ".join(sys.argv[1:]) + "`.", "",
        "| decode | rows | new tokens | generate s | ms per decode step | base alone (8 rows) s | repeats exactly |",
        "|---|---|---|---|---|---|---|",
        f"| static cache, graphed steps (the default on CUDA) | {res['rows']} | {res['new_tokens']} | {all_s:.2f} | "
        f"{res['per_decode_step_ms']:.1f} | {base_s:.2f} | {res['repeats_exactly']} |",
        f"| eager, dynamic cache (before) | {res['rows']} | {res['new_tokens']} | {eager_s:.2f} | "
        f"{1e3 * eager_s / args.new:.1f} | | {res['eager_repeats_exactly']} |", "",
        f"Rows whose greedy tokens equal the eager loop's (bf16, random weights: near-ties may flip): "
        f"{res['rows_equal_to_eager']} of {res['rows']}.", "",
        f"Seeded sampling (temperature 1, top-p 0.9) repeats exactly: {res['seeded_sampling_repeats_exactly']}. "
        f"CUBLAS_WORKSPACE_CONFIG: {res['cublas_workspace']}.", "",
        "Profile of 8 new tokens (static path): " + json.dumps(steps), "",
        *[f"Variant {k}: {json.dumps(v)}" for k, v in variants.items()]]) + "\n"
    te.emit(text, res, args)


if __name__ == "__main__":
    main()
