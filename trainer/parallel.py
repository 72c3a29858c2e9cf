"""Adapter parallelism, the executor half: one task's executor over P processes (one per GPU), the
backbone FSDP2-sharded across them, each rank training its own disjoint set of the task's jobs.

Launch: `run_parallel(cfg, nproc, callbacks, should_stop)` (or `python -m trainer.parallel
config.json --nproc P`) spawns P ranks (NCCL on CUDA, rank r on cuda:r; gloo on CPU) and returns
the jobs' final status like `Executor.run`. Only the calling process sees callbacks: rank 0
forwards them through a queue (in order, and file announcements only after the owning rank has
written the files), so the daemon's one spool writer stays in one process.

Control is replicated: every rank holds the whole task's bookkeeping (queue, placement of every
job, statuses, every job's early-exit monitor, the warmup ranking) and changes it only from
all-gathered numbers in the same order, so every decision (admission, backfill, ranking,
eviction, stop) is the same on every rank without being sent. Tensors stay on their owner: a
job's adapter, AdamW state and data stream never leave the rank that trains it.

Lockstep: each executor step every rank runs one backbone forward + backward (a rank with no
runnable job an idle pass over one pad token), and each evaluation the same number of forwards
(padded with idle forwards), so FSDP's all-gathers pair up. Backfill comes first: a rank whose
job exited takes a queued job at the next admission; only when nothing is left for it does it
idle. An idle rank does not slow the others (it joins the all-gathers they need anyway, with a
1-token pass: the (b) rows at batch 1 of bench/results/adapter_parallel_h200x2.md run exactly
that); shrinking the placement would reshard the backbone onto fewer GPUs mid-task, impossible
when the model needs all P to fit, and worth it only if the scheduler had work for the freed GPU.

Checkpoints: each rank writes its jobs' states, rank 0 merges them with the shared state into
the one `state.pt` of the single-GPU format (plus owners), which the runner uploads as before.
Resume on the same P keeps every job on its rank; on another P (or from a single-GPU state.pt)
the jobs are dealt to the least-loaded ranks, which gives the same adapters because a job's
trajectory does not depend on where or next to whom it runs.
"""

from __future__ import annotations

import logging
import math
import os
import queue as queue_mod
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.admission import AdmissionController, MemoryModel
from trainer.checkpoint import (
    job_state_dict,
    restore_job,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from trainer.data import read_jsonl, split_validation, tokenize_all
from trainer.early_exit import ExitDecision
from trainer.engine import JobSpec
from trainer.executor import Callbacks, Executor, ExecutorConfig
from trainer.export import export_peft
from trainer.parallel_engine import ParallelEngine, eval_forwards

log = logging.getLogger("loraplex.parallel")

CALLBACK_KINDS = ("on_train_loss", "on_eval", "on_job_state", "on_adapter", "on_event", "on_metrics")


@dataclass
class JobSlot:
    """Where a started job lives (known to every rank): its owner and its step count."""

    job_id: str
    owner: int
    batch_size: int
    step: int
    total_steps: int


class ParallelExecutor(Executor):
    """One rank of an adapter-parallel executor (see the module docstring); call `run` on every
    rank of an initialised process group. Callbacks fire on rank 0 only, after a barrier."""

    def __init__(self, cfg: ExecutorConfig, callbacks: Callbacks | None = None,
                 stop_requested: Callable[[], bool] | None = None) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        super().__init__(cfg, None)
        self.real_cb = callbacks if (callbacks is not None and self.rank == 0) else None
        self.deferred: list[tuple[str, tuple]] = []
        self.cb = Callbacks(*(self._deferrer(k) for k in CALLBACK_KINDS))
        self.stop_requested = stop_requested
        self.placed: dict[str, JobSlot] = {}  # running jobs of every rank, in placement order
        self.parked: dict[str, Any] = {}  # this rank's parked JobStates (on CPU)

    def _deferrer(self, kind: str) -> Callable[..., None]:
        def f(*args: Any) -> None:
            if self.real_cb is not None:
                self.deferred.append((kind, args))
        return f

    def _sync(self) -> None:
        """Barrier, then rank 0 fires the callbacks collected since the last one (by then every
        owner has written the adapter files they announce)."""
        dist.barrier()
        pending, self.deferred = self.deferred, []
        for kind, args in pending:
            getattr(self.real_cb, kind)(*args)

    # ----- setup -------------------------------------------------------------------------
    def _load(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cfg = self.cfg
        check_supported(cfg)
        cuda = torch.cuda.is_available() and cfg.device in ("auto", "cuda")
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dtype = torch.bfloat16 if cuda else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
        # every rank reads the checkpoint to host memory; FSDP keeps 1/P of it on the GPU
        model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=dtype)
        train = tokenize_all(self.tokenizer, read_jsonl(cfg.train_file), cfg.max_seq_len)
        if cfg.val_file:
            val = tokenize_all(self.tokenizer, read_jsonl(cfg.val_file), cfg.max_seq_len)
        else:
            train, val = split_validation(train, cfg.val_fraction, cfg.split_seed)
        if not train or not val:
            raise ValueError("no trainable examples left after tokenisation/truncation")
        self.val = val
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        mesh = init_device_mesh(device.type, (self.world,))
        self.engine = ParallelEngine(
            model, train, pad, mesh=mesh, device=device, targets=cfg.targets,
            gradient_checkpointing=cfg.gradient_checkpointing, backend=cfg.backend,
            adapter_dtype=getattr(torch, cfg.adapter_dtype),
        )
        if cuda and cfg.max_tokens_per_step is None:
            budget = cfg.memory_budget_bytes or torch.cuda.get_device_properties(device).total_memory
            mm = MemoryModel(*cfg.memory_model) if cfg.memory_model else self._profile_memory_model()
            # ranks measure slightly different peaks; all must decide alike: take the largest
            fits: list[Any] = [None] * self.world
            dist.all_gather_object(fits, (mm.k0, mm.k1))
            mm = MemoryModel(max(f[0] for f in fits), max(f[1] for f in fits))
            self.cb.on_event("", "memory_model", {"k0": mm.k0, "k1": mm.k1, "budget_bytes": budget,
                                                  "per_rank": True})
            self.admission = AdmissionController(mm, budget, cfg.max_seq_len, max_jobs=cfg.max_active_jobs)
        else:
            self.admission = AdmissionController.from_token_budget(
                cfg.max_tokens_per_step or 1 << 60, cfg.max_seq_len, cfg.max_active_jobs)
        self.cb.on_event("", "executor_loaded", {"train": len(train), "val": len(val), "device": str(device),
                                                 "ranks": self.world})

    # ----- the recipe (Executor.run, in lockstep) ----------------------------------------
    def run(self) -> dict[str, dict[str, Any]]:
        self._load()
        state_path = self.out / "state.pt"
        if state_path.exists():
            self._resume(torch.load(state_path, map_location="cpu", weights_only=False, mmap=True))
        for job_id in self.admission.unschedulable([q for q in self.queue if isinstance(q, JobSpec)]):
            self.queue = [q for q in self.queue if q.job_id != job_id]
            self._set_state(job_id, "failed", {"error": "does not fit the executor's memory even alone"})
            if self.ranking is not None:
                self.ranking.exit(job_id)
        while True:
            self._admit()
            done = [j for j, s in self.placed.items() if s.step >= s.total_steps]
            for job_id in done:
                self._finish(job_id)
            if done:
                continue
            if not self.placed:
                break
            report = self.engine.step() if self.engine.jobs else None
            if report is None:
                self.engine.idle_step()
            self.global_step += 1
            for slot in self.placed.values():
                slot.step += 1
            stop = self._observe_train(report)
            self._evaluate_due()
            self._warmup_policy()
            for job_id in [j for j, s in self.placed.items() if s.step >= s.total_steps]:
                self._finish(job_id)
            if self.global_step % self.cfg.checkpoint_every == 0:
                self._checkpoint()
            if stop or (self.cfg.stop_after_steps is not None and self.global_step >= self.cfg.stop_after_steps):
                self._checkpoint()
                self._sync()
                return self.status
            self._sync()
        self._checkpoint()
        self._sync()
        return self.status

    # ----- pieces of the loop --------------------------------------------------------------
    def _gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def _observe_train(self, report: Any) -> bool:
        local = {} if report is None else {
            j: (report.steps[j], report.losses[j], report.skipped[j], report.grad_norms[j],
                getattr(report, "metrics", {}).get(j))
            for j in report.losses}
        stop = bool(self.stop_requested is not None and self.stop_requested())
        parts = self._gather((local, stop, None if report is None else report.padded_fraction))
        merged = {j: v for part in parts for j, v in part[0].items()}
        fractions = [p[2] for p in parts if p[2] is not None]
        self.padded.append(sum(fractions) / max(len(fractions), 1))
        for job_id in list(self.placed):
            step, loss, skipped, norm, metrics = merged[job_id]
            if metrics:
                self.cb.on_metrics(job_id, step, "train", metrics)
            self.cb.on_train_loss(job_id, step, loss)
            if skipped:
                self.cb.on_event(job_id, "update_skipped", {"step": step, "loss": loss, "grad_norm": norm})
            decision = self.monitors[job_id].observe_train(step, loss)
            if decision is not None:
                self._exit(job_id, decision)
        return any(p[1] for p in parts)

    def _rank_batch(self, rank: int) -> int:
        return sum(s.batch_size for s in self.placed.values() if s.owner == rank)

    def _admit(self) -> None:
        """Global, deterministic admission: one job at a time to the least-loaded rank whose
        per-rank admission controller takes it; a parked job only returns to its own rank."""
        ranking_open = self.ranking is not None and self.ranking.result is None
        while True:
            order = sorted(range(self.world), key=lambda r: (
                self._rank_batch(r), sum(s.owner == r for s in self.placed.values()), r))
            for r in order:
                cands = [q for q in self.queue if isinstance(q, JobSpec) or (q.owner == r and not ranking_open)]
                running = [s for s in self.placed.values() if s.owner == r]
                chosen = self.admission.admit(cands, running) if cands else []
                if chosen:
                    self._place(chosen[0], r)
                    break
            else:
                return

    def _place(self, job_id: str, rank: int) -> None:
        item = next(q for q in self.queue if q.job_id == job_id)
        self.queue.remove(item)
        resumed = isinstance(item, JobSlot)
        if resumed:
            slot = item
        else:
            slot = JobSlot(job_id, rank, item.batch_size, 0, item.total_steps(len(self.engine.train_examples)))
        self.placed[job_id] = slot
        if rank == self.rank:
            self.engine.attach(self.parked.pop(job_id) if resumed else item)
        if self.status[job_id]["state"] != "running":
            self._set_state(job_id, "running", {"resumed": resumed, "rank": rank})

    def _evaluate_due(self) -> None:
        due = []
        for job_id, s in self.placed.items():
            warm_end = self._warmup_len(s) if self._in_warmup(job_id) else -1
            if s.step % self.cfg.eval_every == 0 or s.step >= s.total_steps or s.step == warm_end:
                if self.last_eval.get(job_id) != s.step:
                    due.append(job_id)
        if not due:
            return
        bs = self.cfg.eval_batch_size

        def plan(r: int) -> tuple[list[str], int]:
            ids = [j for j in due if self.placed[j].owner == r]
            return ids, max(self._rank_batch(r), bs)

        forwards = max(eval_forwards(len(ids), len(self.val), bs, cap) for ids, cap in map(plan, range(self.world)))
        mine, cap = plan(self.rank)
        local = self.engine.evaluate_groups(self.val, bs, mine, cap, forwards)
        losses = {j: v for part in self._gather(local) for j, v in part.items()}
        for job_id in due:
            s, val = self.placed[job_id], losses[job_id]
            self.last_eval[job_id] = s.step
            self.cb.on_eval(job_id, s.step, val)
            mon = self.monitors[job_id]
            decision = mon.observe_eval(s.step, val)
            if mon.last_eval_was_best:
                self._export(job_id, "best")
            if decision is not None:
                self._exit(job_id, decision)

    def _warmup_policy(self) -> None:
        if self.ranking is None or self.ranking.result is not None:
            return
        fresh_waiting = any(isinstance(q, JobSpec) for q in self.queue)
        for job_id, s in list(self.placed.items()):
            if self._in_warmup(job_id) and s.step >= self._warmup_len(s):
                mon = self.monitors[job_id]
                self.ranking.report(job_id, mon.eval_val[-1] if mon.eval_val else math.inf)
                if fresh_waiting:  # rotate: park it on its rank so a queued configuration gets its warmup
                    self.queue.append(self.placed.pop(job_id))
                    if s.owner == self.rank:
                        self.parked[job_id] = self.engine.detach(job_id, park_device="cpu")
                    self.cb.on_event(job_id, "parked_after_warmup", {"step": s.step, "rank": s.owner})
        if self.ranking.ready:
            keep, evict = self.ranking.decide()
            self.cb.on_event("", "warmup_ranking", {"keep": keep, "evict": evict})
            for job_id in evict:
                self._exit(job_id, ExitDecision("underperforming", {"kept": keep}))

    def _exit(self, job_id: str, decision: ExitDecision) -> None:
        if self.status[job_id]["state"] in ("exited", "completed", "failed"):
            return
        slot = self.placed.pop(job_id, None)
        if slot is not None and slot.owner == self.rank:
            self.engine.detach(job_id)
        self.parked.pop(job_id, None)
        self.queue = [q for q in self.queue if q.job_id != job_id]
        if self._in_warmup(job_id):
            self.ranking.exit(job_id)
        self.status[job_id]["exit_reason"] = decision.reason
        self._set_state(job_id, "exited", {"exit_reason": decision.reason, **decision.details})

    def _finish(self, job_id: str) -> None:
        slot = self.placed.pop(job_id)
        state = self.engine.detach(job_id) if slot.owner == self.rank else None
        self._export(job_id, "final", state, owner=slot.owner)
        self._set_state(job_id, "completed", {"steps": slot.step, "best_val": self.monitors[job_id].best_val})

    def _export(self, job_id: str, kind: str, state: Any = None, owner: int | None = None) -> None:
        path = self.out / "jobs" / job_id / kind
        owner = self.placed[job_id].owner if owner is None else owner
        if owner == self.rank:  # the weights are here; rank 0 announces after the next barrier
            state = state or self.engine.jobs[job_id]
            export_peft(state.adapter, path, list(self.cfg.targets), self.cfg.model_dir,
                        metadata={"step": str(state.step)})
        self.cb.on_adapter(job_id, kind, path)

    # ----- checkpoints -------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        if self.padded:
            self.cb.on_event("", "throughput", {
                "global_step": self.global_step, "padded_fraction": sum(self.padded) / len(self.padded),
                "active_jobs": len(self.placed), "ranks": self.world,
            })
            self.padded = []
        part = self.out / f"state.rank{self.rank}.pt"
        mine = {j: job_state_dict(s) for j, s in [*self.engine.jobs.items(), *self.parked.items()]}
        save_checkpoint(part, mine)
        dist.barrier()
        if self.rank == 0:
            states: dict[str, Any] = {}
            for r in range(self.world):
                states.update(torch.load(self.out / f"state.rank{r}.pt", map_location="cpu", weights_only=False))
            owners = {j: s.owner for j, s in self.placed.items()}
            owners.update({q.job_id: q.owner for q in self.queue if isinstance(q, JobSlot)})
            save_checkpoint(self.out / "state.pt", {
                "active": [states[j] for j in self.placed],
                "queue": [states[q.job_id] if isinstance(q, JobSlot) else {"fresh": q} for q in self.queue],
                "status": self.status, "monitors": self.monitors, "ranking": self.ranking,
                "global_step": self.global_step, "last_eval": self.last_eval, "rng": rng_state(),
                "parallel": {"world": self.world, "owners": owners},
            })
        dist.barrier()  # nobody rewrites its part before rank 0 has merged it
        part.unlink()

    def _resume(self, ck: dict[str, Any]) -> None:
        par = ck.get("parallel") or {}
        owners = par.get("owners", {}) if par.get("world") == self.world else {}
        parked_load = [0] * self.world
        for d in ck["active"]:
            job_id, bs = d["spec"]["job_id"], d["spec"]["batch_size"]
            r = owners.get(job_id)
            if r is None:
                r = min(range(self.world), key=lambda k: (self._rank_batch(k), k))
            self.placed[job_id] = JobSlot(job_id, r, bs, d["step"], d["total_steps"])
            if r == self.rank:
                self.engine.attach(restore_job(self.engine, d))
        self.queue = []
        for q in ck["queue"]:
            if "fresh" in q:
                self.queue.append(q["fresh"])
                continue
            job_id = q["spec"]["job_id"]
            r = owners.get(job_id)
            if r is None:
                r = min(range(self.world), key=lambda k: (parked_load[k], k))
            parked_load[r] += 1
            self.queue.append(JobSlot(job_id, r, q["spec"]["batch_size"], q["step"], q["total_steps"]))
            if r == self.rank:
                self.parked[job_id] = restore_job(self.engine, q).to("cpu")
        self.status, self.monitors, self.ranking = ck["status"], ck["monitors"], ck["ranking"]
        self.global_step, self.last_eval = ck["global_step"], ck["last_eval"]
        set_rng_state(ck["rng"])
        self.cb.on_event("", "resumed", {"global_step": self.global_step, "ranks": self.world,
                                         "same_placement": bool(owners)})


# ----- launching ---------------------------------------------------------------------------------
def check_supported(cfg: ExecutorConfig) -> None:
    """Adapter parallelism trains SFT tasks; DPO's reference passes are not in lockstep yet."""
    method = getattr(cfg, "method", "sft")
    if method != "sft":
        raise ValueError(f"adapter parallelism supports method='sft' only, not {method!r}: "
                         "run the task on one GPU (trainer.executor)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int, port: int) -> torch.device:
    """init_process_group on localhost (NCCL and cuda:rank on CUDA, gloo on CPU); the device."""
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        backend, device = "nccl", torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        backend, device = "gloo", torch.device("cpu")
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, **kw)
    return device


class _QueueCallbacks:
    """Rank 0's real callbacks: each one a message to the launching process."""

    def __init__(self, q: Any) -> None:
        self.q = q
        for kind in CALLBACK_KINDS:
            setattr(self, kind, self._make(kind))

    def _make(self, kind: str) -> Callable[..., None]:
        def f(*args: Any) -> None:
            self.q.put(("cb", kind, args))
        return f


def _rank_main(rank: int, world: int, port: int, cfg: ExecutorConfig, q: Any, stop: Any) -> None:
    logging.basicConfig(level=os.environ.get("LORAPLEX_LOG_LEVEL", "INFO").upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s rank={rank} %(message)s")
    # The daemon signals the executor's whole process group: SIGTERM is the launching process's
    # to turn into a checkpoint-and-stop of every rank at the same step (a rank that died on it
    # would leave the others hanging in a collective). SIGINT (Ctrl-C, or the launcher's death,
    # which torch's spawn turns into SIGINT) and a changed parent stop the ranks the same way.
    interrupted = threading.Event()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    parent = os.getppid()
    init_rank(rank, world, port)
    try:
        cb = _QueueCallbacks(q) if rank == 0 else None

        def stop_requested() -> bool:
            return stop.is_set() or interrupted.is_set() or os.getppid() != parent

        status = ParallelExecutor(cfg, cb, stop_requested=stop_requested).run()
        if rank == 0:
            q.put(("done", status))
    finally:
        dist.destroy_process_group()


def run_parallel(cfg: ExecutorConfig, nproc: int, callbacks: Callbacks | None = None,
                 should_stop: Callable[[], bool] | None = None) -> dict[str, dict[str, Any]]:
    """Train the task on `nproc` ranks of this machine (GPUs 0..nproc-1 of CUDA_VISIBLE_DEVICES)
    and return the jobs' status. Callbacks run here, in this process, in order. When a callback
    raises (e.g. the runner's Stopped) or should_stop() turns true, every rank checkpoints and
    stops at the end of its current step; the callback's exception is then re-raised here."""
    import torch.multiprocessing as mp

    if nproc < 1:
        raise ValueError("nproc must be >= 1")
    check_supported(cfg)
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        raise ValueError(f"{nproc} ranks asked for, {torch.cuda.device_count()} GPUs visible")
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    procs = mp.start_processes(_rank_main, args=(nproc, free_port(), cfg, q, stop), nprocs=nproc,
                               join=False, start_method="spawn")
    status: dict[str, dict[str, Any]] | None = None
    error: BaseException | None = None

    def drain(timeout: float) -> None:
        nonlocal status, error
        while True:
            try:
                msg = q.get(timeout=timeout)
            except queue_mod.Empty:
                return
            timeout = 0.0
            if msg[0] == "done":
                status = msg[1]
                continue
            _, kind, args = msg
            if error is None and callbacks is not None:
                try:
                    getattr(callbacks, kind)(*args)
                except BaseException as exc:  # noqa: BLE001 - re-raised once the ranks have stopped
                    error = exc
                    stop.set()

    while True:
        drain(0.2)
        if should_stop is not None and should_stop():
            stop.set()
        if procs.join(timeout=0.05):
            break
    drain(0.0)
    if error is not None:
        raise error
    if status is None:
        raise RuntimeError("adapter-parallel executor ended without a status")
    return status


def main(argv: list[str] | None = None) -> None:
    """`python -m trainer.parallel config.json --nproc P`: one task on P ranks, callbacks printed
    as JSON lines (the same lines as `python -m trainer.executor`)."""
    import argparse
    import json
    import sys

    from service.protocol import EarlyExitSettings

    parser = argparse.ArgumentParser(description="Run one task's jobs with adapter parallelism.")
    parser.add_argument("config", help="JSON file with ExecutorConfig fields; jobs as a list of JobSpec dicts")
    parser.add_argument("--nproc", type=int, default=max(1, torch.cuda.device_count()))
    args = parser.parse_args(argv)
    raw = json.loads(Path(args.config).read_text())
    raw["jobs"] = [JobSpec(**{**j, "betas": tuple(j.get("betas", (0.9, 0.999)))}) for j in raw["jobs"]]
    if "early_exit" in raw:
        raw["early_exit"] = EarlyExitSettings(**raw["early_exit"])
    if "targets" in raw:
        raw["targets"] = tuple(raw["targets"])

    def emit(kind: str) -> Callable[..., None]:
        def f(job_id: str, *rest: Any) -> None:
            print(json.dumps({"kind": kind, "job": job_id, "data": [str(r) if isinstance(r, Path) else r
                                                                    for r in rest]}, default=str))
            sys.stdout.flush()
        return f

    cb = Callbacks(*(emit(k.removeprefix("on_")) for k in CALLBACK_KINDS))
    status = run_parallel(ExecutorConfig(**raw), args.nproc, cb)
    print(json.dumps({"kind": "done", "status": status}))


if __name__ == "__main__":
    main()
