"""Training-step benchmark of the multi-LoRA engine on a random-weight Llama-3.1-8B-shaped model.

One run, one device, one table: (a) the backbone alone, (b) PEFT one job at a time, (c) the
engine (and (c'') the engine on the fused operator form), for 8 and 32 jobs x batch 1, seq 1024,
bf16, gradient checkpointing, ranks 16/32/64.
Usage: python bench/engine_step.py [--layers 32] [--jobs 8,32] [--forms compose,fused] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data import Example  # noqa: E402
from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402

SEQ = 1024
RANKS = (16, 32, 64)


def llama8b_config(layers: int):  # noqa: ANN201
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False, attn_implementation="sdpa",
    )


def timed(fn, warmup: int, iters: int) -> tuple[float, float]:  # noqa: ANN001
    """Median seconds of fn() over iters after warmup, and the peak memory (GiB) during them
    (0 on a CPU, where nothing is synced either: a --smoke run)."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0


def floor_step(model, ids: torch.Tensor) -> None:  # noqa: ANN001
    """Backbone forward+backward, no LoRA: grads flow to the input embeddings only."""
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    hidden = model.base_model(inputs_embeds=emb, position_ids=pos, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    total = 0
    for r in range(ids.shape[0]):  # per-row head+loss, recomputed in backward like the engine's
        def f(h, t):  # noqa: ANN001, ANN202
            return torch.nn.functional.cross_entropy(head(h).float(), t)
        total = total + torch.utils.checkpoint.checkpoint(f, hidden[r, :-1], ids[r, 1:], use_reentrant=False)
    total.backward()


KINDS = (  # kernel name fragments -> category, first match wins
    ("LoRA fused GEMM (Triton)", ("_gemm_lora",)),
    ("LoRA passes (Triton)", ("_shrink", "_wgrad", "_expand", "_lora", "_fwd_jit", "_bwd_jit")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("GEMM (cuBLAS/CUTLASS)", ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "sm80_", "ampere_")),
    ("optimizer / norms (foreach)", ("foreach", "multi_tensor", "adam")),
)


def use_form(spec: str) -> tuple[str, str]:
    """Make `spec` (FORM or fused:VARIANT) the process's operator form and fused GEMM variant (no
    variant: the device's); returns (form, variant)."""
    from kernels import fused_lora, set_default_form

    form, _, variant = spec.partition(":")
    set_default_form(form)
    fused_lora.GEMM_DEFAULT = fused_lora.gemm_variant(variant) if variant else None
    return form, variant


def profile_step(label: str, fn) -> str:  # noqa: ANN001
    """One profiled call of fn (after one unprofiled): its wall time, the GPU kernel time summed by
    category, and the GPU idle share of the kernels' span (host-bound stretches, syncs)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    start, end, busy = float("inf"), 0.0, 0.0
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or "memcpy" in e.name.lower() or "memset" in e.name.lower():
            continue
        us = e.time_range.elapsed_us()
        start, end, busy = min(start, e.time_range.start), max(end, e.time_range.end), busy + us
        low = e.name.lower()
        kind = next((k for k, frags in KINDS if any(f in low for f in frags)), "other (elementwise, loss, ...)")
        by_kind[kind] = by_kind.get(kind, 0.0) + us
        by_name[e.name[:90]] = by_name.get(e.name[:90], 0.0) + us
    span = max(end - start, 1.0)
    lines = [f"### {label}: wall {wall * 1e3:.1f} ms (profiled), kernel span {span / 1e3:.1f} ms, "
             f"kernels busy {busy / 1e3:.1f} ms, GPU idle {100 * (1 - busy / span):.1f}% of the span", "",
             "| kernel category | ms | share |", "|---|---|---|"]
    lines += [f"| {k} | {v / 1e3:.1f} | {100 * v / busy:.1f}% |" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])]
    lines += ["", "| top kernels | ms |", "|---|---|"]
    lines += [f"| `{k}` | {v / 1e3:.2f} |" for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--jobs", default="8,32")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--forms", default="compose,fused",
                    help="operator forms of the engine rows (c) and (c''); fused:VARIANT picks the fused GEMM variant")
    ap.add_argument("--skip-peft", action="store_true", help="leave out (b), PEFT one job at a time")
    ap.add_argument("--skip-torch", action="store_true", help="leave out (c'), the plain-torch per-adapter loop")
    ap.add_argument("--profile", default="", help="write a torch.profiler table of one engine step")
    args = ap.parse_args()
    job_counts = [int(x) for x in args.jobs.split(",")]
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dev = torch.device("cuda")
    torch.manual_seed(0)
    with dev:
        model = AutoModelForCausalLM.from_config(llama8b_config(args.layers), dtype=torch.bfloat16)
    model.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    gpu = torch.cuda.get_device_name()
    rows = []
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 128256, (max(job_counts), SEQ), generator=g)

    # (a) the backbone alone at each total batch
    floor = {}
    for n in job_counts:
        ids = data[:n].to(dev)
        t, mem = timed(lambda ids=ids: floor_step(model, ids), args.warmup, args.iters)
        floor[n] = t
        rows.append(("(a) backbone alone", n, t, n * SEQ / t, mem, ""))
        print(rows[-1], flush=True)

    # (b) PEFT, one job at a time at batch 1: per-rank step time, summed over the jobs' ranks
    peft_t = {}
    peft_mem = 0.0
    for r in () if args.skip_peft else RANKS:
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                         "gate_proj", "up_proj", "down_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
        pm = get_peft_model(model, cfg, autocast_adapter_dtype=False)
        params = [p for p in pm.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        ids = data[:1].to(dev)

        def peft_step(pm=pm, opt=opt, ids=ids) -> None:  # noqa: ANN001
            pm(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        peft_t[r], mem = timed(peft_step, args.warmup, args.iters)
        peft_mem = max(peft_mem, mem)
        print("peft rank", r, peft_t[r], mem, flush=True)
        model = pm.unload()
        del pm, opt, params
        torch.cuda.empty_cache()
    for n in () if args.skip_peft else job_counts:
        t = sum(peft_t[RANKS[i % 3]] for i in range(n))
        rows.append(("(b) PEFT sequential", n, t, n * SEQ / t, peft_mem,
                     "sum of per-rank medians " + "/".join(f"{peft_t[r]:.3f}" for r in RANKS)))

    # (c) the engine, on each Triton operator form: "compose" (cuBLAS + LoRA passes, the default)
    # and "fused" (LoRA terms in Triton GEMM epilogues, kernels.fused_lora)
    from kernels import fused_lora, set_default_form

    examples = [Example(tuple(row.tolist()), tuple(row.tolist())) for row in data]
    engine = MultiLoraEngine(model, examples, pad_id=0, adapter_dtype=torch.bfloat16)
    labels = {"compose": "(c) engine", "fused": "(c'') engine, fused form", "auto": "(c'') engine, auto form"}
    for spec in args.forms.split(","):
        form, variant = use_form(spec)
        label = labels[form] + (f", GEMM {variant}" if variant else "")
        for n in job_counts:
            for j in list(engine.jobs):
                engine.detach(j)
            torch.cuda.empty_cache()
            for i in range(n):
                engine.attach(TrainJob(f"j{i}", lora_rank=RANKS[i % 3], lora_alpha=2 * RANKS[i % 3], learning_rate=1e-4,
                                      batch_size=1, max_steps=10_000, seed=i, max_grad_norm=1.0))
            # correctness: at init B = 0, so every job's first loss equals the backbone's on its row
            # (for the fused form this checks the Triton base GEMMs against cuBLAS's model)
            states = list(engine.jobs.values())
            idx = [s.stream.next_indices(1)[0] for s in states]
            for s in states:
                s.stream.load_state_dict({"n": s.stream.n, "seed": s.stream.seed, "epoch": 0, "pos": 0})
            with torch.no_grad():
                ref = []
                for i in idx[:4]:
                    ids = data[i : i + 1].to(dev)
                    ref.append(float(model(input_ids=ids, labels=ids, use_cache=False).loss))
            first = engine.step()
            got = [first.losses[s.job_id] for s in states[:4]]
            err = max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True))
            assert err < 2e-2, (spec, got, ref)
            assert not any(first.skipped.values())
            check = f"first-step loss vs backbone rel err {err:.1e}"
            t, mem = timed(engine.step, args.warmup, args.iters)
            rows.append((label, n, t, n * SEQ / t, mem, check))
            print(rows[-1], flush=True)
            for name in ("_gemm_lora_persist", "_shrink", "_shrink_wgrad", "_wgrad"):  # the table's choices
                for key, cfg in getattr(fused_lora, name)._memo.items():
                    print(f"tuned {spec} {name} {key[:5] if 'gemm' in name else key[:4]}: {cfg}", flush=True)
    set_default_form("compose")

    # ablation: the same engine with the plain-torch per-adapter loop instead of the Triton kernels
    n = job_counts[0]
    for j in list(engine.jobs):
        engine.detach(j)
    for i in range(n):
        engine.attach(TrainJob(f"t{i}", lora_rank=RANKS[i % 3], lora_alpha=2 * RANKS[i % 3], learning_rate=1e-4,
                              batch_size=1, max_steps=10_000, seed=i))
    if not args.skip_torch:
        engine.slots.backend = "torch"
        t, mem = timed(engine.step, args.warmup, args.iters)
        rows.append(("(c') engine, torch loop", n, t, n * SEQ / t, mem, "per-adapter PyTorch loop"))
        engine.slots.backend = "auto"
    if args.profile:
        n = job_counts[0]
        ids = data[:n].to(dev)
        parts = [profile_step("(a) backbone alone", lambda: floor_step(model, ids))]
        for spec in args.forms.split(","):
            use_form(spec)
            parts.append(profile_step(f"(c) engine, {spec}", engine.step))
        set_default_form("compose")
        text = "\n\n".join(parts)
        print(text)
        Path(args.profile).write_text(text + "\n")
    lines = [
        f"# engine_step on {gpu} (torch {torch.__version__}, {args.layers} layers of Llama-3.1-8B shape, "
        f"seq {SEQ}, bf16, grad checkpointing, ranks 16/32/64 cycled, batch 1 per job; "
        f"median of {args.iters} after {args.warmup} warmup)",
        "",
        "| config | jobs | step s | tokens/s | peak GiB | c/a | b/c | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    eng = {n: t for name, n, t, *_ in rows if name.startswith("(c)")}
    seq = {n: t for name, n, t, *_ in rows if name.startswith("(b)")}
    for name, n, t, tps, mem, note in rows:
        ca = f"{t / floor[n]:.2f}" if name.startswith("(c") else ""
        bc = f"{seq[n] / eng[n]:.2f}" if name.startswith("(c)") and n in eng and n in seq else ""
        lines.append(f"| {name} | {n} | {t:.3f} | {tps:,.0f} | {mem:.1f} | {ca} | {bc} | {note} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
