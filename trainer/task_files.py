"""A task's files: checkpoints and exports written off the step loop by the executor's writer
thread (one GPU), announcements held until their files are complete, and the task's state.pt,
written from every rank's part and resumed on any number of ranks: each job's state in its own
file, rewritten only when the job trained since (trainer.checkpoint_files tells the format). A
part of trainer.colocate.TaskRun (its module docstring tells the rules)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from contract.states import JobState as JobLifecycle
from trainer.checkpoint import (
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
    resolve_job,
    save_checkpoint,
    write_checkpoint,
)
from trainer.jobs import JobRun
from trainer.task_parts import JobSlot, TaskExecutor

log = logging.getLogger("loraplex.executor")


class TaskFiles:
    """Writes, announcements, checkpoint and resume; the mixin of trainer.colocate.TaskRun."""

    executor: TaskExecutor  # the executor hosting the task
    cfg: Any  # trainer.config.ExecutorConfig
    out: Path
    writes: list[Write]
    held: deque[tuple[Write | None, Callable[..., None], tuple]]
    job_writes: dict[str, Write]
    checkpoint_write: Write | None
    # each started job's last state on file: (its step then, the file's name; None on a rank
    # but 0, which names and writes the files) and this run's token in the names it writes
    job_files: dict[str, tuple[int, str | None]]
    file_tag: str

    def _write(self, kind: str, obj: Any, write: Callable[[Any], Any]) -> Write:
        """Snapshot obj now (waiting first while the writer holds too many snapshots), then
        write(snapshot) on the executor's writer thread."""
        writer = self.executor.writer
        nbytes = tensor_bytes(obj)
        writer.room(nbytes)
        snap = take_snapshot(obj)
        pending = writer.submit(self.task_id, kind, nbytes, lambda: write(snap.wait()))
        self.writes.append(pending)
        return pending

    def _after_files(self, job_id: str | None, fn: Callable[..., None], *args: Any) -> None:
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
        for write in list(self.writes):
            if wait and not write.done.is_set():
                with self.executor.phase(write.kind):
                    write.done.wait()
            if not write.done.is_set():
                break  # one writer, in order: the later ones are not done either
            self.writes.remove(write)
            if write.error is not None and self.error is None:
                log.error("task=%s %s write failed: %s", self.task_id, write.kind, write.error)
                self.error = write.error
        while self.held and (self.held[0][0] is None or self.held[0][0].done.is_set()):
            write, fn, args = self.held.popleft()
            if write is None or write.error is None:  # a file that failed is never announced
                fn(*args)

    def checkpoint(self) -> None:
        with self.executor.phase("checkpoint"):
            self._checkpoint_now()

    def _checkpoint_now(self) -> None:
        executor = self.executor
        self.last_checkpoint, self.checkpoint_due = time.monotonic(), False
        self.report_throughput()
        eng = executor.engine
        mine = {j: self._job_part(s) for j, s in [*eng.jobs.items(), *self.parked.items()]
                if j in self.placed or j in self.parked}
        part = {"jobs": mine, "objective": executor.objective.task_state(eng, [*self.train, *self.val])}
        if executor.writer is not None:  # one rank: the snapshot is written off the loop
            # at most one checkpoint of the task in flight: the last complete one is then never
            # more than one interval behind the one being written, so a crash (kill -9) loses
            # under two intervals of steps even when writes lag the loop (a slow or loaded disk)
            if self.checkpoint_write is not None:
                self.checkpoint_write.done.wait()  # set once written or failed: never hangs
            self.checkpoint_write = self._write("checkpoint", self._payload([part]), lambda snap: write_checkpoint(
                self.out, *snap, save=save_checkpoint))
            return
        parts = executor.strategy.collect_parts(self.out, take_snapshot(part).wait())
        if parts is None:  # not rank 0: it writes the one state.pt and the job files
            return
        write_checkpoint(self.out, *self._payload(parts), save=save_checkpoint)

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
        executor = self.executor
        files: dict[str, dict[str, Any]] = {}
        refs = {j: self._job_ref(j, d, files) for part in parts for j, d in part["jobs"].items()}
        owners = {j: s.owner for j, s in self.placed.items()}
        owners.update({q.job_id: q.owner for q in self.queue if isinstance(q, JobSlot)})
        payload = {
            "format": FORMAT,
            "active": [refs[j] for j in self.placed],
            "queue": [refs[q.job_id] if isinstance(q, JobSlot) else {"fresh": q} for q in self.queue],
            "status": self.status, "monitors": self.monitors, "ranking": self.ranking,
            "global_step": self.global_step, "last_eval": self.last_eval, "rng": rng_state(),
            "parallel": {"world": executor.world, "owners": owners},
        }
        merged = executor.objective.merge_task_states([p["objective"] for p in parts])
        if merged is not None:  # DPO: every rank's reference log-probs, reused by a resume
            payload["reference"] = merged
        return payload, files

    def resume(self, ck: dict[str, Any], restore_rng: bool) -> None:
        """Continue from a state.pt of any strategy: on the same number of ranks every job stays
        on its rank; otherwise jobs are dealt to the least-loaded ranks, which gives the same
        adapters, as a job's trajectory does not depend on where or beside whom it runs."""
        executor = self.executor
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
            self.placed[job_id] = JobSlot(job_id, r, bs, d["step"], d["total_steps"])
            if r == executor.rank:
                executor.engine.attach(self.restore(resolve_job(self.out, d)))
        self.queue = []
        for q in ck["queue"]:
            if "fresh" in q:
                self.queue.append(q["fresh"])
                continue
            job_id = q["spec"]["job_id"]
            r = owners.get(job_id)
            if r is None:
                r = min(range(executor.world), key=lambda k: (parked_load[k], k))
            parked_load[r] += 1
            self.queue.append(JobSlot(job_id, r, q["spec"]["batch_size"], q["step"], q["total_steps"]))
            if r == executor.rank:
                self.parked[job_id] = self.restore(resolve_job(self.out, q)).to("cpu")
        self.status, self.monitors, self.ranking = ck["status"], ck["monitors"], ck["ranking"]
        for monitor in self.monitors.values():  # the task's settings as given now, not as pickled
            monitor.cfg = self.cfg.settings.early_exit
        self.global_step, self.last_eval = ck["global_step"], ck["last_eval"]
        executor.objective.load_task_state(executor.engine, ck.get("reference"))
        if restore_rng:  # only an executor's first task: the others' RNG is not the executor's
            set_rng_state(ck["rng"])
        self.cb.on_event("", "resumed", {"global_step": self.global_step, "ranks": executor.world,
                                         "same_placement": bool(owners)})
        # a retry starts every unfinished job again (the service shows them pending meanwhile):
        # the running ones say so now, the parked ones when they are placed again
        for st in self.status.values():
            if st["state"] == JobLifecycle.RUNNING:
                st["state"] = JobLifecycle.PENDING
        for job_id, slot in self.placed.items():
            self.set_state(job_id, JobLifecycle.RUNNING, {"resumed": True, "rank": slot.owner})
