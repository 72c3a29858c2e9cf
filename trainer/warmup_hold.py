"""A job's end held for its warmup ranking, so that its final status does not depend on how many
jobs the executor admits at once (docs/architecture.md, "Loss-aware early exit").

A job that reported its end-of-warmup loss waits for its task's ranking. Parked (a queued
configuration needed the room), it waits idle; otherwise it trains on meanwhile, and what would
end it first, a detector's exit or its last step, is held: the job stops (it leaves the engine as
a parked job does, its state kept) and the ranking decides first. Evicted, it exits as
underperforming, as a parked job does; kept, it gets what was held (`settle_kept`).

Nothing else is stored: a held job is a parked job (a `JobSlot` in the task's queue, its state in
`parked` on its owner rank) whose monitor has decided (`JobMonitor.decision`, its first decision)
or that has run all its steps. State.pt keeps the queue, the parked states, the monitors and the
ranking, so a checkpoint, a crash or a pause keeps the holds as they were.
"""

from __future__ import annotations

from typing import Protocol

from trainer.config import Callbacks
from trainer.early_exit import ExitDecision, JobMonitor, WarmupRanking
from trainer.jobs import JobRun, TrainJob
from trainer.task_parts import JobSlot, TaskExecutor, fresh


class RankedTask(Protocol):
    """What holding uses of a task (trainer.colocate.TaskRun): its ranking, its jobs where they
    are, their monitors, and how a job ends."""

    executor: TaskExecutor
    cb: Callbacks
    ranking: WarmupRanking | None
    queue: list[TrainJob | JobSlot]
    placed: dict[str, JobSlot]
    parked: dict[str, JobRun]
    parked_on_device: set[str]
    monitors: dict[str, JobMonitor]

    def exit(self, job_id: str, decision: ExitDecision) -> None: ...

    def complete(self, job_id: str, slot: JobSlot, state: JobRun | None) -> None: ...


def awaits_ranking(task: RankedTask, job_id: str) -> bool:
    """Whether the job reported to its task's warmup ranking, which has not decided yet."""
    return task.ranking is not None and task.ranking.awaits(job_id)


def park(task: RankedTask, job_id: str, event: str, details: dict) -> None:
    """Take a placed job off the engine to wait in its task's queue for its own rank; then
    `event`. Its state stays on the device: where a queued configuration of the task needs the
    room, while the device keeps PARK_RESERVE free after it (else in pinned host memory); where
    none does, there (a copy of its adapter's region, nothing crosses to the host; where the
    device runs short later, the executor's room checks spill it: Executor._spill_parked)."""
    executor, slot = task.executor, task.placed.pop(job_id)
    room = bool(fresh(task.queue))
    task.queue.append(slot)
    if slot.owner == executor.rank:  # adapter parallelism: the other ranks keep the books alone
        with executor.phase("park"):
            target = executor.engine.slots.park_target(job_id) if room else None
            task.parked[job_id] = executor.engine.detach(job_id, park_device=target)
            if target is None:
                task.parked_on_device.add(job_id)
    task.cb.on_event(job_id, event, {**details, "step": slot.step, "rank": slot.owner})


def hold_exit(task: RankedTask, job_id: str, decision: ExitDecision) -> None:
    """A detector decided to exit a job that awaits its ranking: it stops, the decision held
    (its monitor's first decision, what settle_kept applies; recorded there if it is not yet)."""
    monitor = task.monitors[job_id]
    if monitor.decision is None:
        monitor.decision = decision
    park(task, job_id, "exit_held", {**decision.details, "exit_reason": decision.reason,
                                     "until": "warmup_ranking"})


def hold_completion(task: RankedTask, job_id: str) -> None:
    """A job that awaits its ranking ran all its steps: it stops, its completion held."""
    park(task, job_id, "completion_held", {"until": "warmup_ranking"})


def settle_kept(task: RankedTask, keep: list[str]) -> None:
    """After the ranking (its evicted jobs have exited): each kept job that waits with a held
    end gets it, its detector's exit or its completion (final adapter and all); the other kept
    jobs stay queued and train on when admitted again."""
    kept = set(keep)
    for slot in [q for q in task.queue if isinstance(q, JobSlot) and q.job_id in kept]:
        decision = task.monitors[slot.job_id].decision
        if decision is not None:
            task.exit(slot.job_id, decision)
        elif slot.done:
            task.queue.remove(slot)
            task.parked_on_device.discard(slot.job_id)
            state = task.parked.pop(slot.job_id, None)  # on its owner rank only
            if state is not None:
                state.settle()  # a park's host copies complete before the export reads them
            task.complete(slot.job_id, slot, state)
