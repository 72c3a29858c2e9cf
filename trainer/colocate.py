"""A task's part of an executor: everything the recipe (trainer.executor) keeps per task, so one
executor (one backbone, one engine, one admission budget, one step loop) can host the jobs of
several tasks, of any tenants, that attach and detach while it runs (docs/architecture.md: co-location).

Per task (`TaskRun`): its data (its own segment of the engine's `ExamplePool`, read by its jobs'
`TaskStream`s), its validation set, job queue, owners and statuses, early-exit monitors and warmup
ranking (its own jobs only; a job's end waits for its ranking, trainer.warmup_hold), evaluations,
exports, checkpoints (its own `state.pt` under its own output_dir, resumable alone in any executor)
and callbacks. Per executor (trainer.executor.Executor):
model, engine, strategy, memory model and admission, the step loop. A one-task executor is this
with one TaskRun: the same code, no second recipe.

Isolation: a job's numbers depend only on its own spec, data order and adapter (the engine's
rows, losses and updates are per job); a task's decisions depend only on its own jobs' numbers;
a task's callbacks and per-task work run guarded (trainer.executor), so an exception in them
fails that task alone. Job ids must be unique across the tasks of one executor.

Files (one GPU): checkpoints and exports are snapshots taken at the step boundary (executor copies:
later steps' in-place updates cannot reach them), written by the executor's writer thread
(trainer.checkpoint.FileWriter) while training goes on. What announces a file waits for it: a
job's on_adapter and its terminal on_job_state are held (in order) until its files are complete,
and `files.settle` drains the task's writes before it leaves the executor (its final adapters, a
pause's checkpoint). A failed write fails its task alone. Adapter-parallel executors write in the
loop. The files are a component the task holds (`task.files`, trainer.task_files.TaskFiles: its
writes, held announcements, checkpoints and resume), which sees the task through a Protocol of what
it uses (`CheckpointedTask`).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from contract.states import JOB_TERMINAL, ExitReason
from contract.states import JobState as JobLifecycle
from trainer.checkpoint import restore_job
from trainer.config import Callbacks, ExecutorConfig
from trainer.data import Example, read_jsonl, split_validation
from trainer.early_exit import ExitDecision, JobMonitor, WarmupRanking
from trainer.export import export_peft, peft_config_dict, write_peft
from trainer.jobs import JobRun, TrainJob
from trainer.pairs import PairExample
from trainer.task_eval import eval_subset_size, evaluate_due
from trainer.task_files import TaskFiles
from trainer.task_parts import JobSlot, StepNumbers, TaskExecutor, TaskStream, ThroughputWindow
from trainer.task_parts import fresh as fresh_configurations
from trainer.warmup_hold import awaits_ranking, hold_completion, hold_exit, park, settle_kept

log = logging.getLogger("loraplex.executor")
# a job that ended by itself (a cancelled one may still be exited by the ranking)
ENDED_HERE = tuple(s for s in JOB_TERMINAL if s != JobLifecycle.CANCELLED)


class TaskRun:
    """One task on an executor (see the module docstring). Control is replicated as in the
    recipe: every rank holds the task's bookkeeping and changes it from gathered numbers only."""

    def __init__(self, executor: TaskExecutor, cfg: ExecutorConfig, cb: Callbacks, task_id: str,
                 stop_requested: Callable[[], bool] | None = None) -> None:
        self.executor, self.cfg, self.cb, self.task_id = executor, cfg, cb, task_id
        self.stop_requested = stop_requested
        self.on_end: Callable[[str, dict], None] = cb.on_task_end  # the executor may route it
        self.stopped = False  # stopped on request (checkpointed; a later run resumes it)
        self.error: BaseException | None = None  # its own code path failed: it alone ends
        self.outcome: str | None = None  # succeeded | failed | cancelled | paused | stopped
        self.out = Path(cfg.output_dir)
        self.status: dict[str, dict[str, Any]] = {
            j.job_id: {"state": JobLifecycle.PENDING, "exit_reason": None} for j in cfg.jobs}
        early_exit = cfg.settings.early_exit
        self.monitors = {j.job_id: JobMonitor(early_exit) for j in cfg.jobs}
        ranked = early_exit.enabled and len(cfg.jobs) > 1
        self.ranking = WarmupRanking([j.job_id for j in cfg.jobs], early_exit.keep_fraction) if ranked else None
        self.queue: list[TrainJob | JobSlot] = list(cfg.jobs)  # never started, then parked
        self.placed: dict[str, JobSlot] = {}  # its running jobs of every rank, in placement order
        self.parked: dict[str, JobRun] = {}  # this rank's parked jobs of the task
        self.parked_on_device: set[str] = set()  # those of them kept on the device (the others: host)
        self.global_step = 0  # executor steps this task took part in (resumed from its state.pt)
        # its own timings on a shared executor (Executor.timings(task)): when it joined, the
        # executor's phase seconds then, and its first step from then
        self.joined_at: float | None = None
        self.phases_at_join: dict[str, float] = {}
        self.first_step_s: float | None = None
        self.last_eval: dict[str, int] = {}
        self.window = ThroughputWindow()
        self.train: list[Example | PairExample] = []
        self.val: list[Example | PairExample] = []
        self.base: int | None = None  # its segment of the engine's ExamplePool
        # its writes, held announcements, checkpoints (and when the next is due) and resume
        self.files = TaskFiles(executor, self)

    # ----- data and job states ---------------------------------------------------------------
    def read(self, tokenizer: Any) -> None:
        """Read and tokenise the task's data (train and validation sets)."""
        cfg = self.cfg
        tokenize, settings = self.executor.objective.tokenize, cfg.settings
        train = tokenize(tokenizer, read_jsonl(cfg.train_file), cfg.max_seq_len)
        if cfg.val_file:
            val = tokenize(tokenizer, read_jsonl(cfg.val_file), cfg.max_seq_len)
        else:
            train, val = split_validation(train, settings.validation_split, settings.seed)
        if not train or not val:
            raise ValueError("no trainable examples left after tokenisation/truncation")
        cap = settings.eval.eval_max_samples
        # one fixed shuffled order (the task's split seed): every evaluation takes a leading
        # subset of it, so evaluations of any size compare jobs on the same samples and a small
        # one is not biased to the file's first records (each subset is sorted by length when
        # evaluated: a forward then packs sequences of like length)
        random.Random(settings.seed).shuffle(val)
        self.val = val[:cap] if cap else val
        self.train = train

    def open(self) -> None:
        """Put the task's data in its own segment of the engine's pool; report it loaded."""
        self.base = self.executor.pool.add(self.train)
        self.executor.objective.prepare_validation(self.executor.engine, self.val, self.cfg.eval_batch_size)
        mm, adm = self.executor.memory_model, self.executor.admission
        if mm is not None:
            self.cb.on_event("", "memory_model", {"k0": mm.k0, "k1": mm.k1,
                                                  "budget_bytes": adm.budget_bytes, "ranks": self.executor.world})
        self.cb.on_event("", "executor_loaded", {"train": len(self.train), "val": len(self.val),
                                                 "device": str(self.executor.device), "ranks": self.executor.world})

    def close(self) -> None:
        """Forget the task's data (its jobs are gone from the engine)."""
        if self.base is not None:
            self.executor.pool.remove(self.base)
            self.base = None

    def _job_state(self, make: Callable[[], JobRun]) -> JobRun:
        # a job's state is made against its own task's data (its stream's size and total steps
        # are its task's), then reads the pool at the task's base
        eng = self.executor.engine
        saved, eng.train_examples = eng.train_examples, self.train
        try:
            state = make()
        finally:
            eng.train_examples = saved
        state.stream = TaskStream(state.stream, self.base or 0)
        return state

    def new_job(self, spec: TrainJob) -> JobRun:
        return self._job_state(lambda: self.executor.engine.new_job(spec))

    def restore(self, d: dict[str, Any]) -> JobRun:
        return self._job_state(lambda: restore_job(self.executor.engine, d))

    # ----- admission ---------------------------------------------------------------------------
    def candidates(self, rank: int) -> list[TrainJob | JobSlot]:
        """Queued jobs that may start on `rank` now: a parked job returns to its own rank only,
        and during warmup only never-started jobs rotate in; none past the task's own job cap."""
        cap = self.cfg.max_active_jobs
        if cap is not None and sum(s.owner == rank for s in self.placed.values()) >= cap:
            return []
        ranking_open = self.ranking is not None and self.ranking.result is None
        return [q for q in self.queue if isinstance(q, TrainJob) or (q.owner == rank and not ranking_open)]

    def spill_parked(self) -> bool:
        """Move this rank's parked states that wait on the device to pinned host memory (a job that
        does not fit beside them would otherwise wait for them forever); whether any moved."""
        on_device = sorted(self.parked_on_device & set(self.parked))
        self.parked_on_device.clear()
        if on_device:
            with self.executor.phase("park"):
                for job_id in on_device:
                    self.parked[job_id] = self.parked[job_id].to("cpu")
            self.cb.on_event("", "parked_to_host", {"jobs": on_device})
        return bool(on_device)

    def fail_stranded(self) -> None:
        """Its queued jobs, where the task ends because nothing runs and none of them could be
        admitted on the empty executor: failed, saying so (never left pending in a task that
        ends as succeeded)."""
        for item in list(self.queue):
            self.queue.remove(item)
            self.parked.pop(item.job_id, None)
            self.set_state(item.job_id, JobLifecycle.FAILED,
                           {"error": "could not be admitted: no room on the executor when nothing else ran"})

    def fail_unschedulable(self) -> None:
        executor = self.executor
        for job_id in executor.admission.unschedulable(fresh_configurations(self.queue)):
            self.queue = [q for q in self.queue if q.job_id != job_id]
            self.set_state(job_id, JobLifecycle.FAILED, {"error": "does not fit the executor's memory even alone"})
            if self.ranking is not None:
                self.ranking.exit(job_id)

    def place(self, job_id: str, rank: int) -> None:
        item = next(q for q in self.queue if q.job_id == job_id)
        self.queue.remove(item)
        resumed = isinstance(item, JobSlot)
        slot = item if resumed else JobSlot(job_id, rank, item.batch_size, 0, item.total_steps(len(self.train)))
        self.placed[job_id] = slot
        if rank == self.executor.rank:
            with self.executor.phase("resume" if resumed else "init"):  # executor copies / a new adapter's init
                self.parked_on_device.discard(job_id)
                self.executor.engine.attach(self.parked.pop(job_id) if resumed else self.new_job(item))
        if self.status[job_id]["state"] != JobLifecycle.RUNNING:
            self.set_state(job_id, JobLifecycle.RUNNING, {"resumed": resumed, "rank": rank})

    # ----- after each step ---------------------------------------------------------------------
    def observe_train(self, merged: dict[str, tuple], numbers: StepNumbers) -> None:
        """The step's outcome of the task's jobs: callbacks, then exit decisions."""
        self.window.add(numbers)
        for job_id in list(self.placed):
            step, loss, skipped, norm, metrics, tokens = merged[job_id]
            if metrics:
                self.cb.on_metrics(job_id, step, "train", metrics)
            share = numbers.gpu_seconds * tokens / numbers.job_tokens if numbers.job_tokens else 0.0
            self.cb.on_usage(job_id, step, tokens, share)
            self.cb.on_train_loss(job_id, step, loss)
            if skipped:
                self.cb.on_event(job_id, "update_skipped", {"step": step, "loss": loss, "grad_norm": norm})
            decision = self.monitors[job_id].observe_train(step, loss)
            if decision is not None:
                self.exit(job_id, decision)

    def cadence_due(self, s: JobSlot) -> bool:
        """Whether the job's last step crossed an evaluation point: every eval_every_samples
        samples it trained on (steps x batch size), else every eval_every_steps of its steps."""
        every = getattr(self.cfg.settings.eval, "eval_every_samples", None)
        if every:
            return (s.step * s.batch_size) // every > ((s.step - 1) * s.batch_size) // every
        return s.step % self.cfg.settings.eval.eval_every_steps == 0

    def eval_shape(self, n_jobs: int, n_examples: int | None = None,
                   lengths: Sequence[int] | None = None) -> tuple[int, int]:
        n = len(self.val) if n_examples is None else n_examples
        return self.executor.eval_shape(n_jobs, n, self.cfg.eval_batch_size, lengths)

    def eval_size(self, job_id: str, s: JobSlot) -> int:
        """Validation samples of the job's evaluation due now (EvalSettings): in proportion to
        what it trained on since its last evaluation (its last one: to all it trained on; at the
        warmup ranking: the same for every job, from the largest warmup), rounded up to the
        minimum times a power of two so jobs due together share forwards, within [minimum, set]."""
        ev, full = self.cfg.settings.eval, len(self.val)
        ratio = getattr(ev, "eval_samples_per_trained", None)
        if ratio is None or full == 0:
            return full
        if s.done:
            trained = s.step * s.batch_size
        elif self.in_warmup(job_id) and s.step == self.warmup_len(s):
            trained = self.ranking_samples()
        else:
            trained = (s.step - self.last_eval.get(job_id, 0)) * s.batch_size
        return eval_subset_size(ratio * trained, getattr(ev, "eval_min_samples", 1), full)

    def ranking_samples(self) -> int:
        """Samples the longest warmup of the task's jobs trains on: the warmup ranking's
        evaluation is sized by it, one size for every job (their losses are compared)."""
        n = len(self.train)
        return max(self.cfg.settings.early_exit.warmup_steps(j.total_steps(n)) * j.batch_size for j in self.cfg.jobs)

    def evaluate_due(self) -> None:
        """Evaluate the task's jobs at their evaluation points, each on the leading subset of the
        task's validation set its training since the last evaluation earns (`eval_size`); the
        warmup ranking's in two stages (trainer.task_eval)."""
        evaluate_due(self)

    def observe_eval(self, job_id: str, m: dict[str, float]) -> None:
        """A job's evaluation numbers: callbacks, its best adapter, a detector's exit."""
        s = self.placed[job_id]
        val = m["loss"]  # DPO: the validation DPO loss, for the same detectors
        self.last_eval[job_id] = s.step
        extra = {k: v for k, v in m.items() if k != "loss"}
        if extra:
            self.cb.on_metrics(job_id, s.step, "val", extra)
        self.cb.on_eval(job_id, s.step, val)
        mon = self.monitors[job_id]
        decision = mon.observe_eval(s.step, val)
        if mon.last_eval_was_best:
            self.export(job_id, "best")
        if decision is not None:
            self.exit(job_id, decision)

    def warmup_len(self, s: JobSlot) -> int:
        return self.cfg.settings.early_exit.warmup_steps(s.total_steps)

    def in_warmup(self, job_id: str) -> bool:
        return self.ranking is not None and job_id in self.ranking.waiting

    def warmup_policy(self) -> None:
        """Rank the task's jobs once all finished warmup. Meanwhile a job that finished its warmup
        parks, so a queued configuration gets its warmup, or (unless `train_while_waiting`) so the
        steps serve the jobs still warming up: most waiting jobs are evicted, and a large step's
        tokens cost the same whichever job they train. One that trains on has its end held."""
        if self.ranking is None or self.ranking.result is not None:
            return
        rotate = bool(fresh_configurations(self.queue))
        train_on = self.cfg.settings.early_exit.train_while_waiting
        ended = [(j, s) for j, s in self.placed.items() if self.in_warmup(j) and s.step >= self.warmup_len(s)]
        for job_id, _ in ended:  # its last validation loss (none: infinite)
            self.ranking.report(job_id, (self.monitors[job_id].eval_val or [math.inf])[-1])
        for job_id, s in ended:  # not while the ranking decides now
            if rotate or not (train_on or self.ranking.ready or s.done):
                park(self, job_id, "parked_after_warmup", {})
        if self.ranking.ready:
            keep, evict = self.ranking.decide()
            self.cb.on_event("", "warmup_ranking", {"keep": keep, "evict": evict})
            for job_id in evict:
                self.exit(job_id, ExitDecision(ExitReason.UNDERPERFORMING, {"kept": keep}))
            settle_kept(self, keep)  # the kept jobs' held ends: a detector's exit, a completion

    def exit(self, job_id: str, decision: ExitDecision) -> None:
        """End the job as `decision` says; a detector's decision on a job that awaits its warmup
        ranking is held instead (it stops; the ranking decides first: trainer.warmup_hold)."""
        if self.status[job_id]["state"] in ENDED_HERE:
            return
        if job_id in self.placed and awaits_ranking(self, job_id):
            hold_exit(self, job_id, decision)
            return
        slot = self.placed.pop(job_id, None)
        if slot is not None and slot.owner == self.executor.rank:
            self.executor.engine.detach(job_id)
        self.parked.pop(job_id, None)
        self.parked_on_device.discard(job_id)
        self.queue = [q for q in self.queue if q.job_id != job_id]
        if self.in_warmup(job_id):
            self.ranking.exit(job_id)
        self.status[job_id]["exit_reason"] = decision.reason
        self.set_state(job_id, JobLifecycle.EXITED, {"exit_reason": decision.reason, **decision.details})

    def finish_done(self) -> bool:
        """Complete the task's jobs that have run all their steps (one that awaits its warmup
        ranking stops, its completion held: trainer.warmup_hold); whether there were any."""
        done = [j for j, s in self.placed.items() if s.done]
        for job_id in done:
            if awaits_ranking(self, job_id):
                hold_completion(self, job_id)
                continue
            slot = self.placed.pop(job_id)
            self.complete(job_id, slot, self.executor.engine.detach(job_id) if slot.owner == self.executor.rank else None)
        return bool(done)

    def complete(self, job_id: str, slot: JobSlot, state: JobRun | None) -> None:
        """A job that ran all its steps, off the engine (its state on its owner rank): its final
        adapter, then its completion."""
        self.export(job_id, "final", state, owner=slot.owner)
        self.set_state(job_id, JobLifecycle.COMPLETED, {"steps": slot.step, "best_val": self.monitors[job_id].best_val})

    def export(self, job_id: str, kind: str, state: JobRun | None = None, owner: int | None = None) -> None:
        executor = self.executor
        with executor.phase("export"):
            path = self.out / "jobs" / job_id / kind
            owner = self.placed[job_id].owner if owner is None else owner
            if owner == executor.rank:  # the weights are here; the announcement follows the files
                state = state or executor.engine.jobs[job_id]
                adapter, meta = state.adapter, {"step": str(state.step)}
                targets = list(executor.engine.targets)
                if executor.writer is None:
                    export_peft(adapter, path, targets, self.cfg.model_dir, metadata=meta)
                else:
                    config = peft_config_dict(adapter, targets, self.cfg.model_dir)
                    if kind == "final" and self.files.best_steps.get(job_id) == state.step:
                        # its best is this very step's adapter, queued already: the same files again
                        write = self.files.link("export", path.with_name("best"), path)
                    else:
                        write = self.files.write("export", adapter.flat, lambda flat: write_peft(
                            adapter.peft_state_dict(flat=flat), config, path, metadata=meta),
                            best_of=job_id if kind == "best" else None)
                    self.files.job_writes[job_id] = write
                    if kind == "best":
                        self.files.best_steps[job_id] = state.step
            self.files.after_files(job_id, self.cb.on_adapter, job_id, kind, path)

    def set_state(self, job_id: str, state: str, details: dict) -> None:
        self.status[job_id]["state"] = state
        self.executor.log_state(self.task_id, job_id, state, details)
        if state in JOB_TERMINAL:  # after its adapters' files: a runner uploads them then
            self.files.after_files(job_id, self.cb.on_job_state, job_id, state, details)
        else:
            self.cb.on_job_state(job_id, state, details)

    def release(self) -> None:
        """Take every job of the task off the engine (this rank's), placed or parked."""
        for job_id, slot in list(self.placed.items()):
            if slot.owner == self.executor.rank and job_id in self.executor.engine.jobs:
                self.executor.engine.detach(job_id)
        self.placed.clear()
        self.parked.clear()
        self.parked_on_device.clear()

    # ----- reports and checkpoints ---------------------------------------------------------------
    def report_throughput(self) -> None:
        w, self.window = self.window, ThroughputWindow()
        if w.steps == 0:
            return
        tokens_per_s = w.tokens / w.seconds if w.seconds > 0 else 0.0
        self.cb.on_event("", "throughput", {
            "global_step": self.global_step, "padded_fraction": sum(w.padded) / len(w.padded),
            "active_jobs": len(self.placed), "ranks": self.executor.world, "tokens_per_s": tokens_per_s,
        })
        if tokens_per_s > 0 and w.batch_sizes:  # also at the end, when no job is placed any more
            mm = self.executor.memory_model
            self.cb.on_throughput({
                "gpus": self.executor.world, "seq_len": self.cfg.max_seq_len, "batch_sizes": w.batch_sizes,
                "tokens_per_s": tokens_per_s, "samples_per_s": w.samples / w.seconds,
                "memory_k0": mm.k0 if mm else None, "memory_k1": mm.k1 if mm else None,
            })
