"""A task's files (`TaskFiles`): checkpoints and exports written off the step loop by the
executor's writer thread (one GPU), announcements held until their files are complete, and the
task's state.pt, written from every rank's part and resumed on any number of ranks: each job's
state in its own file, rewritten only when the job trained since (trainer.checkpoint_files tells
the format), and when the task checkpoints next (its interval by time).

A component of trainer.colocate.TaskRun (`task.files`; that module's docstring tells the rules):
it owns the task's writes, held announcements and job files, and sees the task through
`CheckpointedTask` (the bookkeeping state.pt keeps and a resume restores, and the few calls
around them) and its executor through trainer.task_parts.TaskExecutor."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from contract.states import JobState as JobLifecycle
from trainer.checkpoint import (
    Snapshot,
    Write,
    job_state_dict,
    rng_state,
    set_rng_state,
    take_snapshot,
    tensor_bytes,
)
from trainer.checkpoint_files import (
    FORMAT,
    job_file_name,
    new_tag,
    resolve_job,
    save_checkpoint,
    write_checkpoint,
)
from trainer.config import Callbacks, ExecutorConfig
from trainer.data import Example
from trainer.early_exit import JobMonitor, WarmupRanking
from trainer.export import link_files
from trainer.jobs import JobRun, TrainJob
from trainer.pairs import PairExample
from trainer.task_parts import JobSlot, TaskExecutor

log = logging.getLogger("loraplex.executor")


class CheckpointedTask(Protocol):
    """What a task's files use of the task (trainer.colocate.TaskRun): its bookkeeping, which a
    checkpoint writes and a resume restores, its error (a failed write sets it), and the calls
    around them."""

    task_id: str
    cfg: ExecutorConfig
    cb: Callbacks
    out: Path
    error: BaseException | None
    train: list[Example | PairExample]
    val: list[Example | PairExample]
    queue: list[TrainJob | JobSlot]
    placed: dict[str, JobSlot]
    parked: dict[str, JobRun]
    status: dict[str, dict[str, Any]]
    monitors: dict[str, JobMonitor]
    ranking: WarmupRanking | None
    global_step: int
    last_eval: dict[str, int]

    def report_throughput(self) -> None: ...

    def restore(self, d: dict[str, Any]) -> JobRun: ...

    def set_state(self, job_id: str, state: str, details: dict) -> None: ...


class TaskFiles:
    """A task's writes, announcements, checkpoint and resume (see the module docstring)."""

    def __init__(self, executor: TaskExecutor, task: CheckpointedTask) -> None:
        self.executor, self.task = executor, task
        self.last_checkpoint = time.monotonic()
        self.checkpoint_due = False  # by time, as rank 0's clock says (every rank alike)
        self.writes: list[Write] = []  # its writes on the executor's writer, not yet settled
        self.checkpoint_write: Write | None = None  # its latest checkpoint write (one in flight at most)
        self.job_writes: dict[str, Write] = {}  # each job's last write (its exports)
        # each job's latest best adapter while its files are being written: (the write, its
        # snapshot), what the task's samples read instead of waiting for the files (`pending_best`)
        self.best_snaps: dict[str, tuple[Write, Snapshot]] = {}
        self.best_steps: dict[str, int] = {}  # each job's step at its latest best export
        # each started job's last state on file: (its step then, the file's name; None on a rank
        # but 0, which names and writes the files)
        self.job_files: dict[str, tuple[int, str | None]] = {}
        self.file_tag = new_tag()  # in the names of the job files this run writes
        # announcements waiting for files, in the order made: (the write, callback, arguments)
        self.held: deque[tuple[Write | None, Callable[..., None], tuple]] = deque()

    def write(self, kind: str, obj: Any, write: Callable[[Any], Any], best_of: str | None = None) -> Write:
        """Snapshot obj now (waiting first while the writer holds too many snapshots), then
        write(snapshot) on the executor's writer thread. best_of: the job whose best adapter obj
        is (its snapshot is kept for `pending_best` until the files are complete)."""
        writer = self.executor.writer
        nbytes = tensor_bytes(obj)
        writer.room(nbytes)
        snap = take_snapshot(obj)
        pending = writer.submit(self.task.task_id, kind, nbytes, lambda: write(snap.wait()))
        self.writes.append(pending)
        if best_of is not None:
            self.best_snaps[best_of] = (pending, snap)
        return pending

    def pending_best(self, job_id: str) -> Any | None:
        """The job's latest best adapter (its flat weights, in host memory) while its files are
        still being written; None once they are complete (read them), or if it has none."""
        entry = self.best_snaps.get(job_id)
        if entry is None or entry[0].done.is_set():
            return None
        return entry[1].wait()

    def link(self, kind: str, src: Path, dst: Path) -> Write:
        """On the writer, after every write queued before it: dst's files as those of src (an
        export of the same weights, written already): hard links where the file system allows,
        else copies, each under a temp name then renamed."""
        pending = self.executor.writer.submit(self.task.task_id, kind, 0, lambda: link_files(src, dst))
        self.writes.append(pending)
        return pending

    def after_files(self, job_id: str | None, fn: Callable[..., None], *args: Any) -> None:
        """Call fn(*args) once the job's last write is complete (now if it is), after the
        announcements held before it."""
        write = self.job_writes.get(job_id) if job_id is not None else None
        if self.held or (write is not None and not write.done.is_set()):
            self.held.append((write, fn, args))
        else:
            fn(*args)

    def settle(self, wait: bool = False) -> None:
        """Between steps: take note of the task's finished writes (a failed one fails the task)
        and make the announcements whose files are complete; wait=True: wait for all of them
        first (its time counted as the loop's checkpoint / export time)."""
        task = self.task
        for write in list(self.writes):
            if wait and not write.done.is_set():
                with self.executor.phase(write.kind):
                    write.done.wait()
            if not write.done.is_set():
                break  # one writer, in order: the later ones are not done either
            self.writes.remove(write)
            if write.error is not None and task.error is None:
                log.error("task=%s %s write failed: %s", task.task_id, write.kind, write.error)
                task.error = write.error
        self.best_snaps = {j: e for j, e in self.best_snaps.items() if not e[0].done.is_set()}
        while self.held and (self.held[0][0] is None or self.held[0][0].done.is_set()):
            write, fn, args = self.held.popleft()
            if write is None or write.error is None:  # a file that failed is never announced
                fn(*args)

    def checkpoint(self, last: bool = False) -> None:
        """The task's checkpoint now. last: the task's end (finished or paused), which waits for
        all its files anyway (`settle(wait=True)`): it does not wait for the one in flight first,
        so what comes before that wait (the samples' decode) runs while the writer writes."""
        with self.executor.phase("checkpoint"):
            self._checkpoint_now(last)

    def _checkpoint_now(self, last: bool = False) -> None:
        executor, task = self.executor, self.task
        self.last_checkpoint, self.checkpoint_due = time.monotonic(), False
        task.report_throughput()
        eng = executor.engine
        mine = {j: self._job_part(s) for j, s in [*eng.jobs.items(), *task.parked.items()]
                if j in task.placed or j in task.parked}
        part = {"jobs": mine, "objective": executor.objective.task_state(eng, [*task.train, *task.val])}
        if executor.writer is not None:  # one rank: the snapshot is written off the loop
            # at most one checkpoint of the task in flight: the last complete one is then never
            # more than one interval behind the one being written, so a crash (kill -9) loses
            # under two intervals of steps even when writes lag the loop (a slow or loaded disk)
            if self.checkpoint_write is not None and not last:
                self.checkpoint_write.done.wait()  # set once written or failed: never hangs
            self.checkpoint_write = self.write("checkpoint", self._payload([part]), lambda snap: write_checkpoint(
                task.out, *snap, save=save_checkpoint))
            return
        parts = executor.strategy.collect_parts(task.out, take_snapshot(part).wait())
        if parts is None:  # not rank 0: it writes the one state.pt and the job files
            return
        write_checkpoint(task.out, *self._payload(parts), save=save_checkpoint)

    def _job_part(self, state: JobRun) -> dict[str, Any]:
        """A job's part of a checkpoint: its whole state when it trained since its last file,
        else only what state.pt keeps of it (its file stays as it is)."""
        known = self.job_files.get(state.job_id)
        if known is not None and known[0] == state.step:
            return {"spec": asdict(state.spec), "step": state.step, "total_steps": state.total_steps}
        self.job_files[state.job_id] = (state.step, None)
        return job_state_dict(state, copy=False)

    def _job_ref(self, job_id: str, d: dict[str, Any], files: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The job's entry in state.pt, naming its file (a new one for a whole state, in files)."""
        if "adapter" in d:
            name = job_file_name(job_id, d["step"], self.file_tag)
            files[name] = d
            self.job_files[job_id] = (d["step"], name)
        else:
            step, name = self.job_files.get(job_id, (None, None))
            if name is None or step != d["step"]:  # a rank's unchanged job rank 0 never wrote
                raise RuntimeError(f"job {job_id} at step {d['step']} has no file (last {name})")
        return {"file": name, "spec": d["spec"], "step": d["step"], "total_steps": d["total_steps"]}

    def _payload(self, parts: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """The task's state.pt from every rank's part (its jobs, the objective's numbers), and
        the job files to write first (name -> a job's whole state)."""
        executor, task = self.executor, self.task
        files: dict[str, dict[str, Any]] = {}
        refs = {j: self._job_ref(j, d, files) for part in parts for j, d in part["jobs"].items()}
        owners = {j: s.owner for j, s in task.placed.items()}
        owners.update({q.job_id: q.owner for q in task.queue if isinstance(q, JobSlot)})
        payload = {
            "format": FORMAT,
            "active": [refs[j] for j in task.placed],
            "queue": [refs[q.job_id] if isinstance(q, JobSlot) else {"fresh": q} for q in task.queue],
            "status": task.status, "monitors": task.monitors, "ranking": task.ranking,
            "global_step": task.global_step, "last_eval": task.last_eval, "rng": rng_state(),
            "parallel": {"world": executor.world, "owners": owners},
        }
        merged = executor.objective.merge_task_states([p["objective"] for p in parts])
        if merged is not None:  # DPO: every rank's reference log-probs, reused by a resume
            payload["reference"] = merged
        return payload, files

    def resume(self, ck: dict[str, Any], restore_rng: bool) -> None:
        """Continue the task from a state.pt of any strategy: on the same number of ranks every
        job stays on its rank; otherwise jobs are dealt to the least-loaded ranks, which gives the
        same adapters, as a job's trajectory does not depend on where or beside whom it runs."""
        executor, task = self.executor, self.task
        par = ck.get("parallel") or {}
        self.job_files = {d["spec"]["job_id"]: (d["step"], d["file"])  # on file as they are
                          for d in [*ck["active"], *ck["queue"]] if "file" in d}
        owners = par.get("owners", {}) if par.get("world") == executor.world else {}
        parked_load = [0] * executor.world
        for d in ck["active"]:
            job_id, bs = d["spec"]["job_id"], d["spec"]["batch_size"]
            r = owners.get(job_id)
            if r is None:
                r = min(range(executor.world), key=lambda k: (executor.rank_batch(k), k))
            task.placed[job_id] = JobSlot(job_id, r, bs, d["step"], d["total_steps"])
            if r == executor.rank:
                executor.engine.attach(task.restore(resolve_job(task.out, d)))
        task.queue = []
        for q in ck["queue"]:
            if "fresh" in q:
                task.queue.append(q["fresh"])
                continue
            job_id = q["spec"]["job_id"]
            r = owners.get(job_id)
            if r is None:
                r = min(range(executor.world), key=lambda k: (parked_load[k], k))
            parked_load[r] += 1
            task.queue.append(JobSlot(job_id, r, q["spec"]["batch_size"], q["step"], q["total_steps"]))
            if r == executor.rank:
                task.parked[job_id] = task.restore(resolve_job(task.out, q)).to("cpu")
        task.status, task.monitors, task.ranking = ck["status"], ck["monitors"], ck["ranking"]
        for monitor in task.monitors.values():  # the task's settings as given now, not as pickled
            monitor.cfg = task.cfg.settings.early_exit
        task.global_step, task.last_eval = ck["global_step"], ck["last_eval"]
        executor.objective.load_task_state(executor.engine, ck.get("reference"))
        if restore_rng:  # only an executor's first task: the others' RNG is not the executor's
            set_rng_state(ck["rng"])
        task.cb.on_event("", "resumed", {"global_step": task.global_step, "ranks": executor.world,
                                         "same_placement": bool(owners)})
        # a retry starts every unfinished job again (the service shows them pending meanwhile):
        # the running ones say so now, the parked ones when they are placed again
        for st in task.status.values():
            if st["state"] == JobLifecycle.RUNNING:
                st["state"] = JobLifecycle.PENDING
        for job_id, slot in task.placed.items():
            task.set_state(job_id, JobLifecycle.RUNNING, {"resumed": True, "rank": slot.owner})
