"""Quality study of loss-aware early exit: a grid of LoRA configurations trained (a) to completion
and (b) with early exit, warmup ranking and admission/rotation; prints one markdown table.

Model: a small Llama (transformers config, random init) that is first pretrained here on 1-2 digit
addition (full parameters), then frozen; the LoRA task is 3-digit addition with the answer written
least-significant digit first, on a small training set (several epochs, so overfitting happens)
and a held-out validation set. Loss is on answer tokens only.

Jobs train on trainer/engine.py's MultiLoraEngine (all co-resident jobs in one forward/backward),
each with its own seed (adapter init, data order), so a job's curve does not depend on which jobs
share the device: (b)'s curves are compared with the prefixes of (a)'s, and a replay of the
policy on (a)'s curves must reproduce (b); the replay then also scores other warmup settings.

    python3 bench/early_exit_study.py --tiny          # CPU smoke check, a few minutes
    python3 bench/early_exit_study.py --out bench/results/early_exit_<device>.md   # GPU size

The task, backbone and plans are in early_exit_study_task.py, the policy's runs and replay in
early_exit_study_runs.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import early_exit_study_task as task  # noqa: E402
from early_exit_study_runs import replay, run_grid  # noqa: E402

from contract.protocol import EarlyExitSettings  # noqa: E402
from trainer.admission import fit_memory_model, profile_memory  # noqa: E402
from trainer.early_exit import warmup_steps  # noqa: E402
from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402


# ----------------------------------------------------------------------------- analysis
def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy)


def best(curve: list[tuple[int, float]]) -> float:
    finite = [v for _, v in curve if math.isfinite(v)]
    return min(finite) if finite else math.inf


def profile(engine: MultiLoraEngine, epochs: int) -> str:
    """Fit M = k0 + k1*B*L on this device (CUDA only) and check it at a held-out batch."""
    if not torch.cuda.is_available():
        return "Memory model: not profiled (CPU; admission ran against a token budget)."
    current: dict[int, str] = {}

    def step_fn(total_batch: int) -> None:
        if total_batch not in current:
            for job_id in list(engine.jobs):
                engine.detach(job_id)
            spec = TrainJob(job_id=f"profile-b{total_batch}", batch_size=total_batch, epochs=epochs)
            current[total_batch] = engine.attach(spec).job_id
        engine.step()

    seq = max(len(e.input_ids) for e in engine.train_examples)
    pts = profile_memory(step_fn, [64, 128, 256, 512], seq)
    held = profile_memory(step_fn, [384], seq)[0]
    for job_id in list(engine.jobs):
        engine.detach(job_id)
    m = fit_memory_model(pts)
    pred = m.predict(held.total_batch, seq)
    return (f"Memory model fitted on this device (engine step, L={seq}): k0 = {m.k0 / 2**20:.1f} MiB, "
            f"k1 = {m.k1:.0f} B/token; held-out B=384: predicted {pred / 2**20:.2f} MiB, measured "
            f"{held.peak_bytes / 2**20:.2f} MiB ({(pred / held.peak_bytes - 1) * 100:+.1f}%).")


def summarize(plans: list[task.Plan], a: dict[str, task.Outcome], b: dict[str, task.Outcome],
              warmup_fraction: float = 0.05) -> dict:
    best_a = min(plans, key=lambda p: best(a[p.job_id].curve))
    best_b = min(plans, key=lambda p: best(b[p.job_id].curve))
    samples_a = sum(o.samples for o in a.values())
    samples_b = sum(o.samples for o in b.values())
    reasons: dict[str, int] = {}
    for o in b.values():
        reasons[o.exit_reason or o.state] = reasons.get(o.exit_reason or o.state, 0) + 1
    ob = b[best_a.job_id]
    return {
        "samples_a": samples_a, "samples_b": samples_b, "saved": 1 - samples_b / samples_a,
        "best_a": best(a[best_a.job_id].curve), "best_a_id": best_a.job_id,
        "best_b": best(b[best_b.job_id].curve), "best_b_id": best_b.job_id,
        "ratio": best(b[best_b.job_id].curve) / best(a[best_a.job_id].curve),
        # survived = went on training after the ranking (not evicted, not exited before it)
        "survived": ob.state == "completed"
        or ob.steps > warmup_steps(best_a.total_steps, warmup_fraction),
        "best_a_fate": ob.exit_reason or ob.state, "reasons": reasons,
    }


def replay_lines(plans: list[task.Plan], a: dict[str, task.Outcome], cfg: EarlyExitSettings) -> list[str]:
    """The replay section: other warmup/keep settings, and the per-evaluation slope reading."""
    lines = [
        "Other settings, by replaying the policy on (a)'s curves (exact up to the deviation above):",
        "",
        "| warmup fraction | keep ratio | samples saved | best (b)/(a) | best of (a) survived | Spearman(warmup, end) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for wf in task.WARMUPS:
        wrho = spearman([dict(a[p.job_id].curve)[warmup_steps(p.total_steps, wf)] for p in plans],
                        [a[p.job_id].curve[-1][1] for p in plans])
        for kr in (0.25, 0.5):
            rcfg = EarlyExitSettings(warmup_fraction=wf, keep_fraction=kr)
            r = summarize(plans, a, replay(plans, a, rcfg), wf)
            lines.append(f"| {wf} | {kr} | {r['saved']:.3f} | {r['ratio']:.4f} | "
                         f"{'yes' if r['survived'] else 'no'} | {wrho:.3f} |")
    lines += ["", "Detector exits (diverging/overfitting) when replaying (a) with no warmup ranking "
              "(keep_ratio 1), by slope normalisation:", ""]
    for label, per_eval in (("per step (JobMonitor)", False), ("per evaluation point", True)):
        rep = replay(plans, a, cfg.model_copy(update={"keep_fraction": 1.0}), per_eval_slope=per_eval)
        totals = {p.job_id: p.total_steps for p in plans}
        exits = [f"{k} {o.exit_reason} at step {o.steps} of {totals[k]}"
                 for k, o in rep.items() if o.exit_reason in ("diverging", "overfitting")]
        lines.append(f"- tau_slope read {label}: {len(exits)} exits" + (f": {'; '.join(exits)}" if exits else ""))
    return lines


def reanalyze(path: Path, size: task.Size) -> None:
    """Print the replay section from a saved --json file (no training)."""
    d = json.loads(path.read_text())
    n_train = size.n_train
    plans = task.make_plans(size, n_train)
    a = {}
    for p in plans:
        curve = [(int(st), float(v)) for st, v in d["a"][p.job_id]]
        a[p.job_id] = task.Outcome(p.total_steps, p.total_steps * p.batch_size, d["train_a"][p.job_id],
                              curve, "completed")
    print("\n".join(replay_lines(plans, a, EarlyExitSettings())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke size")
    ap.add_argument("--out", type=Path, help="write the table here as well")
    ap.add_argument("--json", type=Path, help="write curves and events here")
    ap.add_argument("--reanalyze", type=Path, help="only print the replay section of a --json file")
    args = ap.parse_args()
    size = task.TINY if args.tiny else task.FULL
    if args.reanalyze:
        reanalyze(args.reanalyze, size)
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 throughout
    t0 = time.perf_counter()
    model = task.build_backbone(size, 16, device)
    train_pairs, val_pairs = task.lora_task(size)
    train, val = [task.to_example(*p) for p in train_pairs], [task.to_example(*p) for p in val_pairs]
    # The plain-torch LoRA path: this study measures the exit policy, and the Triton kernels'
    # autotuning on each new (tokens, rank) shape would only add noise to the wall times.
    engine = MultiLoraEngine(model, train, task.PAD, gradient_checkpointing=False, backend="torch")
    t_pre = time.perf_counter() - t0
    cfg = EarlyExitSettings()
    plans = task.make_plans(size, len(train))

    runs: dict[str, dict[str, task.Outcome]] = {}
    times, events = {}, []
    for name, c in (("a", EarlyExitSettings(enabled=False)), ("b", cfg)):
        t = time.perf_counter()
        runs[name] = run_grid(engine, plans, val, size.epochs, c, size.concurrent_batch,
                              events if name == "b" else [])
        times[name] = time.perf_counter() - t
        print(f"run ({name}) done in {times[name]:.1f} s", flush=True)
    try:
        mem_line = profile(engine, size.epochs)
    except Exception as exc:  # the study's numbers stand without the memory line
        mem_line = f"Memory model: profiling failed: {exc!r}"
    a, b = runs["a"], runs["b"]
    if args.json:  # raw curves first, so the analysis can be redone from them
        args.json.write_text(json.dumps({
            "a": {k: o.curve for k, o in a.items()}, "b": {k: o.curve for k, o in b.items()},
            "train_a": {k: o.train for k, o in a.items()}, "events": events,
            "times": times, "memory": mem_line}))
    s = summarize(plans, a, b)
    warm_a = [dict(a[p.job_id].curve)[p.warmup] for p in plans]
    rho = spearman(warm_a, [a[p.job_id].curve[-1][1] for p in plans])
    rho_best = spearman(warm_a, [best(a[p.job_id].curve) for p in plans])

    # (b)'s curves against (a)'s prefixes: jobs do not depend on their co-residents (up to the
    # float order of batched GEMMs), and the replay of the policy on (a) reproduces (b).
    max_dev = 0.0
    for p in plans:
        for (sa, va), (sb, vb) in zip(a[p.job_id].curve, b[p.job_id].curve, strict=False):
            assert sa == sb
            max_dev = max(max_dev, abs(va - vb) / abs(va))
    rep = replay(plans, a, cfg)
    agree = sum(rep[p.job_id].exit_reason == b[p.job_id].exit_reason
                and rep[p.job_id].steps == b[p.job_id].steps for p in plans)

    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    lines = [
        f"# Early-exit quality study ({'tiny CPU smoke' if args.tiny else 'study'} size) on {dev_name}",
        "",
        f"Backbone: Llama (transformers config), random init, pretrained here for "
        f"{size.pretrain_steps} steps on 1-2 digit addition, then frozen (hidden {size.hidden}, "
        f"{size.layers} layers). LoRA task: 3-digit addition with the answer reversed, "
        f"{size.n_train} train / {size.n_val} validation problems, {size.epochs} epochs, loss on "
        f"answer tokens. Trained by trainer/engine.py (MultiLoraEngine: one batched forward/backward "
        f"for all co-resident jobs), per-job AdamW, linear decay, lora_alpha 16, all 7 projections.",
        f"Grid: {len(plans)} jobs = lr {list(size.lrs)} x rank {list(size.ranks)} x batch "
        f"{list(size.batches)}; admission budget {size.concurrent_batch} co-resident sequences "
        f"(queued jobs rotate in during warmup). Early exit: {cfg}.",
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| training samples (a) no early exit / (b) early exit | {s['samples_a']} / {s['samples_b']} |",
        f"| **fraction of training samples saved** | **{s['saved']:.3f}** |",
        f"| best val loss (a) | {s['best_a']:.4f} ({s['best_a_id']}) |",
        f"| best val loss (b) | {s['best_b']:.4f} ({s['best_b_id']}) |",
        f"| **best (b) / best (a)** (goal <= 1.01) | **{s['ratio']:.4f}** |",
        f"| **best config of (a) survived warmup ranking** | **{'yes' if s['survived'] else 'no'}** "
        f"(its fate in (b): {s['best_a_fate']}) |",
        f"| **Spearman(val at end of warmup, val at end)**, 24 jobs of (a) | **{rho:.3f}** |",
        f"| Spearman(val at end of warmup, best val) | {rho_best:.3f} |",
        f"| job outcomes in (b) | {json.dumps(s['reasons'], sort_keys=True)} |",
        f"| max rel. deviation of (b) val curves from (a) prefixes | {max_dev:.1e} |",
        f"| replay of the policy on (a) matches (b) (exit reason and step) | {agree}/{len(plans)} jobs |",
        f"| wall time: setup+pretrain / (a) / (b) | {t_pre:.1f} s / {times['a']:.1f} s / {times['b']:.1f} s |",
        "",
        mem_line,
        "",
    ]
    lines += replay_lines(plans, a, cfg)
    lines += [
        "",
        "| job | steps | val @warmup (a) | best val (a) | final val (a) | (b) outcome | (b) steps | best val (b) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in plans:
        x, y = a[p.job_id], b[p.job_id]
        lines.append(
            f"| {p.job_id} | {p.total_steps} | {dict(x.curve)[p.warmup]:.4f} | {best(x.curve):.4f} | "
            f"{x.curve[-1][1]:.4f} | {y.exit_reason or y.state} | {y.steps} | {best(y.curve):.4f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
