"""Where an evaluation's time goes (issue 40): the forward of many jobs over one validation subset.

In the 48-configuration search at 32 layers of the Llama-3.1-8B shape (H200, session 22) the
evaluations ran at ~14-19k tokens/s, forward only (28% MFU or less), while the training steps'
forwards ran ~2.5x faster per token. This script builds the engine on `--layers` layers (random
bf16 weights, varlen attention), attaches `--jobs` jobs (ranks 8/16/64 in turn), makes `--examples`
validation samples of ~`--tokens` tokens, and times `evaluate_metrics` as the executor calls it
(`--chunk` examples per forward, at most `--cap` sequences per forward): with the step graphs
(the default engine) and without (eager), beside the backbone's own no-grad forward over the same
packed tokens with no job (the floor), and the top GPU kernels of one evaluation.

    python bench/eval_profile.py [--layers 32] [--jobs 12] [--chunk 16] [--cap 205] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_step import llama8b_config, timed  # noqa: E402
from task_e2e_data import emit  # noqa: E402

from trainer.data import Example  # noqa: E402
from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402
from trainer.packing import pack_flat  # noqa: E402

PEAK_FLOPS = 989e12  # H100/H200 dense bf16


def examples(n: int, tokens: int, vocab: int, seed: int) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(max(8, tokens // 3), tokens * 2, (), generator=g))
        ids = torch.randint(3, vocab, (k,), generator=g).tolist()
        out.append(Example(tuple(ids), tuple([-100] * (k // 4) + ids[k // 4:])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--examples", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=207, help="mean tokens of a sample (the search's: 207)")
    ap.add_argument("--chunk", type=int, default=16, help="examples per forward")
    ap.add_argument("--cap", type=int, default=205, help="sequences per forward at most")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="2 layers of a small config (CPU)")
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = llama8b_config(args.layers) if not args.smoke else LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    val = sorted(examples(args.examples, args.tokens, config.vocab_size, 1), key=lambda e: -len(e.input_ids))
    ranks = (8, 16, 64)
    res: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "args": vars(args)}
    rows = []
    eng = MultiLoraEngine(model, val, 0, gradient_checkpointing=True, attention="varlen", step_graphs=True)
    graphed = eng.step_graphs
    ids = []
    for i in range(args.jobs):
        ids.append(f"j{i}")
        eng.attach(TrainJob(f"j{i}", lora_rank=ranks[i % 3], lora_alpha=2.0 * ranks[i % 3], max_steps=10, seed=i))
    with torch.no_grad():  # trained adapters: B not zero
        for j in ids:
            for _, _, b in eng.jobs[j].adapter.pairs():
                b.normal_(0, 0.02)

    def run() -> dict:
        return eng.evaluate_metrics(val, args.chunk, ids, args.cap)

    toks = args.jobs * sum(len(e.input_ids) for e in val)
    results = {}
    for graphs in (True, False):
        eng.step_graphs = graphed if graphs else None
        results[graphs] = run()  # warm: kernels, captures
        s = timed(run, 0, args.iters)[0]
        rows.append(("engine, step graphs" if graphs else "engine, eager", s, toks,
                     graphed.stats() if graphs and graphed is not None else {}))
    res["loss_agree"] = max(abs(results[True][j]["loss"] - results[False][j]["loss"]) / results[False][j]["loss"]
                            for j in ids)
    if dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        ev = prof.key_averages()
        res["kernel_s"] = sum(e.self_device_time_total for e in ev
                              if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
        res["top"] = [(e.key[:90], e.count, round(e.self_device_time_total / 1e3, 1))
                      for e in sorted(ev, key=lambda e: -e.self_device_time_total)[:15]]
    for j in ids:
        eng.detach(j)
    # the floor: the backbone alone (no job) over the same forwards' packed tokens, no head
    group = max(1, args.cap // args.chunk)
    per_fwd = [val[lo:lo + args.chunk] for lo in range(0, len(val), args.chunk)]
    batches = []
    for jobs_lo in range(0, args.jobs, group):
        n = min(group, args.jobs - jobs_lo)
        for chunk in per_fwd:
            batches.append(pack_flat([chunk] * n, 0, max_len=max(len(e.input_ids) for e in val)))

    @torch.no_grad()
    def floor() -> None:
        for b in batches:
            cu = torch.tensor(b.cu_seqlens, dtype=torch.int32, device=dev)
            longest = int((cu[1:] - cu[:-1]).max())
            model.model(input_ids=b.input_ids.to(dev), position_ids=b.position_ids.to(dev), use_cache=False,
                        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)

    s = timed(floor, 1, args.iters)[0]  # one warm-up run, then synced medians
    rows.append(("backbone alone (no job, no head)", s, args.jobs * sum(len(e.input_ids) for e in val), {}))
    n_params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
    lines = [f"# An evaluation's forwards ({res['device']}, {config.num_hidden_layers} layers of the Llama-3.1-8B shape)", "",
             f"{args.jobs} jobs (ranks 8/16/64), {args.examples} validation samples of ~{args.tokens} tokens, "
             f"{args.chunk} per forward, at most {args.cap} sequences per forward; median of {args.iters} after one "
             f"warm-up. `python bench/eval_profile.py {' '.join(sys.argv[1:])}`", "",
             "| path | seconds | tokens | tokens/s | MFU (2 N tokens) | step graphs |", "|---|---|---|---|---|---|"]
    for name, s, toks, stats in rows:
        lines.append(f"| {name} | {s:.3f} | {toks} | {toks / s:,.0f} | {2 * n_params * toks / s / PEAK_FLOPS:.1%} | "
                     f"{json.dumps(stats)} |")
    lines += ["", f"Graphed and eager losses agree within {res['loss_agree']:.2e} (relative)."]
    if "top" in res:
        lines += ["", f"Eager evaluation, GPU kernels: {res['kernel_s']:.3f} s in all; the top 15 (name, calls, ms):", ""]
        lines += [f"- {k} x{c}: {ms} ms" for k, c, ms in res["top"]]
    res["rows"] = [list(r[:3]) for r in rows]
    emit("\n".join(lines) + "\n", res, args)


if __name__ == "__main__":
    main()
