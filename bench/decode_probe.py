"""Which module of the decode's forward gives different bits from run to run (issue 44): greedy
decodes of 32 rows at 32 layers of the Llama-3.1-8B shape (bf16, random weights, 3 adapters + the
base) did not repeat on an H200, eager or graphed, with deterministic algorithms on. This runs the
same prefill (the first forward of `trainer.sampling.generate`, eager loop) twice with a forward hook
on every module, and reports the first module (in call order) whose output differs, the number of
modules that differ, and the logits' largest difference. Diagnostic: no result table.

    python bench/decode_probe.py [--layers 32] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_step import llama8b_config  # noqa: E402
from task_e2e_data import emit  # noqa: E402

from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402
from trainer.sampling import generate  # noqa: E402


def three_adapters(config, dev: torch.device, prompt_len: int):  # noqa: ANN001, ANN201
    """A model of `config` (random weights; bf16 on CUDA) on `dev`, its engine with 3 adapters of rank
    16/32/64 (B non-zero: the LoRA paths do real work), and 32 rows: 8 prompts of `prompt_len` random
    tokens, each for the base and every adapter -> (model, engine, [(prompt, job id or None)])."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    eng = MultiLoraEngine(model, [], 0, gradient_checkpointing=True)
    names = []
    for i, rank in enumerate((16, 32, 64)):
        eng.attach(TrainJob(f"a{rank}", lora_rank=rank, lora_alpha=2.0 * rank, max_steps=1, seed=i))
        with torch.no_grad():
            for _, _, b in eng.jobs[f"a{rank}"].adapter.pairs():
                b.normal_(0, 0.02)
        names.append(f"a{rank}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(8)]
    return model, eng, [(p, c) for p in prompts for c in [None, *names]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new", type=int, default=4, help="new tokens per row (forwards compared: 1 + new - 1)")
    ap.add_argument("--sdpa", default="", help="LORAPLEX_DECODE_SDPA for the decode (e.g. math)")
    ap.add_argument("--kernels", action="store_true", help="also list the GPU kernels of one 2-token decode")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as a node's GPU processes get it
    if args.sdpa:
        os.environ["LORAPLEX_DECODE_SDPA"] = args.sdpa
    from transformers import LlamaConfig

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = llama8b_config(args.layers) if not args.smoke else LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa")
    n_prompt = min(args.prompt_len, 12) if args.smoke else args.prompt_len
    model, eng, rows = three_adapters(config, dev, n_prompt)
    mod_names = {m: n for n, m in model.named_modules()}
    records: list[list[tuple[str, tuple[float, ...], tuple[float, ...]]]] = []
    keep: dict[int, tuple] = {}  # call index -> (module, args, kwargs) kept in the third run

    def digest(ts) -> tuple[float, ...]:  # noqa: ANN001
        out: list[float] = []
        for t in ts:
            if torch.is_tensor(t) and t.is_floating_point():
                f = t.detach().float()
                out += [float(f.sum()), float(f.abs().sum()), float((f * f).sum())]
            elif torch.is_tensor(t):
                out.append(float(t.detach().long().sum()))
        return tuple(out)

    def flat(x) -> list:  # noqa: ANN001
        if torch.is_tensor(x):
            return [x]
        if isinstance(x, (tuple, list)):
            return [t for y in x for t in flat(y)]
        if isinstance(x, dict):
            return [t for y in x.values() for t in flat(y)]
        return [t for t in flat(list(getattr(x, "values", lambda: [])()))] if hasattr(x, "values") else []

    def hook(module, args, kwargs, output) -> None:  # noqa: ANN001
        if not records:
            return
        k = len(records[-1])
        if k in keep and keep[k] is None:
            keep[k] = (module, tuple(a.clone() if torch.is_tensor(a) else a for a in args),
                       {n: v.clone() if torch.is_tensor(v) else v for n, v in kwargs.items()})
        records[-1].append((mod_names.get(module, "?"), digest(flat(args) + flat(kwargs)), digest(flat(output))))

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in model.modules()]
    outs = []

    def once() -> list[list[int]]:
        records.append([])
        return generate(eng, [p for p, _ in rows], [c for _, c in rows], max_new_tokens=args.new,
                        eos_token_id=None, pad_id=0, static=False)

    try:
        outs = [once(), once()]
        a, b = records
        idx = [k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x[2] != y[2]]
        first = idx[0] if idx else None
        same_inputs = None if first is None else a[first][1] == b[first][1]
        rerun_equal = None
        if first is not None:  # the module alone, twice on the same kept inputs
            keep[first] = None
            once()
            module, kargs, kkw = keep[first]
            with torch.no_grad():
                r1, r2 = module(*kargs, **kkw), module(*kargs, **kkw)
            rerun_equal = all(torch.equal(u, v) for u, v in zip(flat(r1), flat(r2), strict=True))
    finally:
        for h in handles:
            h.remove()
    kernels = []
    if args.kernels and dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(eng, [p for p, _ in rows], [c for _, c in rows], max_new_tokens=2, eos_token_id=None,
                     pad_id=0, static=False)
        kernels = [(e.key[:120], e.count) for e in sorted(prof.key_averages(), key=lambda e: -e.count)[:25]]
    embeds = [k for k, x in enumerate(a) if x[0].endswith("embed_tokens")]
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "layers": config.num_hidden_layers,
           "new_tokens": args.new, "modules_called": [len(a), len(b)], "modules_differing": len(idx),
           "first_differing": None if first is None else {
               "index": first, "module": a[first][0], "forward": sum(1 for e in embeds if e <= first) - 1,
               "inputs_equal": same_inputs, "module_alone_twice_equal": rerun_equal,
               "next": [a[k][0] for k in idx[1:6]]},
           "tokens_equal": outs[0] == outs[1], "rows_equal": sum(x == y for x, y in zip(*outs, strict=True)),
           "sdpa": os.environ.get("LORAPLEX_DECODE_SDPA", ""), "kernels": kernels,
           "deterministic_algorithms_in_decode": "trainer.sampling.repeatable"}
    emit(json.dumps(res, indent=1), res, args)


if __name__ == "__main__":
    main()
