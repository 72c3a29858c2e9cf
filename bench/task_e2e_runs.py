"""bench/task_e2e.py's executor runs: the real executor on the small model (quality, the trace),
at the large shape with the small model's losses replayed ((a), (b), timed, the floor on (b)'s own
batches), and on the CPU with the backbone replaced by zeros (--pack-only: shapes and padding)."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import capture_peaks  # noqa: E402, F401  (a diagnostic where LORAPLEX_BENCH_CAPTURE_PEAKS is set)
from task_e2e_data import DEV, SMOKE, free, large_model, log, small_model, sync  # noqa: E402
from task_e2e_peft import time_floor  # noqa: E402

import trainer.engine as engine_mod  # noqa: E402
from contract.protocol import EarlyExitSettings, EvalSettings, TaskSettings  # noqa: E402
from trainer.arena import AdapterArena  # noqa: E402
from trainer.colocate import TaskRun  # noqa: E402
from trainer.data import read_jsonl, tokenize_all  # noqa: E402
from trainer.executor import Callbacks, Executor, ExecutorConfig  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402


def triton_kernels() -> int:
    """Entries of this process's Triton cache (a step that grew it compiled kernels); -1: none."""
    path = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return sum(1 for _ in os.scandir(path)) if path.is_dir() else -1


# ----------------------------------------------------------------------------- executor runs
@dataclass
class Record:
    train: dict[str, dict[int, float]] = field(default_factory=dict)
    val: dict[str, dict[int, float]] = field(default_factory=dict)
    events: list[tuple[str, str, dict]] = field(default_factory=list)
    states: dict[str, tuple[str, dict]] = field(default_factory=dict)

    def callbacks(self) -> Callbacks:
        return Callbacks(
            on_train_loss=lambda j, s, v: self.train.setdefault(j, {}).__setitem__(s, v),
            on_eval=lambda j, s, v: self.val.setdefault(j, {}).__setitem__(s, v),
            on_job_state=lambda j, st, d: self.states.__setitem__(j, (st, d)),
            on_event=lambda j, m, d: self.events.append((j, m, d)),
        )


def replay_trace(b: Record, a: Record) -> Record:
    """The losses the large runs replay: each job's (a) run's, train and evaluation alike, with
    (b)'s for the steps (a) did not run (the decisions see what the small (a) run saw)."""
    jobs = set(b.train) | set(a.train) | set(b.val) | set(a.val)
    return Record(train={j: {**b.train.get(j, {}), **a.train.get(j, {})} for j in jobs},
                  val={j: {**b.val.get(j, {}), **a.val.get(j, {})} for j in jobs})


class TraceExecutor(Executor):
    """The real executor whose engine computes everything at the large shape, but whose train
    and validation losses are replaced by the small model's at the same job and step."""

    def __init__(self, cfg: ExecutorConfig, cb: Callbacks, trace: Record, recorder: dict,
                 shape_buckets: bool = True, attention: str = "rows") -> None:
        cfg.attention = attention  # the executor's own setting (profile key included)
        super().__init__(cfg, cb)
        self.trace, self.recorder, self.missing = trace, recorder, 0
        self.shape_buckets = shape_buckets

    def _timed_parts(self) -> None:
        """The loop's work outside its phases (its "idle" seconds), by part: the step's outcome
        to the tasks (callbacks, exit decisions: `_observe_train`), the step boundary (attach,
        detach), the jobs' completion, the strategy's flush."""
        rec, clock = self.recorder, self.clock  # the process's one recorder (install_recorder renews its counters)

        def timed(name: str, fn: Any) -> Any:  # noqa: ANN401
            def run(*a: Any, **kw: Any) -> Any:  # noqa: ANN401
                t0, phased = time.perf_counter(), sum(clock.phases.values())
                try:
                    return fn(*a, **kw)
                finally:  # its seconds outside the phases it entered (an export, the samples)
                    rec["idle_parts"][name] += time.perf_counter() - t0 - (sum(clock.phases.values()) - phased)
            return run

        self._observe_train = timed("observe", self._observe_train)  # the loop calls it on self
        self.roster.boundary = timed("boundary", self.roster.boundary)
        self.roster.end_idle = timed("end_idle", self.roster.end_idle)
        self.strategy.flush = timed("flush", self.strategy.flush)
        if not getattr(TaskRun.finish_done, "timed", False):  # the loop calls it on the class too
            TaskRun.finish_done = timed("finish_done", TaskRun.finish_done)
            TaskRun.finish_done.timed = True

    def _traced_writes(self) -> None:
        """Each write of the writer thread: [kind, MB of snapshot, seconds since the loop started
        when submitted, seconds queued, seconds writing] (what the loop's waits for it are made of)."""
        writer, rec = self.writer, self.recorder
        if writer is None:
            return
        real_submit = writer.submit

        def submit(task_id, kind, nbytes, work):  # noqa: ANN001, ANN202
            row = [kind, round(nbytes / 2**20, 1), round(time.perf_counter() - (self.clock.started_at or 0.0), 2)]
            queued = time.perf_counter()

            def timed_work():  # noqa: ANN202
                t0 = time.perf_counter()
                try:
                    return work()
                finally:
                    row.extend([round(t0 - queued, 2), round(time.perf_counter() - t0, 2)])

            rec["writes"].append(row)
            return real_submit(task_id, kind, nbytes, timed_work)

        writer.submit = submit

    def _load(self) -> None:
        super()._load()
        self._timed_parts()
        self._traced_writes()
        eng, real_step, real_eval = self.engine, self.engine.step, self.engine.evaluate_metrics
        if not self.shape_buckets:
            eng.shape_buckets = None

        def step():  # noqa: ANN202
            n = len(self.recorder["step_s"])
            prof = self.recorder.get("profile_at")
            if prof is not None and n == prof:  # a torch.profiler window of 3 steps
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else [])
                self.recorder["profiler"] = profile(activities=acts)
                self.recorder["profiler"].__enter__()
            before, ctx = graph_counts(eng), context(self)
            t0 = time.perf_counter()
            self.recorder["active"] = True
            try:
                report = real_step()
            finally:
                self.recorder["active"] = False
            sync()
            self.recorder["step_s"].append(time.perf_counter() - t0)
            # [tokens, jobs, recompute, seconds, graph event, each pass's cells where split, else 0]
            self.recorder["step_trace"].append([
                report.tokens, len(report.losses), int(bool(eng.gradient_checkpointing)),
                round(self.recorder["step_s"][-1], 4), graph_event(eng, before), report.pass_cells or 0,
                context_change(self, ctx)])
            if self.recorder["step_s"][-1] > 1.0:  # the slow steps as they come (a killed run still tells)
                log(f"step {n}: {self.recorder['step_trace'][-1]}, Triton's cache holds {triton_kernels()}")
            if prof is not None and n == prof + 2:
                (p := self.recorder.pop("profiler")).__exit__(None, None, None)
                ev = p.key_averages()  # once for both tables: over 48-job eager steps it takes many seconds
                self.recorder["profile_table"] = "".join(ev.table(sort_by=k, row_limit=25, max_name_column_width=60)
                                                         for k in ("self_cpu_time_total", "self_device_time_total"))
                self.recorder["profile_steps_s"] = self.recorder["step_s"][-3:]
            if self.trace is not None:
                for j in report.losses:
                    report.losses[j] = self.trace.train[j][report.steps[j]]
            return report

        def evaluate_metrics(examples, batch_size=8, job_ids=None, max_sequences=None,  # noqa: ANN001, ANN202
                             forwards=None):
            before, ctx, t0 = graph_counts(eng), context(self), time.perf_counter()
            # LORAPLEX_BENCH_PROFILE_EVAL=N: the N-th evaluation (from 0) under torch.profiler, its
            # top kernels and host ops logged (where a slow evaluation's time goes)
            index = str(len(self.recorder["eval_trace"]))
            profiled = os.environ.get("LORAPLEX_BENCH_PROFILE_EVAL") == index
            if profiled:
                from torch.profiler import ProfilerActivity, profile

                prof = profile(activities=[ProfilerActivity.CPU]
                               + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else []))
                prof.__enter__()
            # LORAPLEX_BENCH_CPROFILE_EVAL=N: the N-th evaluation's Python functions (cProfile), logged
            py_prof = None
            if os.environ.get("LORAPLEX_BENCH_CPROFILE_EVAL") == index:
                import cProfile

                py_prof = cProfile.Profile()
                py_prof.enable()
            out = real_eval(examples, batch_size, job_ids, max_sequences, forwards)
            sync()
            if py_prof is not None:
                import io
                import pstats

                py_prof.disable()
                text = io.StringIO()
                pstats.Stats(py_prof, stream=text).sort_stats("tottime").print_stats(25)
                log(f"cProfiled evaluation: wall {time.perf_counter() - t0:.2f} s\n{text.getvalue()}")
            if profiled:
                prof.__exit__(None, None, None)
                events = prof.key_averages()
                gpu_us = sum(e.self_device_time_total for e in events)
                log(f"profiled evaluation: wall {time.perf_counter() - t0:.2f} s, kernels {gpu_us / 1e6:.2f} s\n"
                    + events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=50)
                    + events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
            # [jobs, examples, examples per forward, sequences per forward, seconds, graph counts' change]
            after = graph_counts(eng)
            self.recorder["eval_trace"].append([
                len(out), len(examples), batch_size, max_sequences, round(time.perf_counter() - t0, 4),
                {k: after[k] - before[k] for k in after if after[k] != before[k]}, context_change(self, ctx)])
            if self.recorder["eval_trace"][-1][4] > 2.0:
                log(f"evaluation: {self.recorder['eval_trace'][-1]}")
            for j in out if self.trace is not None else ():
                curve, step = self.trace.val.get(j, {}), eng.jobs[j].step
                if step not in curve:
                    self.missing += 1
                    step = max([s for s in curve if s <= step] or [min(curve)])
                out[j]["loss"] = curve[step]
            return out

        eng.step, eng.evaluate_metrics = step, evaluate_metrics


REC: dict[str, Any] = {}


CONTEXT_STATES = ("writer_pending_mb", "pinner_running", "allocated_mb", "parked_device_mb", "graph_pool_mb")  # at start


def context(executor: Any) -> dict[str, float]:
    """What else the process was doing around a step or an evaluation: the allocator's retries and
    cudaMalloc calls, the pinned pool's growth on the loop and its background pinning, the bytes
    waiting for the file writer and whether the background pinner runs; on a GPU what the device
    holds at the start (allocated, of it the states parked on the device, and the step graphs'
    pool beside it: what leaves a step room to run without recompute)."""
    from trainer.arena import state_bytes
    from trainer.host_pool import POOL
    from trainer.memory_plan import allocator_counts

    device = getattr(executor, "device", None)
    c = {**allocator_counts(device), **POOL.counts()}
    writer = getattr(executor, "writer", None)
    c["writer_pending_mb"] = round(getattr(writer, "_pending_bytes", 0) / 2**20, 1)
    c["pinner_running"] = int(POOL._pinner.running)
    if device is not None and device.type == "cuda":
        parked = [t.parked[j] for t in executor.tasks.values() for j in t.parked_on_device if j in t.parked]
        graphs = getattr(executor.engine, "step_graphs", None)
        c["allocated_mb"] = round(torch.cuda.memory_allocated(device) / 2**20)
        c["parked_device_mb"] = round(sum(state_bytes(s) for s in parked) / 2**20)
        c["graph_pool_mb"] = round((graphs.pool_bytes if graphs is not None else 0) / 2**20)
    return c


def context_change(executor: Any, before: dict[str, float]) -> dict[str, float]:
    """The counters that moved since `before` (their change), and the writer's backlog and the
    pinner's state at the start where they were non-zero."""
    after = context(executor)
    moved = {k: round(after[k] - v, 3) for k, v in before.items()
             if k not in (*CONTEXT_STATES, "pool_pinned_gb") and after.get(k) != v}
    return {**moved, **{k: before[k] for k in CONTEXT_STATES if before.get(k)}}


def graph_counts(eng: Any) -> dict[str, int]:
    graphs = getattr(eng, "step_graphs", None)
    return graphs.stats() if graphs is not None else {}


def graph_event(eng: Any, before: dict[str, int]) -> str:
    """What the step graphs did in a step: replay, capture, eager, covered, a capture begun on the thread (or none)."""
    keys, after = ("captures", "eager_runs", "covered", "replays", "ahead_thread_started"), graph_counts(eng)
    changed = [k for k in keys if after.get(k, 0) != before.get(k, 0)]
    return "+".join(changed) or "none"


def install_recorder() -> dict:
    """Record every training step's packed batch (CPU) and the host time of packing/layout."""
    fresh = not REC
    REC.update({"active": False, "batches": [], "step_s": [], "pack_s": 0.0, "layout_s": 0.0,
                "step_trace": [], "eval_trace": [], "idle_parts": Counter(), "writes": []})
    rec = REC
    if not fresh:
        return rec
    real_layout = AdapterArena.set_layout

    def recorded(real):  # noqa: ANN001, ANN202
        def pack(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            batch = real(*a, **kw)
            if rec["active"]:
                rec["pack_s"] += time.perf_counter() - t0
                rec["batches"].append((batch.input_ids, batch.position_ids, batch.targets,
                                       batch.cu_seqlens))
            return batch
        return pack

    def set_layout(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        real_layout(self, *a, **kw)
        if rec["active"]:
            rec["layout_s"] += time.perf_counter() - t0

    engine_mod.pack_step = recorded(engine_mod.pack_step)
    engine_mod.pack_flat = recorded(engine_mod.pack_flat)
    AdapterArena.set_layout = set_layout
    return rec


def executor_cfg(model_dir: Path, data: tuple[Path, Path], out: Path, jobs: list[TrainJob],
                 early_exit: bool, args: argparse.Namespace, cache: Path) -> ExecutorConfig:
    return ExecutorConfig(
        model_dir=str(model_dir), train_file=str(data[0]), val_file=str(data[1]),
        output_dir=str(out), jobs=[TrainJob(**vars(j)) for j in jobs],
        settings=TaskSettings(max_seq_len=args.seq, early_exit=EarlyExitSettings(
            enabled=early_exit, train_while_waiting=getattr(args, "train_while_waiting", False)),
                              eval=EvalSettings(eval_every_steps=50, eval_max_samples=args.n_val,
                                                eval_every_samples=args.eval_every_samples)),
        checkpoint_every=None, checkpoint_every_s=300.0, profile_cache=str(cache) if cache else None,
        **({"write_buffer_bytes": args.write_buffer_gb * 2**30} if getattr(args, "write_buffer_gb", None) else {}))


def run_small(model_dir: Path, data, root: Path, jobs, early_exit: bool, args, cache) -> tuple[Record, dict, Executor]:  # noqa: ANN001
    rec = Record()
    ex = Executor(executor_cfg(model_dir, data, root / f"small_{int(early_exit)}", jobs,
                               early_exit, args, cache), rec.callbacks())
    status = ex.run()
    return rec, status, ex


# ----------------------------------------------------------------------------- report
def best_val(rec: Record, jobs: list[str] | None = None) -> tuple[float, str]:
    vals = [(v, j) for j, c in rec.val.items() if jobs is None or j in jobs for v in c.values()
            if math.isfinite(v)]
    return min(vals)


def summarize_statuses(states: dict[str, tuple[str, dict]]) -> dict[str, str]:
    return {j: st + (f":{d.get('exit_reason')}" if st == "exited" else "")
            for j, (st, d) in sorted(states.items())}


def quality(args, root, tok, chain_a, data, jobs, cache, res, dump) -> Record:  # noqa: ANN001
    """The small model pretrained on chain A, then the grid through the real executor without
    (b) and with (a) early exit: the quality numbers and the trace the large runs replay."""
    log("pretraining the small model")
    small_dir, pre_loss = small_model(root / "small", chain_a, tok, args.pretrain_steps)
    res["small_pretrain_loss"] = pre_loss
    log("small pretrain loss", pre_loss)

    # ---- quality: the small model through the same executor, grid and data
    small_b, st_b, ex_b = run_small(small_dir, data, root, jobs, False, args, cache)
    res["small_b_timings"] = ex_b.timings()
    log("small (b)", res["small_b_timings"])
    dump()
    small_a, st_a, ex_a = run_small(small_dir, data, root, jobs, True, args, cache)
    res["small_a_timings"] = ex_a.timings()
    log("small (a)", res["small_a_timings"])
    del ex_a, ex_b
    trace = replay_trace(small_b, small_a)
    n_train_ex = len(tokenize_all(tok, read_jsonl(data[0]), args.seq))
    samples_b = sum(j.total_steps(n_train_ex) * j.batch_size for j in jobs)
    steps_a = {j: max(c) for j, c in small_a.train.items()}
    spec = {j.job_id: j for j in jobs}
    samples_a = sum(steps_a[j] * spec[j].batch_size for j in steps_a)
    qa, ja = best_val(small_a)
    qb, jb = best_val(small_b)
    res["quality"] = {"best_a": qa, "best_job_a": ja, "best_b": qb, "best_job_b": jb,
                      "samples_a": samples_a, "samples_b": samples_b,
                      "statuses_a": summarize_statuses(small_a.states),
                      "val_at_start": statistics.median(min(c.items())[1] for c in small_b.val.values())}
    log("quality", res["quality"])
    dump()
    free()
    return trace


def shape_summary(shapes: dict) -> dict:
    """Distinct backbone-forward shapes (attention plans) of an engine's forward_shapes."""
    train = {k[:2] for k, n in shapes.items() if k[2]}
    evals = {k[:2] for k, n in shapes.items() if not k[2]}
    return {"train": len(train), "eval": len(evals), "total": len(shapes),
            "forwards": sum(shapes.values()),
            "top": sorted(([list(k), n] for k, n in shapes.items()), key=lambda x: -x[1])[:8]}


class PackOnlyExecutor(Executor):
    """(b)'s executor with the backbone replaced by zeros: packing, admission, evaluation points
    and updates are the real ones, the model costs nothing (shapes and padding on the CPU)."""

    def __init__(self, cfg: ExecutorConfig, cb: Callbacks, buckets: bool, attention: str) -> None:
        cfg.attention = attention
        super().__init__(cfg, cb)
        self.buckets, self.cells, self.real = buckets, 0, 0

    def _load(self) -> None:
        super()._load()
        eng = self.engine
        if not self.buckets:
            eng.shape_buckets = None
        width = eng.model.config.hidden_size

        def hidden(batch):  # noqa: ANN001, ANN202
            eng.forward_shapes[(*batch.input_ids.shape, torch.is_grad_enabled())] += 1
            if torch.is_grad_enabled():
                self.cells += batch.input_ids.numel()
                self.real += batch.real_tokens
            return torch.zeros(*batch.input_ids.shape, width, requires_grad=torch.is_grad_enabled())

        eng.hidden = hidden
        # nor does the head: a zero loss that keeps the graph (the step's shapes are what counts)
        eng._job_loss_sum = lambda h, targets, index=None, n=None: (h.sum() * 0.0, n or 1)  # noqa: ARG005


def pack_only(args: argparse.Namespace, root: Path, data: tuple[Path, Path], jobs: list[TrainJob],
              tok) -> dict:  # noqa: ANN001
    """Shapes and padding of (b) on the CPU: rows in free shapes, rows in bucketed shapes, one
    varlen row."""
    SMOKE["on"] = True
    model_dir = large_model(root / "toy", 1, tok)
    out = {}
    for name, buckets, attention in (("free", False, "rows"), ("buckets", True, "rows"),
                                     ("varlen", True, "varlen")):
        cfg = executor_cfg(model_dir, data, root / f"pack_{name}", jobs, False, args, None)
        cfg.device, cfg.max_tokens_per_step = "cpu", args.max_total_batch * args.seq
        cfg.checkpoint_every, cfg.checkpoint_every_s = 10**9, None
        ex = PackOnlyExecutor(cfg, Record().callbacks(), buckets, attention)
        t0 = time.perf_counter()
        ex.run()
        out[name] = {**shape_summary(ex.engine.forward_shapes), "steps": ex.global_step,
                     "padding": 1 - ex.real / max(ex.cells, 1), "host_s": time.perf_counter() - t0}
        log(name, out[name])
    return out


def large_run(name: str, ee: bool, attention: str, *, args: argparse.Namespace, root: Path,
              large_dir: Path, data: tuple[Path, Path], jobs: list[TrainJob], trace: Record | None,
              cache: Path, res: dict, floor: bool = True) -> dict:
    """One executor run at the large shape ((a) with early exit, (b) without), the small model's
    losses replayed (trace); (b) also times the floor on its own packed batches. `res` holds the
    quality phase's statuses ((a)'s decisions are checked against them)."""
    spec = {j.job_id: j for j in jobs}
    rec = install_recorder()
    at = os.environ.get("LORAPLEX_BENCH_PROFILE_A", "").partition(":")  # "N:FILE": (a)'s steps N..N+2 instead
    profile_out = (at[2] if name == "a" else "") if at[2] else getattr(args, "profile_out", "")
    rec["profile_at"] = (int(at[0]) if at[2] else 100) if profile_out and (at[2] or name == "b") else None
    out = Record()
    runs_dir = getattr(args, "runs_dir", "")  # e.g. tmpfs: (a)'s checkpoints outgrow a small disk
    out_dir = Path(runs_dir or root) / f"large_{name}"
    shutil.rmtree(out_dir, ignore_errors=True)
    cfg = executor_cfg(large_dir, data, out_dir, jobs, ee, args, cache)
    cfg.cudnn_attention = getattr(args, "cudnn_attention", True)
    cfg.async_writes = getattr(args, "async_writes", True)
    ex = TraceExecutor(cfg, out.callbacks(), trace, rec, getattr(args, "shape_buckets", True), attention)
    t0 = time.perf_counter()
    try:
        ex.run()
        wall = time.perf_counter() - t0
        tm = ex.timings()  # before the folder's removal below (the executor's wall counts to now)
    finally:
        if runs_dir:  # its checkpoints and exports are not read again: the memory goes back
            shutil.rmtree(out_dir, ignore_errors=True)
    mm = next((d for j, m, d in out.events if m == "memory_model"), {"k0": None, "k1": None})
    run = {**tm, "wall_outer_s": wall, "steps": len(rec["step_s"]),
           "missing_trace_points": ex.missing, "statuses": summarize_statuses(out.states),
           "host_pack_s": rec["pack_s"], "host_layout_s": rec["layout_s"],
           "max_total_batch": ex.admission.max_total_batch(), "k0": mm["k0"], "k1": mm["k1"],
           "evals": sum(len(c) for c in out.val.values()),
           "attention_shapes": shape_summary(ex.engine.forward_shapes),
           "padding": statistics.fmean(1 - (b[0] != 0).sum().item() / b[0].numel()
                                       for b in rec["batches"]) if rec["batches"] else None,
           "samples": sum(max(c) * spec[j].batch_size for j, c in out.train.items()),
           "job_steps": {j: max(c) for j, c in out.train.items()},
           "eval_forwards_note": "sequences per eval forward up to max_total_batch",
           # every step the allocator saw: [cells, recompute, resident, peak, predicted] in MB
           "step_trace": rec["step_trace"], "eval_trace": rec["eval_trace"],
           "idle_parts_s": {k: round(v, 3) for k, v in rec["idle_parts"].items()},
           # every write of the writer thread and the GB by kind (bench-side: TraceExecutor._traced_writes)
           "writes": rec["writes"], "written_gb": {k: round(sum(w[1] for w in rec["writes"] if w[0] == k) / 1024, 2)
                                                  for k in ("checkpoint", "export")},
           "graphs": graph_counts(ex.engine),
           "memory_trace": [[p.tokens, int(p.recompute), p.resident >> 20, p.peak >> 20, round(p.predicted) >> 20,
                             round(p.adapter_params / 1e6)] for c in ex.memory.corrections.values() for p in c.trace]}
    if rec.get("profile_table") and profile_out:
        Path(profile_out).write_text(f"steps (s, profiled): {rec['profile_steps_s']}\n{rec['profile_table']}\n")
    if name == "a" and "quality" in res:
        run["decisions_match_small"] = run["statuses"] == res["quality"]["statuses_a"]
    elif not rec["batches"]:  # no training step ran: say why instead of timing nothing
        run["no_steps"] = {j: d for j, (st, d) in out.states.items() if st != "completed"}
        log("no training step recorded", run["statuses"], run["no_steps"])
    elif floor:
        # the floor on (b)'s own packed batches: the engine's model with no job attached
        log("floor on", len(rec["batches"]), "recorded batches")
        run["floor"] = time_floor(ex.engine.model, rec["batches"], rec["step_s"],
                                  getattr(args, "floor_steps", 24))
    log(name, {k: v for k, v in run.items() if k != "statuses"})
    ex.engine.model.to("meta")
    del ex
    rec["batches"] = []
    free()
    return run
