"""What a training step's flash varlen attention costs, and what its launch bounds cost (issue 40).

A replayed 2-job step of ~1,450 tokens at 32 layers of the Llama-3.1-8B shape spends ~6 ms in torch's flash
varlen kernels (forward, backward and its two helpers: bench/results/session61_h200.md), where the work is a
few GFLOP. A step's graph launches the attention with its key's bounds: `max_len` is the longest sequence
so far (the engine's cap, up to max_seq_len) and the sequence slots include spare, empty ones. This script
times the kernels, captured as a graph of 32 calls (a step's layers), forward alone and forward + backward,
on one step's sequences (lengths drawn as bench/executor_task.py's data: prompt 24-200 and completion 24-700
tokens, log-uniform) under four launch bounds:

- tight: max_len = the step's longest sequence, no spare slot;
- cap: max_len = --cap (the key's cap), no spare slot;
- cap+spare: max_len = --cap and --spare empty slots (cu_seqlens repeating the row's end);
- tight+spare: the step's longest and the spare slots.

Outputs are checked equal across the bounds (the same kernels on the same rows), gradients up to the order of
the backward's fp32 atomics. CUDA only.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timing import replay_ms  # noqa: E402


def lengths(total: int, seed: int) -> list[int]:
    r = random.Random(seed)
    out: list[int] = []
    while sum(out) < total:
        p = int(math.exp(r.uniform(math.log(24), math.log(200))))
        c = int(math.exp(r.uniform(math.log(24), math.log(700))))
        out.append(min(p + c, 1024))
    return out


def calls(attn, kw: dict, layers: int, tensors: tuple, backward: bool) -> None:  # noqa: ANN001
    """A step's attention calls: `layers` forwards (each with its backward where `backward`)."""
    q, k, v, dout, cu, max_len = tensors
    with torch.set_grad_enabled(backward):
        for _ in range(layers):
            # fresh leaves per call: no gradient accumulates into a leaf made outside the capture
            qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
            out = attn(qq, kk, vv, cu, cu, max_len, max_len, **kw)
            if backward:
                torch.autograd.grad(out, (qq, kk, vv), dout)


def step_rows(tokens: int, seed: int) -> tuple[list[int], list[int], tuple[torch.Tensor, ...]]:
    """One step's sequences (lengths, their bounds from 0) and random bf16 q, k, v (32 query / 8 key-value heads of
    128) and an output gradient, on CUDA."""
    lens = lengths(tokens, seed)
    bounds = [0, *[sum(lens[: i + 1]) for i in range(len(lens))]]
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((32, 128), (8, 128), (8, 128), (32, 128))
    return lens, bounds, tuple(torch.randn(sum(lens), *hd, device="cuda", dtype=torch.bfloat16, generator=g)
                               for hd in shapes)


def step_args(doc: str) -> argparse.Namespace:
    """The attention probes' arguments: a step's tokens, the graph key's cap and spare slots, layers, replays, seeds
    and the output file (this script and bench/attention_forms.py)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1450)
    ap.add_argument("--cap", type=int, default=1024)
    ap.add_argument("--spare", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def flash_form():  # noqa: ANN201
    """torch's varlen kernel and its keyword arguments for a causal, grouped-query call (the engine's; this script
    and bench/attention_forms.py)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    return varlen_attn, kw


def main() -> None:
    args = step_args(__doc__)
    varlen_attn, kw = flash_form()
    rows = [f"# flash varlen attention, {torch.cuda.get_device_name()}: {args.layers} calls a graph (a step's layers), "
            f"32 query / 8 key-value heads of 128, bf16, causal; median of {args.iters} replays",
            "", "| seed | sequences | tokens | longest | bounds | max_len | slots | forward ms | forward + backward ms "
            "| us a layer (fwd + bwd) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for seed in range(args.seeds):
        lens, cu_real, (q, k, v, dout) = step_rows(args.tokens, seed)
        t, longest = sum(lens), max(lens)
        ref = None
        for name, max_len, spare in (("tight", longest, 0), ("cap", args.cap, 0), ("cap+spare", args.cap, args.spare),
                                     ("tight+spare", longest, args.spare)):
            cu = torch.tensor(cu_real + [t] * spare, dtype=torch.int32, device="cuda")

            tensors = (q, k, v, dout, cu, max_len)
            fwd = functools.partial(calls, varlen_attn, kw, args.layers, tensors, False)
            both = functools.partial(calls, varlen_attn, kw, args.layers, tensors, True)
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            out = varlen_attn(qq, kk, vv, cu, cu, max_len, max_len, **kw)
            got = [out.detach(), *torch.autograd.grad(out, (qq, kk, vv), dout)]
            if ref is None:
                ref = got
            # the forward exactly; the gradients up to the order of the backward's fp32 dQ atomics
            assert torch.equal(got[0], ref[0]), f"{name}: outputs differ"
            assert all(float((a - b).abs().max()) <= 1e-2 * float(b.abs().max()) for a, b in zip(got, ref, strict=True))
            f_ms, b_ms = replay_ms(fwd, args.iters), replay_ms(both, args.iters)
            rows.append(f"| {seed} | {len(lens)} | {t} | {longest} | {name} | {max_len} | {len(lens) + spare} | "
                        f"{f_ms:.2f} | {b_ms:.2f} | {b_ms / args.layers * 1e3:.0f} |")
            print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n\nOutputs equal across the bounds (torch.equal) for every seed, gradients within 1% of their largest element.\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
