"""The real executor on a user's search at full depth: where a task's wall time goes.

One task through `trainer.executor.Executor` at the product's defaults (evaluation, early exit,
checkpoints, exports, attention "auto", admission from a memory profile), on a Llama-3.1-8B-shaped
model with random bf16 weights and `--layers` decoder layers: 8 jobs of ranks 16/32/64 and batch
sizes 1/2/4, prompt/completion samples of 24-200 and 24-700 words (log-uniform), max_seq_len
1024, each job `--steps` steps. Runs in one process (`--runs`): "cold" (no stored memory profile:
the node's first executor of the model; the kernel configurations come from the shipped table),
"warm" (the profile stored by the cold run), and any run named "...eager..." with the CUDA graphs
of the training step off (every step launched from the host: the side-by-side baseline). Reports per run: wall, the executor's phases, the
first step's time from the executor's start, training tokens/s, MFU of the training steps
(6 x backbone parameters x tokens; 8 with activation recompute, which repeats the forward), the
wall over the training steps, evaluation's share of the wall, and what admission chose.

    python bench/executor_task.py [--layers 32] [--steps 200] [--out FILE.md] [--json FILE]
    python bench/executor_task.py --smoke     # CPU, toy sizes: checks the script
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import task_e2e_data as te  # noqa: E402
from baselines import config_matmul_params  # noqa: E402
from engine_step import llama8b_config  # noqa: E402
from step_profile import PROFILE, profiled  # noqa: E402
from task_e2e_runs import graph_counts, graph_event  # noqa: E402

from contract.protocol import EvalSettings, TaskSettings  # noqa: E402
from trainer import triton_ahead  # noqa: E402
from trainer.executor import Callbacks, Executor, ExecutorConfig  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402
from worker.processes import CUBLAS_WORKSPACE  # noqa: E402

PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16


def write_data(path: Path, n: int, seed: int) -> Path:
    r = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            p = int(math.exp(r.uniform(math.log(24), math.log(200))))
            c = int(math.exp(r.uniform(math.log(24), math.log(700))))
            words = [f"w{r.randrange(te.K)}" for _ in range(p + c)]
            f.write(json.dumps({"prompt": " ".join(words[:p]), "completion": " ".join(words[p:])}) + "\n")
    return path


def jobs(steps: int) -> list[TrainJob]:
    grid = [(16, 1), (32, 2), (64, 4), (16, 2), (32, 4), (64, 1), (16, 4), (32, 1)]
    return [TrainJob(f"j{i}", lora_rank=r, lora_alpha=2.0 * r, learning_rate=lr, batch_size=b, max_steps=steps, seed=i)
            for i, ((r, b), lr) in enumerate(zip(grid, [1e-4, 3e-4, 1e-3, 2e-4, 5e-4, 1e-3, 1e-4, 3e-4],
                                                 strict=True))]


class KernelLoads:
    """Where a fresh process spends host time making kernels ready (session 50): every Triton kernel
    the JIT compiles or finds in its cache (`JITFunction._do_compile`) and every module it loads onto
    the device (`CompiledKernel._init_handles`, its first call for a kernel), as (start, seconds, kind) on
    the perf_counter clock; `within(t0, t1)` sums what fell inside a step (`segments` counts the allocator's)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float, str]] = []
        self.slow: list[tuple[float, float, str, str]] = []  # the events of SLOW_LOAD_S or more, with the kernel's name
        self._undo: list = []

    def _wrap(self, owner: type, name: str, kind: str) -> None:
        real = getattr(owner, name)

        def timed(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            if kind == "module" and args and getattr(args[0], "module", None) is not None:
                return real(*args, **kw)  # loaded already: Triton 3.6 calls this at every launch (launch metadata)
            t0 = time.perf_counter()
            try:
                return real(*args, **kw)
            finally:
                took = time.perf_counter() - t0
                self.events.append((t0, took, kind))
                if took >= SLOW_LOAD_S:  # which kernel, and when: the run's JSON lists them
                    me = args[0] if args else None
                    name = getattr(me, "name", None) or getattr(getattr(me, "fn", None), "__name__", "?")
                    self.slow.append((t0, round(took, 4), kind, str(name)))

        setattr(owner, name, timed)
        self._undo.append((owner, name, real))

    def __enter__(self) -> KernelLoads:
        if torch.cuda.is_available():
            from triton.compiler.compiler import CompiledKernel
            from triton.runtime.jit import JITFunction
            self._wrap(JITFunction, "_do_compile", "jit")
            if hasattr(CompiledKernel, "_init_handles"):
                self._wrap(CompiledKernel, "_init_handles", "module")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)

    def within(self, t0: float, t1: float) -> list[float]:
        """[JIT seconds, module-load seconds, how many of each] of the events that began in [t0, t1)
        (the events come in time order: a bisection, not a scan of the run's events at every step)."""
        lo = bisect.bisect_left(self.events, (t0,))
        hi = bisect.bisect_left(self.events, (t1,))
        inside = self.events[lo:hi]
        jit = [d for _, d, k in inside if k == "jit"]
        mod = [d for _, d, k in inside if k == "module"]
        return [round(sum(jit), 4), round(sum(mod), 4), len(jit), len(mod)]


def segments() -> int:
    """The caching allocator's device segments so far (each one a cudaMalloc)."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_stats().get("segment.all.allocated", 0))


class Counted(Executor):
    """The executor with its engine's steps counted: real tokens of every training step."""

    def _load(self) -> None:
        super()._load()
        self.step_tokens: list[int] = []
        real = self.engine.step

        # [tokens, jobs, recompute, seconds, each pass's cells or 0, what the step graphs did (session 49), kernels
        # made ready inside the step: [JIT s, module-load s, JIT count, module count] and the allocator's new segments
        # (session 50; KernelLoads; 0 unless STEP_SYNC)]. The seconds: with STEP_SYNC (--step-sync, the tables of
        # sessions 19-64), the step synced before and after; else the host's time in engine.step, which ends after
        # the step's one sync (its numbers) and its updates' launch, as the product runs it.
        self.step_trace: list[list] = []

        def step():  # noqa: ANN202
            if STEP_SYNC:
                te.sync()
            before, segs = graph_counts(self.engine), segments() if STEP_SYNC else 0
            t0 = time.perf_counter()
            report = profiled(len(self.step_trace), real)
            if STEP_SYNC:
                te.sync()
            t1 = time.perf_counter()
            self.step_tokens.append(report.tokens)
            loads = LOADS.within(t0, t1) if LOADS is not None else []
            self.step_trace.append([report.tokens, len(report.losses), int(bool(self.engine.gradient_checkpointing)),
                                    round(t1 - t0, 4), report.pass_cells or 0, graph_event(self.engine, before),
                                    [*loads, segments() - segs if STEP_SYNC else 0]])
            return report

        self.engine.step = step
        self.eval_calls: list[dict] = []
        real_eval = self.engine.evaluate_metrics

        def evaluate_metrics(examples, batch_size=8, job_ids=None, max_sequences=None, forwards=None):  # noqa: ANN001, ANN202
            te.sync()
            t0 = time.perf_counter()
            out = real_eval(examples, batch_size, job_ids, max_sequences, forwards)
            te.sync()
            self.eval_calls.append({"jobs": len(job_ids or []), "examples": len(examples), "chunk": batch_size,
                                    "max_sequences": max_sequences, "step": self.global_step,
                                    "tokens": sum(len(e.input_ids) for e in examples) * len(job_ids or []),
                                    "s": round(time.perf_counter() - t0, 3)})
            return out

        self.engine.evaluate_metrics = evaluate_metrics


# --step-sync: every training step synced before and after (and the allocator's segments read): the per-step timings
# of sessions 19-64's tables. Those two syncs a step keep the host's work for the next step from overlapping the
# device's updates, and the memory statistics cost host time at each: the task then runs slower than the product
# (session 64: replayed 2-job steps 107.7-110.7 ms in the task against ~103-105 ms back to back in
# bench/step_gap.py). Off by default since session 64: the product's executor syncs once a step (its numbers).
STEP_SYNC = False
SLOW_LOAD_S = 0.02  # a kernel made ready this slowly is named in the run's JSON (session 50: ~1 s of module loads
# came after the training steps, in evaluation or the samples)
LOADS: KernelLoads | None = None  # the run's tracer while it runs (Counted's steps read it)

PROBE: list[dict] | None = None  # --sync-probe: per evaluation group, what held its host up (below)


def sync_probe() -> None:
    """--sync-probe: each evaluation group's `_group_sums` under torch's sync debug mode (the Python line
    of every host sync it made), its host seconds, the kernel modules loaded meanwhile (a module load
    waits for the device's queue), and whether the device still ran its forwards when it returned
    (trainer.graph_ahead captures only while they run: session 54 found them done at every hook)."""
    import traceback
    import warnings

    from trainer import evaluation

    global PROBE
    PROBE, orig = [], evaluation.Evaluation._group_sums

    def probed(self, members, examples, batch_size):  # noqa: ANN001, ANN202
        syncs: list[str] = []

        def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
            stack = [f"{f.filename.split('/')[-1]}:{f.lineno}" for f in traceback.extract_stack()[:-1]
                     if not f.filename.endswith("warnings.py")][-8:]
            syncs.append(f"{str(message)[:60]} @ {' < '.join(reversed(stack))}")

        t0, cuda = time.perf_counter(), torch.cuda.is_available()
        # the caching allocator's syncs and device mallocs (sync debug mode does not see them)
        names = ("num_sync_all_streams", "num_device_alloc", "num_device_free", "num_alloc_retries")
        stats0 = torch.cuda.memory_stats() if cuda else {}
        # where the host stalls: its seconds at each decoder layer's start and at the final norm's end
        decoder = self.engine.model.get_decoder()
        marks: list[tuple[str, float]] = []
        hooks = [layer.register_forward_pre_hook(lambda m, a, k=k: marks.append((f"L{k}", time.perf_counter())))
                 for k, layer in enumerate(getattr(decoder, "layers", []))]
        if getattr(decoder, "norm", None) is not None:
            hooks.append(decoder.norm.register_forward_hook(lambda m, a, o: marks.append(("norm", time.perf_counter()))))
        mode = torch.cuda.get_sync_debug_mode() if cuda else 0
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():  # restores showwarning
                warnings.simplefilter("always")
                warnings.showwarning = show
                out = orig(self, members, examples, batch_size)
        finally:
            for h in hooks:
                h.remove()
            if cuda:
                torch.cuda.set_sync_debug_mode(mode)
        t1 = time.perf_counter()
        ev = torch.cuda.Event() if cuda else None
        if ev is not None:
            ev.record()
        busy = ev is not None and not ev.query()
        loads = LOADS.within(t0, t1) if LOADS is not None else []
        stats1 = torch.cuda.memory_stats() if cuda else {}
        PROBE.append({"jobs": len(members), "examples": len(examples), "host_s": round(t1 - t0, 4),
                      "busy_after": busy, "loads": loads, "syncs": syncs[:12], "n_syncs": len(syncs),
                      "allocator": {k: stats1.get(k, 0) - stats0.get(k, 0) for k in names},
                      # captures ahead run inside the group (after a backbone) and add their own host time
                      "ahead_made": dict(self.engine.step_graphs.ahead) if self.engine.step_graphs else None,
                      # the first forward's marks (host seconds from the group's start), then the group's end
                      "marks": [(n, round(t - t0, 4)) for n, t in marks[: len(hooks)]] + [("end", round(t1 - t0, 4))]})
        return out

    evaluation.Evaluation._group_sums = probed


EVALS = {"product": EvalSettings(),  # the product's cadence: every 1024 samples a job trained on
         "every10": EvalSettings(eval_every_steps=10, eval_max_samples=None)}  # sessions 17-20's tables


def run(model_dir: Path, train: Path, val: Path, out: Path, steps: int, cache: Path, graphs: bool = True,
        evaluation: str = "product") -> dict:
    tokens, events = [], {}
    cb = Callbacks(on_throughput=lambda d: tokens.append(d),
                   on_event=lambda j, m, d: events.setdefault(m, d) if not j else None)
    shutil.rmtree(out, ignore_errors=True)
    cfg = ExecutorConfig(model_dir=str(model_dir), train_file=str(train), val_file=str(val), output_dir=str(out),
                         jobs=jobs(steps), profile_cache=str(cache), cuda_graphs=graphs,
                         settings=TaskSettings(max_seq_len=1024, eval=EVALS[evaluation]))
    te.sync()
    global LOADS
    t0 = time.perf_counter()
    with KernelLoads() as LOADS:
        ex = Counted(cfg, cb)
        status = ex.run()
        te.sync()
    wall = time.perf_counter() - t0
    loads, LOADS = LOADS, None
    first = ex.clock.first_step_s
    train_tokens = sum(ex.step_tokens)
    corrections = ex.memory.corrections if ex.memory is not None else {}
    return {"wall_s": wall, "phases": dict(ex.clock.phases), "first_step_s": first,
            "profile_reused": ex.memory.profile_reused if ex.memory is not None else None,
            "load_parts": getattr(ex, "load_parts", None), "steps": ex.global_step, "train_tokens": train_tokens,
            "states": sorted({s["state"] for s in status.values()}), "timings": events.get("timings"),
            "admission": events.get("memory_model"), "throughput_reports": len(tokens),
            "attention": ex.engine.attention if getattr(ex, "engine", None) is not None else None,
            "eval_calls": getattr(ex, "eval_calls", []), "step_trace": getattr(ex, "step_trace", []),
            "eval_probe": PROBE, "first_calls_s": list(triton_ahead.MADE),  # the load worker's first calls (s each)
            "graphs": ex.engine.step_graphs.stats() if getattr(ex, "engine", None) is not None
            and ex.engine.step_graphs is not None else None,
            # the memory model (analytic or stored, corrected online) against every step the
            # allocator saw: tokens, recompute, resident before, peak, predicted, the arena's elements
            "memory_trace": [(p.tokens, p.recompute, p.resident, p.peak, round(p.predicted), p.adapter_params)
                             for c in corrections.values() for p in c.trace],
            "samples": samples_summary(out),
            "memory_final": {str(k): (c.model.k0, c.model.k1) for k, c in corrections.items()},
            # kernels made ready in the whole run and before its first step ended: [JIT s, module s, counts]
            "kernel_loads": {"run": loads.within(t0, math.inf),
                             "to_first_step": loads.within(t0, t0 + first) if first else None,
                             # [seconds into the run, seconds, jit or module, kernel] of each slow one
                             "slow": [[round(t - t0, 3), took, kind, name] for t, took, kind, name in loads.slow]}}


def samples_summary(out: Path) -> dict | None:
    """The end-of-task samples (trainer.task_samples): rows, adapters + base, new tokens."""
    path = out / "samples.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"rows": len(rows), "configurations": len({str(r.get("job_id")) for r in rows}),
            "new_tokens": sum(int(r.get("tokens") or 0) for r in rows)}


def render(res: dict, args: argparse.Namespace) -> str:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    lines = [f"# The real executor at {args.layers} layers, {args.steps} steps ({dev})", "",
             f"Llama-3.1-8B shape, random bf16 weights, {args.layers} layers; 8 jobs (ranks 16/32/64, batch 1/2/4), "
             f"prompts 24-200 and completions 24-700 words, max_seq_len 1024, {args.n_train} train / {args.n_val} "
             "validation samples; product defaults (early exit, checkpoints, exports, end-of-task samples, attention "
             "auto); evaluation " + ("the product's (every 1024 samples a job trained on, 0.25 validation sample "
             "per trained one, at least 64)" if args.eval == "product" else "every 10 steps on the whole validation "
             "set (as sessions 17-20's tables)") + ". " + ("Every training step synced before and after (--step-sync). "
             if args.step_sync else "Training steps as the product runs them (no sync of the "
             "script's own). ") + "`python bench/executor_task.py " + " ".join(sys.argv[1:]) + "`.", "",
             "| run | wall s | load | profile | train | eval | checkpoint | export | first step s | train tok/s | "
             "MFU | wall / train | eval share | samples s | steps | jobs end |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    memory = []
    for name, r in res["runs"].items():
        ph, train = r["phases"], max(r["phases"]["train"], 1e-9)
        tps = r["train_tokens"] / train
        mfu = mfu_of(r, args.layers)
        lines.append(
            f"| {name} | {r['wall_s']:.1f} | {ph['load']:.1f} | {ph['profile']:.1f} | {ph['train']:.1f} | "
            f"{ph['eval']:.1f} | {ph['checkpoint']:.1f} | {ph['export']:.1f} | {r['first_step_s'] or 0:.1f} | "
            f"{tps:,.0f} | {mfu:.1%} | {r['wall_s'] / train:.2f}x | {ph['eval'] / r['wall_s']:.1%} | "
            f"{ph.get('samples', 0.0):.1f} | {r['steps']} | "
            f"{', '.join(r['states'])} |")
        seen = [t for t in r.get("memory_trace", []) if t[3] > t[2]]
        if seen:
            worst = max(abs(t[4] - t[3]) / t[3] for t in seen)
            memory.append(f"- {name}: {len(seen)} steps the allocator saw, largest |predicted - peak| / peak "
                          f"{worst:.1%}, peak {max(t[3] for t in seen) / 1e9:.1f} GB; final (k0, k1) "
                          f"{r.get('memory_final')}")
        if r.get("samples"):
            memory.append(f"- {name}: end-of-task samples {r['samples']}")
    if memory:
        lines += ["", "Memory model (no profiling pass unless stored; corrected online):", *memory]
    lines += ["", "Step graphs (trainer.step_graphs) per run: " + json.dumps({k: r.get("graphs") for k, r in
                                                                          res["runs"].items()}),
              "", "Admission and timings events: " + json.dumps({k: (r.get("admission"), r.get("timings"))
                                                                 for k, r in res["runs"].items()}, default=str)]
    return "\n".join(lines) + "\n"


def mfu_of(run: dict, layers: int) -> float:
    """A run's training MFU: its matmul FLOPs per token (flops_per_token) over the training phase, against
    PEAK_TFLOPS."""
    tps = run["train_tokens"] / max(run["phases"]["train"], 1e-9)
    return flops_per_token(run.get("timings") or {}) * config_matmul_params(llama8b_config(layers)) * tps \
        / (PEAK_TFLOPS * 1e12)


def flops_per_token(timings: dict) -> float:
    """FLOPs per backbone parameter and training token: 6 (forward and backward), 8 with the forward
    recomputed, weighted by the steps that recomputed (the executor's `recompute_steps` and
    `no_recompute_steps`: the "recompute" setting, "auto" included, does not say which did; without
    the counts, as before them: 8 unless recompute is off)."""
    rec, plain = timings.get("recompute_steps"), timings.get("no_recompute_steps")
    if rec is None or plain is None or rec + plain == 0:
        return 8.0 if timings.get("recompute", True) else 6.0
    return 6.0 + 2.0 * rec / (rec + plain)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-val", type=int, default=256)
    ap.add_argument("--runs", default="cold,warm")
    ap.add_argument("--work", default="/tmp/executor_task")
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--eval", choices=sorted(EVALS), default="product",
                    help="product: the product's evaluation defaults; every10: every 10 steps on the whole "
                         "validation set (the tables of sessions 17-20)")
    ap.add_argument("--sync-probe", action="store_true",
                    help="each evaluation group's host syncs, host time and module loads (sync_probe)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the work directory's model (and stored profiles): a later process of a node")
    ap.add_argument("--lora-form", choices=("product", "base"), default="product",
                    help="base: every LoRA linear its backbone GEMM alone (bench/kconcat_step.py): the task's pace "
                         "were the LoRA term free (its jobs learn nothing: the early exit ranks ties)")
    ap.add_argument("--step-sync", action="store_true",
                    help="sync before and after every training step (the per-step timings of sessions 19-64; "
                         "slower than the product, STEP_SYNC)")
    ap.add_argument("--profile-steps", default="",
                    help="training steps (0-based, comma-separated) run under torch.profiler: a table file each, "
                         "OUT's name + _stepN.txt (bench/step_profile.py)")
    args = ap.parse_args()
    global STEP_SYNC
    STEP_SYNC = args.step_sync
    if args.profile_steps:
        PROFILE["steps"] = {int(i) for i in args.profile_steps.split(",")}
        PROFILE["prefix"] = str(Path(args.out or "executor_task").with_suffix(""))
    if args.lora_form == "base":
        from kconcat_step import use_base_form

        use_base_form()
    # as worker.processes.spawn gives every GPU process of a node (the repeatable decode's samples)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if args.sync_probe:
        sync_probe()
    if args.smoke:
        te.SMOKE["on"] = True
        args.layers, args.steps, args.n_train, args.n_val = 2, 3, 24, 8
    root = Path(args.work)
    model_dir = root / "model"
    if not (args.reuse and (model_dir / "config.json").exists()):
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        tok = te.make_tokenizer()
        te.log("building the model")
        model_dir = te.large_model(model_dir, args.layers, tok)
    train = write_data(root / "train.jsonl", args.n_train, 1)
    val = write_data(root / "val.jsonl", args.n_val, 2)
    cache = root / "profiles.json"
    res = {"args": vars(args), "runs": {}}
    for name in args.runs.split(","):
        te.log(f"run {name}")
        # a run named "...eager..." launches every step eagerly (no CUDA graphs): the side-by-side baseline
        res["runs"][name] = run(model_dir, train, val, root / f"out_{name}", args.steps, cache,
                                graphs="eager" not in name, evaluation=args.eval)
        te.log(json.dumps(res["runs"][name], default=str))
        te.free()
    text = render(res, args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
