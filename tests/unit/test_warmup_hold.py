"""A job's end held for its warmup ranking (trainer.warmup_hold): a job that reported its
end-of-warmup loss and trains on while the ranking waits stops when a detector exits it or when
it runs its last step, and the ranking decides first (evicted: underperforming, as a parked job;
kept: what was held). So a job's final status does not depend on how many jobs the executor
admits at once. Before, a job that trained on ended "exited:diverging" or "completed" where the
same job, parked for a queued configuration, ended "exited:underperforming".

The task's bookkeeping is driven on a stand-in executor first (every rank of an adapter-parallel
executor keeps the same books; only the owner takes the job off its engine), then whole tasks run
on a tiny Llama (CPU): two admission caps, and a stop and resume while jobs are held."""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from contract.protocol import EarlyExitSettings, EvalSettings
from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir, write_jsonl
from tests.helpers.executor_cfg import executor_config
from trainer.colocate import TaskRun
from trainer.config import Callbacks
from trainer.executor import Executor
from trainer.jobs import TrainJob
from trainer.task_parts import JobSlot, StepNumbers

pytestmark = pytest.mark.usefixtures("one_thread")


# ----- the task's books on a stand-in executor ---------------------------------------------------
class StandInState:
    """A job's state as the engine hands it back (what holding and completion touch of it)."""

    def __init__(self, job_id: str) -> None:
        self.job_id, self.where, self.settled = job_id, "engine", False

    def settle(self) -> None:
        self.settled = True


class StandInEngine:
    def __init__(self) -> None:
        self.jobs: dict[str, StandInState] = {}
        self.detached: list[tuple[str, str | None]] = []
        self.slots = SimpleNamespace(park_target=lambda job_id: "cpu")

    def detach(self, job_id: str, park_device: str | None = None) -> StandInState:
        self.detached.append((job_id, park_device))
        state = self.jobs.pop(job_id)
        state.where = park_device or "device"
        return state


class StandInExecutor:
    """The few things of trainer.task_parts.TaskExecutor the task's warmup and ends use."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank, self.world = rank, world
        self.engine = StandInEngine()
        self.writer = None

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def log_state(self, task_id: str, job_id: str, state: str, details: dict) -> None:
        pass


class Books:
    """A TaskRun on a stand-in executor, its jobs placed by hand, stepped as the loop steps it:
    train losses (the detectors' train path), evaluations (the eval path: a decision goes to
    `TaskRun.exit`, as `evaluate_due` sends it), then the warmup policy, then completions."""

    def __init__(self, tmp_path: Path, jobs: list[TrainJob], early_exit: EarlyExitSettings,
                 rank: int = 0, world: int = 1) -> None:
        cfg = executor_config(model_dir=str(tmp_path), train_file=str(tmp_path / "t.jsonl"),
                              output_dir=str(tmp_path / f"out{rank}"), jobs=jobs, max_seq_len=48,
                              early_exit=early_exit)
        self.states: list[tuple[str, str, dict]] = []
        self.events: list[tuple[str, str, dict]] = []
        self.exports: list[tuple[str, str, Any]] = []
        cb = Callbacks(on_job_state=lambda j, st, d: self.states.append((j, st, d)),
                       on_event=lambda j, m, d: self.events.append((j, m, d)))
        self.executor = StandInExecutor(rank, world)
        self.task = TaskRun(self.executor, cfg, cb, "task")  # type: ignore[arg-type]  # a stand-in
        self.task.export = lambda j, kind, state=None, owner=None: self.exports.append((j, kind, state))
        for k, spec in enumerate(jobs):  # placed in order, dealt round-robin over the ranks
            self.task.queue.remove(spec)
            owner = k % world
            self.task.placed[spec.job_id] = JobSlot(spec.job_id, owner, spec.batch_size, 0, spec.max_steps)
            if owner == rank:
                self.executor.engine.jobs[spec.job_id] = StandInState(spec.job_id)
            self.task.status[spec.job_id]["state"] = "running"

    def step(self, train: dict[str, float], evals: dict[str, float]) -> None:
        task = self.task
        for slot in task.placed.values():
            slot.step += 1
        merged = {j: (s.step, train.get(j, 2.0), False, 0.0, None, 0) for j, s in task.placed.items()}
        task.observe_train(merged, StepNumbers(0.0, 0, 0, 0.0, []))
        for job_id, val in evals.items():
            if job_id in task.placed:
                decision = task.monitors[job_id].observe_eval(task.placed[job_id].step, val)
                if decision is not None:
                    task.exit(job_id, decision)
        task.warmup_policy()
        task.finish_done()

    def status(self) -> dict[str, tuple[str, str | None]]:
        return {j: (st["state"], st["exit_reason"]) for j, st in self.task.status.items()}

    def events_named(self, name: str) -> dict[str, dict]:
        return {j: d for j, m, d in self.events if m == name}


HOLD_JOBS = [TrainJob("short", batch_size=2, max_steps=4), TrainJob("nan", batch_size=2, max_steps=8),
             TrainJob("over", batch_size=2, max_steps=8), TrainJob("long", batch_size=2, max_steps=20)]


def run_holds(tmp_path: Path, long_val: float, keep_fraction: float, rank: int = 0, world: int = 1) -> Books:
    """Warmups of 1, 2, 2 and 5 steps (a quarter of each run). After theirs, `short`, `nan` and
    `over` train on (nothing is queued) while `long` warms up: `nan`'s train loss turns NaN at
    step 3 (diverging), `over` overfits at steps 3 and 4 (tau_gap 10, patience 2), `short` runs
    its last step at 4; the ranking comes at step 5."""
    books = Books(tmp_path, HOLD_JOBS, EarlyExitSettings(warmup_fraction=0.25, keep_fraction=keep_fraction,
                                                         tau_gap=10.0, train_while_waiting=True), rank, world)
    books.step({}, {"short": 3.0})
    books.step({}, {"nan": 3.0, "over": 3.0})
    books.step({"nan": math.nan}, {"over": 100.0})
    books.step({}, {"over": 100.0, "short": 3.0})
    # before the ranking: every one of them stopped, held, still running to the service
    held = books.events_named("exit_held")
    assert {j: (d["exit_reason"], d["step"]) for j, d in held.items()} == {
        "nan": ("diverging", 3), "over": ("overfitting", 4)}
    assert {j: d["step"] for j, d in books.events_named("completion_held").items()} == {"short": 4}
    assert list(books.task.placed) == ["long"] and books.states == []
    assert [q.job_id for q in books.task.queue] == ["nan", "over", "short"]
    mine = {j for k, j in enumerate(["short", "nan", "over"]) if k % world == rank}
    assert sorted(books.task.parked) == sorted(mine)  # their states kept, on the owner alone
    # nothing queued needs the room: on the device (the stand-in's park_target would say "cpu")
    assert sorted(books.executor.engine.detached) == sorted((j, None) for j in mine)
    books.step({}, {"long": long_val})  # long's warmup ends: the ranking decides
    return books


def test_held_ends_of_evicted_jobs_become_underperforming(tmp_path: Path) -> None:
    books = run_holds(tmp_path, long_val=1.0, keep_fraction=0.25)
    assert books.events_named("warmup_ranking")[""] == {"keep": ["long"], "evict": ["short", "nan", "over"]}
    evicted = ("exited", "underperforming")
    assert books.status() == {"short": evicted, "nan": evicted, "over": evicted, "long": ("running", None)}
    # exactly as a job parked for a queued configuration exits, and nothing of what was held
    assert [(j, d) for j, st, d in books.states] == [
        (j, {"exit_reason": "underperforming", "kept": ["long"]}) for j in ("short", "nan", "over")]
    assert books.exports == [] and books.task.parked == {} and books.task.queue == []


def test_held_ends_of_kept_jobs_are_applied_after_the_ranking(tmp_path: Path) -> None:
    books = run_holds(tmp_path, long_val=9.0, keep_fraction=0.75)
    assert books.events_named("warmup_ranking")[""] == {"keep": ["short", "nan", "over"], "evict": ["long"]}
    assert books.status() == {"short": ("completed", None), "nan": ("exited", "diverging"),
                              "over": ("exited", "overfitting"), "long": ("exited", "underperforming")}
    details = {j: d for j, _, d in books.states}
    assert details["nan"]["non_finite"] == "train_loss" and details["nan"]["step"] == 3
    assert details["over"]["step"] == 4 and details["over"]["consecutive_evals"] == 2
    assert details["short"] == {"steps": 4, "best_val": 3.0}
    # the completion's final adapter from the state it kept, its host copies complete first
    ((job, kind, state),) = books.exports
    assert (job, kind, state.job_id, state.where, state.settled) == ("short", "final", "short", "device", True)
    assert books.task.parked == {} and books.task.queue == [] and books.task.placed == {}


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_keeps_the_same_books_and_only_the_owner_detaches(tmp_path: Path, rank: int) -> None:
    alone = run_holds(tmp_path / "alone", long_val=9.0, keep_fraction=0.75)
    books = run_holds(tmp_path / "ranks", long_val=9.0, keep_fraction=0.75, rank=rank, world=2)
    assert books.status() == alone.status() and books.states == alone.states
    assert [(j, m) for j, m, _ in books.events] == [(j, m) for j, m, _ in alone.events]
    owned = {"short": 0, "nan": 1, "over": 0, "long": 1}
    assert {j for j, _ in books.executor.engine.detached} == {j for j, r in owned.items() if r == rank}
    assert [(j, k) for j, k, _ in books.exports] == [("short", "final")]  # announced by every rank
    assert all((s is not None) == (owned[j] == rank) for j, _, s in books.exports)  # weights: the owner's


@pytest.mark.parametrize("train_on", [False, True])
def test_a_park_for_a_queued_configuration_asks_where_and_a_waiting_one_stays(tmp_path: Path,
                                                                               train_on: bool) -> None:
    # "a" ends its warmup at step 1 while "c" is queued: it parks for c's room where the engine
    # says (the stand-in's park_target: the host), in either mode; once c is placed and "b" is
    # still warming up, c's warmup end at step 2 parks it on the device (train_while_waiting
    # false) or lets it train on (true), nothing queued needing the room
    jobs = [TrainJob("a", batch_size=2, max_steps=4), TrainJob("b", batch_size=2, max_steps=40),
            TrainJob("c", batch_size=2, max_steps=8)]
    books = Books(tmp_path, jobs, EarlyExitSettings(warmup_fraction=0.25, keep_fraction=0.5, tau_gap=10.0,
                                                    train_while_waiting=train_on))
    task = books.task
    task.placed.pop("c")
    books.executor.engine.jobs.pop("c")
    task.queue.append(jobs[2])
    books.step({}, {"a": 3.0})
    assert books.executor.engine.detached == [("a", "cpu")]
    assert list(books.events_named("parked_after_warmup")) == ["a"]
    task.queue.remove(jobs[2])  # c admitted
    task.placed["c"] = JobSlot("c", 0, 2, 0, 8)
    books.executor.engine.jobs["c"] = StandInState("c")
    books.step({}, {"c": 3.0})
    books.step({}, {"c": 3.0})
    assert books.executor.engine.detached == [("a", "cpu")] + ([] if train_on else [("c", None)])
    assert sorted(task.placed) == (["b", "c"] if train_on else ["b"])


def test_without_a_ranking_a_detector_and_the_last_step_end_a_job_at_once(tmp_path: Path) -> None:
    # one configuration: no ranking, the detectors on; a NaN train loss exits the job at once
    one = Books(tmp_path / "one", [TrainJob("alone", batch_size=2, max_steps=4)],
                EarlyExitSettings(warmup_fraction=0.25))
    # early exit off: no ranking, no detector; the last step completes a job at once
    off = Books(tmp_path / "off", [TrainJob("alone", batch_size=2, max_steps=4), TrainJob("other", batch_size=2,
                                                                                      max_steps=2)],
                EarlyExitSettings(enabled=False))
    for books in (one, off):
        assert books.task.ranking is None
        books.step({}, {})
        books.step({"alone": math.nan}, {})
        assert not books.events_named("exit_held") and not books.events_named("completion_held")
    assert one.status() == {"alone": ("exited", "diverging")}
    assert off.status() == {"alone": ("running", None), "other": ("completed", None)}
    assert [(j, k) for j, k, _ in off.exports] == [("other", "final")]


# ----- whole tasks on a tiny Llama ------------------------------------------------------------
def search(tmp_path: Path, out: str, max_active_jobs: int, train_on: bool = True, **kw: Any) -> Any:
    """Five configurations, a quarter of each run its warmup, the best 3 kept. The two short
    ones (4 steps, warmup 1) run their last step before the long ones (20 steps) end their
    warmup at 5 where they train on while waiting (`train_on`, train_while_waiting); `nan_later`
    (lr 1e30 after a learning-rate warmup of 2 steps: its first update is at lr 0, its second
    breaks it) has a NaN train loss at step 3; `slow_short` barely trains. At the ranking,
    `slow_short` and `nan_later` are the two worst (the base model's loss)."""
    d = tiny_model_dir("llama", tmp_path)
    train = write_jsonl(tmp_path / "train.jsonl", synthetic_rows(30, seed=5, fmt="completion"))
    jobs = [TrainJob("keep_short", lora_rank=4, lora_alpha=8, learning_rate=3e-2, batch_size=2, max_steps=4, seed=1),
            TrainJob("slow_short", lora_rank=4, lora_alpha=8, learning_rate=1e-7, batch_size=2, max_steps=4, seed=2),
            TrainJob("nan_later", lora_rank=4, lora_alpha=8, learning_rate=1e30, warmup_steps=2, batch_size=2,
                     max_steps=4, seed=3),
            TrainJob("long_a", lora_rank=4, lora_alpha=8, learning_rate=1e-2, batch_size=2, max_steps=20, seed=4),
            TrainJob("long_b", lora_rank=8, lora_alpha=16, learning_rate=1e-2, batch_size=2, max_steps=20, seed=5)]
    return executor_config(model_dir=str(d), train_file=str(train), output_dir=str(tmp_path / out), jobs=jobs,
                           max_seq_len=48, eval=EvalSettings(eval_every_steps=4, eval_max_samples=None),
                           checkpoint_every=None, max_active_jobs=max_active_jobs,
                           early_exit=EarlyExitSettings(warmup_fraction=0.25, keep_fraction=0.6, tau_gap=10.0,
                                                        train_while_waiting=train_on), **kw)


class Recorder:
    def __init__(self) -> None:
        self.train: dict[str, list[int]] = defaultdict(list)
        self.events: list[tuple[str, str, dict]] = []
        self.adapters: list[tuple[str, str]] = []
        self.order: list[tuple[str, object]] = []  # (job, step) of train losses and (job, event) in turn

    def callbacks(self) -> Callbacks:
        def train(j: str, step: int, _: float) -> None:
            self.train[j].append(step)
            self.order.append((j, step))

        def event(j: str, m: str, d: dict) -> None:
            self.events.append((j, m, d))
            self.order.append((j, m))

        return Callbacks(on_train_loss=train, on_event=event,
                         on_adapter=lambda j, kind, p: self.adapters.append((j, kind)))

    def named(self, name: str) -> dict[str, dict]:
        return {j: d for j, m, d in self.events if m == name}


EXPECTED = {"keep_short": ("completed", None), "slow_short": ("exited", "underperforming"),
            "nan_later": ("exited", "underperforming"), "long_a": ("completed", None),
            "long_b": ("completed", None)}


def statuses(status: dict[str, dict]) -> dict[str, tuple[str, str | None]]:
    return {j: (st["state"], st["exit_reason"]) for j, st in status.items()}


def test_a_jobs_final_status_does_not_depend_on_how_many_jobs_run_at_once(tmp_path: Path) -> None:
    # all five at once: the short ones train on past their warmup while the long ones warm up
    # (before: slow_short "completed", nan_later "exited:diverging"); two at a time: they are
    # parked for the queued configurations and the ranking evicts them
    together, rotated = Recorder(), Recorder()
    got_together = statuses(Executor(search(tmp_path, "together", 5), together.callbacks()).run())
    got_rotated = statuses(Executor(search(tmp_path, "rotated", 2), rotated.callbacks()).run())
    assert got_together == got_rotated == EXPECTED
    assert together.named("warmup_ranking") == rotated.named("warmup_ranking")
    assert {j: d["exit_reason"] for j, d in together.named("exit_held").items()} == {"nan_later": "diverging"}
    assert together.named("exit_held")["nan_later"]["step"] == 3
    assert sorted(together.named("completion_held")) == ["keep_short", "slow_short"]
    assert not together.named("parked_after_warmup")
    assert sorted(rotated.named("parked_after_warmup")) == ["keep_short", "nan_later", "slow_short"]
    for rec in (together, rotated):  # a kept job's held completion still ends with its final adapter
        assert ("keep_short", "final") in rec.adapters
        assert ("slow_short", "final") not in rec.adapters and ("nan_later", "final") not in rec.adapters
        assert (tmp_path / ("together" if rec is together else "rotated") / "jobs" / "keep_short" / "final"
                / "adapter_model.safetensors").exists()


def test_waiting_jobs_park_and_a_kept_one_trains_as_it_would_have(tmp_path: Path) -> None:
    # the default (train_while_waiting false): the short ones park at their warmup's end (step 1)
    # with all five at once too, train nothing while the long ones warm up, and end as before; the
    # kept one trains its last 3 steps after the ranking into the final adapter of training on
    parked, trained_on = Recorder(), Recorder()
    got = statuses(Executor(search(tmp_path, "parked", 5, train_on=False), parked.callbacks()).run())
    Executor(search(tmp_path, "trained_on", 5), trained_on.callbacks()).run()
    assert got == EXPECTED
    assert parked.named("warmup_ranking") == trained_on.named("warmup_ranking")
    assert {j: d["step"] for j, d in parked.named("parked_after_warmup").items()} == {
        "keep_short": 1, "slow_short": 1, "nan_later": 1}
    assert not parked.named("exit_held") and not parked.named("completion_held")
    assert parked.train["slow_short"] == parked.train["nan_later"] == [1]  # no step past the warmup
    assert parked.train["keep_short"] == trained_on.train["keep_short"] == [1, 2, 3, 4]
    # parked, the kept one's steps 2-4 come after the ranking; trained on, before it
    ranking = parked.order.index(("", "warmup_ranking"))
    assert parked.order.index(("keep_short", 2)) > ranking > parked.order.index(("long_a", 5))
    assert trained_on.order.index(("keep_short", 4)) < trained_on.order.index(("", "warmup_ranking"))
    finals = [load_file(tmp_path / run / "jobs" / "keep_short" / "final" / "adapter_model.safetensors")
              for run in ("parked", "trained_on")]
    assert finals[0].keys() == finals[1].keys()
    for name, tensor in finals[0].items():
        torch.testing.assert_close(tensor, finals[1][name], rtol=1e-5, atol=1e-6)


def test_held_jobs_survive_a_stop_and_resume(tmp_path: Path) -> None:
    # stopped after step 4: nan_later's exit held since step 3, the short ones' completions since
    # step 4; the resumed run keeps them held (state.pt: queued job slots, their monitors, the
    # ranking) and ends every job as an uninterrupted run does, without training them again
    before, after = Recorder(), Recorder()
    Executor(search(tmp_path, "stopped", 5, stop_after_steps=4), before.callbacks()).run()
    ck = torch.load(tmp_path / "stopped" / "state.pt", map_location="cpu", weights_only=False)
    assert sorted(q["spec"]["job_id"] for q in ck["queue"]) == ["keep_short", "nan_later", "slow_short"]
    assert ck["ranking"].result is None and ck["monitors"]["nan_later"].decision.reason == "diverging"
    status = Executor(search(tmp_path, "stopped", 5), after.callbacks()).run()
    assert statuses(status) == EXPECTED
    assert any(m == "resumed" for _, m, _ in after.events) and after.named("warmup_ranking")
    assert not ({"keep_short", "slow_short", "nan_later"} & set(after.train))
    assert ("keep_short", "final") in after.adapters
