"""The exit policy of bench/early_exit_study.py: run on the engine under admission and rotation
(`run_grid`), and replayed on recorded curves for other settings (`replay`)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from early_exit_study_task import Outcome, Plan  # noqa: E402

from contract.protocol import EarlyExitSettings  # noqa: E402
from trainer.admission import AdmissionController  # noqa: E402
from trainer.data import Example  # noqa: E402
from trainer.early_exit import JobMonitor, WarmupRanking, warmup_ranking, warmup_steps  # noqa: E402
from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.jobs import JobRun  # noqa: E402


def run_grid(engine: MultiLoraEngine, plans: list[Plan], val: list[Example], epochs: int,
             cfg: EarlyExitSettings, budget: int, events: list[dict]) -> dict[str, Outcome]:
    """Train every plan on the engine to completion or exit, under a budget of co-resident
    sequences (the CPU form of admission; the policy is the one the executor runs).

    With `cfg.enabled`: detectors at every evaluation; at the end of its warmup a job reports its
    validation loss and is parked on the CPU so queued jobs rotate in; once every job has finished
    (or exited) its warmup, the top keep_ratio resume and the rest exit as underperforming.
    """
    seq = 16
    ctrl = AdmissionController.from_token_budget(max_tokens=budget * seq, seq_len=seq)
    plan = {p.job_id: p for p in plans}
    out = {p.job_id: Outcome() for p in plans}
    monitors = {p.job_id: JobMonitor(cfg) for p in plans}
    pending = [engine.new_job(p.spec(epochs)) for p in plans]
    parked: dict[str, JobRun] = {}
    ranking = WarmupRanking(list(plan), cfg.keep_fraction) if cfg.enabled else None

    def running() -> list[JobRun]:
        return list(engine.jobs.values())

    def attach(ids: list[str]) -> None:
        for i in ids:
            state = next(s for s in pending if s.job_id == i)
            pending.remove(state)
            engine.attach(state)
            out[i].state = "running"

    def leave(job_id: str, park: bool) -> None:
        state = engine.detach(job_id, park_device="cpu" if park else None)
        if park:
            parked[job_id] = state
        attach(ctrl.backfill(state.batch_size, pending, running()))

    attach(ctrl.admit(pending, running()))
    while engine.jobs:
        losses = engine.step().losses
        due = []
        for job_id, loss in losses.items():
            o, mon = out[job_id], monitors[job_id]
            o.steps += 1
            o.samples += plan[job_id].batch_size
            o.train.append(loss)
            if mon.observe_train(o.steps, loss) is None and o.steps in plan[job_id].eval_at:
                due.append(job_id)
            elif mon.decision is not None:
                due.append(job_id)  # non-finite train loss: decided at once
        vals = engine.evaluate(val, batch_size=len(val), job_ids=due) if due else {}
        for job_id in due:
            o, mon, p = out[job_id], monitors[job_id], plan[job_id]
            decision = mon.decision
            if job_id in vals and decision is None:
                o.curve.append((o.steps, vals[job_id]))
                decision = mon.observe_eval(o.steps, vals[job_id])
            if decision is not None:
                o.state, o.exit_reason = "exited", decision.reason
                events.append({"job": job_id, "reason": decision.reason,
                               **{k: v for k, v in decision.details.items()
                                  if isinstance(v, (int, float))}})
                if ranking is not None and job_id in ranking.waiting:
                    ranking.exit(job_id)
                leave(job_id, park=False)
            elif ranking is not None and o.steps == p.warmup and job_id in ranking.waiting:
                ranking.report(job_id, o.curve[-1][1])
                if o.steps < p.total_steps:
                    o.state = "parked"
                    leave(job_id, park=True)
        for job_id in [s.job_id for s in running() if s.done]:
            out[job_id].state = "completed"
            leave(job_id, park=False)
        if ranking is not None and ranking.ready and ranking.result is None:
            keep, evict = ranking.decide()
            events.append({"ranking": {"keep": keep, "evict": evict}})
            for job_id in evict:
                if job_id in parked:
                    del parked[job_id]
                    out[job_id].state, out[job_id].exit_reason = "exited", "underperforming"
            pending += [parked.pop(j) for j in keep if j in parked]
            attach(ctrl.admit(pending, running()))
    if pending or parked:
        raise RuntimeError(f"jobs left behind: {[s.job_id for s in pending]} {list(parked)}")
    return out


def _replay_step(p: Plan, a: Outcome, mon: JobMonitor, vals: dict[int, float], o: Outcome,
                 step: int) -> bool:
    """One step of (a)'s recorded job `a` through the monitor into `o`: its train loss, its
    validation loss where (a) evaluated; True when the job exits there."""
    o.steps, o.samples = step, step * p.batch_size
    d = mon.observe_train(step, a.train[step - 1])
    if d is None and step in vals:
        o.curve.append((step, vals[step]))
        d = mon.observe_eval(step, vals[step])
    if d is not None:
        o.state, o.exit_reason = "exited", d.reason
    return d is not None


def replay(plans: list[Plan], full: dict[str, Outcome], cfg: EarlyExitSettings,
           per_eval_slope: bool = False) -> dict[str, Outcome]:
    """The policy of `run_grid` applied to (a)'s recorded curves (valid because a job's curve does
    not depend on its co-residents, which the real (b) run checks); for other settings.

    per_eval_slope: read tau_slope per evaluation interval instead of per step (the alternative
    normalisation JobMonitor's docstring argues against), i.e. tau / eval_every per step.
    """
    res = {}
    reached = {}
    monitors = {}
    for p in plans:
        job_cfg = cfg
        if per_eval_slope:
            job_cfg = cfg.model_copy(update={"tau_slope": cfg.tau_slope / p.eval_every})
        a, mon, o = full[p.job_id], JobMonitor(job_cfg), Outcome()
        monitors[p.job_id] = mon
        vals = dict(a.curve)
        warm = warmup_steps(p.total_steps, cfg.warmup_fraction)
        res[p.job_id] = o
        for step in range(1, p.total_steps + 1):
            if _replay_step(p, a, mon, vals, o, step):
                break
            if step == warm:
                reached[p.job_id] = vals[step]
                break
    totals = {p.job_id: p.total_steps for p in plans}
    _, evict = warmup_ranking(reached, cfg.keep_fraction)
    for job_id in evict:
        if res[job_id].steps < totals[job_id]:
            res[job_id].state, res[job_id].exit_reason = "exited", "underperforming"
    for p in plans:
        o = res[p.job_id]
        if o.state == "exited":
            continue
        a, mon, vals = full[p.job_id], monitors[p.job_id], dict(full[p.job_id].curve)
        for step in range(o.steps + 1, p.total_steps + 1):
            if _replay_step(p, a, mon, vals, o, step):
                break
        else:
            o.state = "completed"
    return res
