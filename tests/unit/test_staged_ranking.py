"""The staged warmup ranking (trainer.task_eval, WarmupRanking.clearly_out): a job ending its
warmup is evaluated on the lead quarter of the ranking's subset first; one that as many jobs as
the ranking can keep beat there by LEAD_MARGIN is evicted at once on that evidence, the others
finish the subset and their two parts merge into the number one pass gives.

The ranking's books first (pure Python), then whole tasks on a tiny Llama (CPU): staged against
one stage on the same data. The tiny model's configurations end their warmups within 2% of each
other, so the task test lowers the margin to 0.5% (the mechanism; the product's 5% is the books')."""

from __future__ import annotations

import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from contract.protocol import EarlyExitSettings, EvalSettings
from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir, write_jsonl
from tests.helpers.executor_cfg import executor_config
from trainer import task_eval
from trainer.config import Callbacks
from trainer.early_exit import LEAD_MARGIN, WarmupRanking
from trainer.executor import Executor
from trainer.jobs import TrainJob
from trainer.task_eval import lead_size

pytestmark = pytest.mark.usefixtures("one_thread")


# ----- the ranking's books -------------------------------------------------------------------------
def test_a_job_is_out_only_when_as_many_as_can_be_kept_beat_it_by_the_margin() -> None:
    wr = WarmupRanking([f"j{k}" for k in range(8)], keep_fraction=0.25)  # keeps 2 of 8
    leads = {"j0": 2.0, "j1": 2.05, "j2": 2.09, "j3": 2.3, "j4": float("nan")}
    for job_id, v in leads.items():
        wr.lead(job_id, v)
    assert wr.clearly_out("j0") is None and wr.clearly_out("j1") is None
    assert wr.clearly_out("j2") is None  # beaten by j0 alone by 5%: one, and 2 can be kept
    out = wr.clearly_out("j3")  # 2.3 * 0.95 = 2.185: j0, j1 and j2 under it
    assert out == {"lead_val_loss": 2.3, "beaten_by": 3, "keep_at_most": 2, "margin": LEAD_MARGIN}
    assert wr.clearly_out("j4") is None  # no finite lead: evaluated in full, as before
    assert wr.clearly_out("j5") is None  # no lead yet
    # fewer survivors keep fewer: with 5 of 8 exited in warmup, 1 of 3 is kept
    for job_id in ("j4", "j5", "j6", "j7"):
        wr.exit(job_id)
    assert wr.clearly_out("j2", margin=0.04) == {"lead_val_loss": 2.09, "beaten_by": 1, "keep_at_most": 1,
                                                 "margin": 0.04}


def test_early_jobs_count_among_the_ranked_and_are_never_kept() -> None:
    wr = WarmupRanking(["a", "b", "c", "d", "e"], keep_fraction=0.5)  # keeps ceil(2.5) = 3
    for job_id, v in {"a": 1.0, "b": 1.1, "c": 1.2, "d": 9.0, "e": 8.0}.items():
        wr.lead(job_id, v)
    assert wr.clearly_out("d") and wr.clearly_out("e")
    wr.report("d", 9.0, early=True)
    wr.report("e", 8.0, early=True)
    assert not wr.awaits("d") and not wr.ready  # evicted now: nothing of it waits
    for job_id, v in {"a": 1.3, "b": 0.9, "c": 1.25}.items():  # the full subset's losses
        wr.report(job_id, v)
        assert wr.awaits(job_id)
    assert wr.decide() == (["b", "c", "a"], ["e", "d"])  # 3 kept, as five unstaged would keep
    decisions = wr.eviction_decisions()
    assert decisions["d"].details["early"] and decisions["d"].details["ranked"] == 5


def test_a_ranking_checkpointed_before_staging_loads() -> None:
    wr = WarmupRanking(["a", "b"], keep_fraction=0.5)
    wr.report("a", 1.0)
    state = dict(wr.__dict__)
    del state["_leads"], state["_early"]  # what an earlier release pickled
    old = WarmupRanking.__new__(WarmupRanking)
    old.__setstate__(state)
    back = pickle.loads(pickle.dumps(old))
    back.lead("b", 2.0)
    assert back.clearly_out("b") is None and back.awaits("a")
    back.report("b", 2.0)
    assert back.decide() == (["a"], ["b"])


def test_the_lead_is_a_quarter_of_a_ranking_subset_of_32_or_more() -> None:
    assert [lead_size(n) for n in (8, 31, 32, 64, 100)] == [0, 0, 8, 16, 25]


# ----- whole tasks (CPU) ---------------------------------------------------------------------------
JOBS = [TrainJob(f"j{k}", lora_rank=4, lora_alpha=8, learning_rate=lr, batch_size=2, max_steps=12, seed=k)
        for k, lr in enumerate([3e-2, 1e-2, 1.0, 3.0, 3e-3, 0.3])]


class Run:
    def __init__(self) -> None:
        self.evals: dict[str, dict[int, float]] = defaultdict(dict)
        self.states: dict[str, tuple[str, dict]] = {}
        self.events: list[tuple[str, str, dict]] = []
        self.calls: list[tuple[int, list[str]]] = []  # (examples, jobs) of each evaluation

    def callbacks(self) -> Callbacks:
        return Callbacks(on_eval=lambda j, s, v: self.evals[j].__setitem__(s, v),
                         on_job_state=lambda j, st, d: self.states.__setitem__(j, (st, d)),
                         on_event=lambda j, m, d: self.events.append((j, m, d)))


class Spied(Executor):
    def __init__(self, cfg: Any, run: Run) -> None:  # noqa: ANN401
        super().__init__(cfg, run.callbacks())
        self.record = run

    def _load(self) -> None:
        super()._load()
        real = self.engine.evaluate_metrics

        def spy(examples, batch_size=8, job_ids=None, max_sequences=None, forwards=None):  # noqa: ANN001, ANN202
            self.record.calls.append((len(examples), sorted(job_ids or [])))
            return real(examples, batch_size, job_ids, max_sequences, forwards)

        self.engine.evaluate_metrics = spy


def task(tmp_path: Path, out: str, monkeypatch: pytest.MonkeyPatch, staged: bool) -> Run:
    """Six configurations of one warmup (3 of 12 steps), 3 kept (ceil(0.34 x 6)), the ranking's
    subset 64 validation samples (eval_min_samples); `staged` False: one stage, as before."""
    d = tiny_model_dir("llama", tmp_path)
    train = write_jsonl(tmp_path / "train.jsonl", synthetic_rows(80, seed=5, fmt="completion"))
    val = write_jsonl(tmp_path / "val.jsonl", synthetic_rows(64, seed=9, fmt="completion"))
    monkeypatch.setattr(task_eval, "LEAD_MARGIN", 0.005)
    monkeypatch.setattr(task_eval, "LEAD_MIN_SUBSET", 32 if staged else 1 << 30)
    cfg = executor_config(model_dir=str(d), train_file=str(train), val_file=str(val), output_dir=str(tmp_path / out),
                          jobs=JOBS, max_seq_len=48, checkpoint_every=None,
                          eval=EvalSettings(eval_every_steps=4, eval_max_samples=None, eval_min_samples=64),
                          early_exit=EarlyExitSettings(warmup_fraction=0.25, keep_fraction=0.34))
    run = Run()
    Spied(cfg, run).run()
    return run


def test_staged_ranking_evicts_early_and_keeps_what_one_stage_keeps(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    staged = task(tmp_path, "staged", monkeypatch, staged=True)
    whole = task(tmp_path, "whole", monkeypatch, staged=False)
    ranking = [d for _, m, d in staged.events if m == "warmup_ranking"]
    assert ranking == [d for _, m, d in whole.events if m == "warmup_ranking"]
    assert {j: st for j, (st, _) in staged.states.items()} == {j: st for j, (st, _) in whole.states.items()}
    early = {j: d for j, (st, d) in staged.states.items() if d.get("early")}
    kept = ranking[0]["keep"]
    assert len(early) == 3 and not set(early) & set(kept)
    for d in early.values():
        assert d["exit_reason"] == "underperforming" and (d["samples"], d["of_samples"]) == (16, 64)
        assert d["beaten_by"] >= d["keep_at_most"] == 3
    # evaluated on the lead 16 samples, all six together; the rest (48) only the ones not out
    assert staged.calls[0] == (16, sorted(j.job_id for j in JOBS))
    assert staged.calls[1] == (48, sorted(set(staged.states) - set(early)))
    assert whole.calls[0] == (64, sorted(j.job_id for j in JOBS))
    # the merged parts are the one pass's number; the early ones show their lead loss
    for job_id, curve in whole.evals.items():
        if job_id in early:
            assert staged.evals[job_id] == {3: early[job_id]["lead_val_loss"]}
            continue
        assert curve.keys() == staged.evals[job_id].keys()
        for step, v in curve.items():
            assert staged.evals[job_id][step] == pytest.approx(v, rel=1e-6)
    # the event a user sees of each (the API's task events), with the same numbers
    shown = {j: d for j, m, d in staged.events if m == "evicted_on_lead"}
    assert shown == {j: {"step": 3, **{k: v for k, v in d.items() if k not in ("early", "exit_reason")}}
                     for j, d in early.items()}
    assert not [m for _, m, _ in whole.events if m == "evicted_on_lead"]
    # evicted at their warmup's end (their one evaluation, step 3, above), never parked
    assert not {j for j, m, _ in staged.events if m == "parked_after_warmup"} & set(early)
