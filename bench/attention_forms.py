"""Which attention kernel a training step should run (issue 40): torch's flash varlen kernel (the engine's today)
against cuDNN's fused attention on the same ragged rows, forward and backward, float64-checked.

A replayed 2-job step of ~1,450 tokens at 32 layers spends ~6-8 ms in the flash kernels (forward, backward and its
two helpers: bench/results/session61_h200.md, raw hp_tile_129_s64), for a few GFLOP of work: the sequences are
short (~250 tokens), so the kernels are bound by their own latency. cuDNN's fused attention (Hopper kernels of its
own, `torch.ops.aten._cudnn_attention_forward` with cumulative sequence bounds, the op torch's nested tensors use)
is the other kernel torch ships. Forms, each with autograd's backward:

- flash: `torch.nn.attention.varlen.varlen_attn`, causal, grouped-query key/value heads as they are (the engine);
- cudnn: `_cudnn_attention_forward` on the same rows, grouped-query key/value heads as they are;
- cudnn_x: the same with the key/value heads expanded to the query heads first (autograd sums their gradients).

Each form's kernels are timed eagerly first (torch.profiler's device time of `--layers` calls, forward + backward),
then as a CUDA graph of `--layers` calls (a step's layers; graph_timing.replay_ms, warmed up and captured on one
stream), forward alone and forward + backward, under two launch bounds: tight (the step's longest sequence, no spare slot) and the engine's
graph bounds (max_len --cap, --spare empty sequence slots). Outputs and the three gradients are checked against a
float64 reference per sequence in the same run; a form that fails or errs is reported, not timed. CUDA only.

    python3 bench/attention_forms.py [--tokens 1450] [--seeds 3] [--out FILE.md]
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_varlen import calls, flash_form, step_args, step_rows  # noqa: E402
from graph_timing import replay_ms  # noqa: E402

HQ, HKV, D = 32, 8, 128


def cudnn_form(expand: bool):  # noqa: ANN201
    """cuDNN's ragged attention in varlen_attn's call form (key/value heads expanded first where `expand`)."""
    def attn(q, k, v, cu_q, cu_k, max_q, max_k):  # noqa: ANN001, ANN202
        if expand:
            k, v = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, True,
                                                       False, scale=D ** -0.5)[0]
    return attn, {}


def reference(q, k, v, dout, bounds):  # noqa: ANN001, ANN201
    """Output and gradients in float64, one causal sequence at a time."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b == a:
            continue
        qs = q[a:b].transpose(0, 1)
        ks, vs = (t[a:b].repeat_interleave(HQ // HKV, dim=1).transpose(0, 1) for t in (k, v))
        s = qs @ ks.transpose(1, 2) * D ** -0.5
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        outs.append((s.softmax(-1) @ vs).transpose(0, 1))
    out = torch.cat(outs)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout.double())]


def errors(form, q, k, v, dout, cu, max_len, ref) -> list[float]:  # noqa: ANN001
    attn, kw = form
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn(qq, kk, vv, cu, cu, max_len, max_len, **kw)
    got = [out.detach(), *torch.autograd.grad(out, (qq, kk, vv), dout)]
    return [float((g.double() - r).abs().max() / r.abs().max()) for g, r in zip(got, ref, strict=True)]


def kernel_ms(fn, iters: int) -> float:  # noqa: ANN001
    """Device time of fn's kernels (torch.profiler), ms a call, after three warmup calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / iters / 1e3


def main() -> None:
    args = step_args(__doc__)
    forms = {"flash": flash_form(), "cudnn": cudnn_form(False), "cudnn_x": cudnn_form(True)}
    rows = [f"# Attention forms, {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN "
            f"{torch.backends.cudnn.version()}: {args.layers} calls a graph (a step's layers), {HQ} query / {HKV} "
            f"key-value heads of {D}, bf16, causal; median of {args.iters} replays; errors are the largest absolute "
            "error over the largest reference element, against float64", "",
            "| seed | sequences | tokens | longest | bounds | form | out err | dq err | dk err | dv err | eager kernels fwd + "
            "bwd ms | graph: forward ms | graph: fwd + bwd ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for seed in range(args.seeds):
        lens, bounds, (q, k, v, dout) = step_rows(args.tokens, seed)
        t, longest = sum(lens), max(lens)
        ref = reference(q, k, v, dout, bounds)
        for bname, max_len, spare in (("tight", longest, 0), ("cap+spare", args.cap, args.spare)):
            cu = torch.tensor(bounds + [t] * spare, dtype=torch.int32, device="cuda")
            for fname, (attn, kw) in forms.items():
                head = f"| {seed} | {len(lens)} | {t} | {longest} | {bname} | {fname} |"
                cells = []
                try:
                    err = errors((attn, kw), q, k, v, dout, cu, max_len, ref)
                    cells += [f"{e:.1e}" for e in err]
                    tensors = (q, k, v, dout, cu, max_len)
                    cells.append(f"{kernel_ms(functools.partial(calls, attn, kw, args.layers, tensors, True), 5):.2f}")
                    for backward in (False, True):
                        part = functools.partial(calls, attn, kw, args.layers, tensors, backward)
                        cells.append(f"{replay_ms(part, args.iters, same_stream=True):.2f}")
                except Exception as exc:  # noqa: BLE001 - a form this torch or device lacks is reported, not timed
                    cells.append(f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                rows.append(f"{head} " + " | ".join(cells + [""] * (7 - len(cells))) + " |")
                print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
