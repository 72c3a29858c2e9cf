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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as a node's GPU processes get it
    from transformers import AutoModelForCausalLM, LlamaConfig

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = llama8b_config(args.layers) if not args.smoke else LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa")
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
    n_prompt = min(args.prompt_len, 12) if args.smoke else args.prompt_len
    prompts = [torch.randint(3, config.vocab_size, (n_prompt,), generator=g).tolist() for _ in range(8)]
    rows = [(p, c) for p in prompts for c in [None, *names]]
    mod_names = {m: n for n, m in model.named_modules()}
    records: list[list[tuple[str, float, float]]] = []

    def hook(module, _inputs, output) -> None:  # noqa: ANN001
        t = output if torch.is_tensor(output) else next((o for o in (output if isinstance(output, tuple) else
                                                                      getattr(output, "values", lambda: [])())
                                                         if torch.is_tensor(o)), None)
        if t is not None and records:
            f = t.detach().float()
            records[-1].append((mod_names.get(module, "?"), float(f.sum()), float(f.abs().sum())))

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    outs = []
    try:
        for _ in range(2):
            records.append([])
            outs.append(generate(eng, [p for p, _ in rows], [c for _, c in rows], max_new_tokens=1,
                                 eos_token_id=None, pad_id=0, static=False))
    finally:
        for h in handles:
            h.remove()
    a, b = records
    differ = [(x[0], x[1] - y[1]) for x, y in zip(a, b, strict=False) if (x[1], x[2]) != (y[1], y[2])]
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "layers": config.num_hidden_layers,
           "modules_called": [len(a), len(b)], "modules_differing": len(differ),
           "first_differing": differ[:5], "tokens_equal": outs[0] == outs[1],
           "deterministic_algorithms_in_decode": "trainer.sampling.repeatable"}
    emit(json.dumps(res, indent=1), res, args)


if __name__ == "__main__":
    main()
