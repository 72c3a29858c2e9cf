"""Loss-aware early exit: per-job divergence and overfitting detectors, and the warmup ranking.
Pure Python (math only): the executor feeds losses in and acts on the ExitDecision it gets back.
Its settings are the task's own `contract.protocol.EarlyExitSettings` (one set of bounds).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from contract.protocol import EarlyExitSettings
from contract.states import ExitReason

_EPS = 1e-9
# the staged warmup ranking (WarmupRanking.clearly_out): a job whose loss on the lead samples is
# above this fraction of it over as many jobs' as can be kept is evicted on that evidence
LEAD_MARGIN = 0.05


@dataclass(frozen=True)
class ExitDecision:
    """Why a job should stop now, with the numbers behind it (goes into the exit event)."""

    reason: ExitReason
    details: dict[str, Any] = field(default_factory=dict)


def warmup_steps(total_steps: int, warmup_fraction: float = 0.05) -> int:
    """Warmup length of a job: ceil(warmup_fraction * total_steps), at least 1, at most total."""
    return EarlyExitSettings(warmup_fraction=warmup_fraction).warmup_steps(total_steps)


def keep_count(n: int, keep_fraction: float) -> int:
    """How many of `n` surviving jobs the warmup ranking keeps: ceil(keep_fraction * n)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not (0.0 < keep_fraction <= 1.0):
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    return min(n, math.ceil(keep_fraction * n - _EPS))


def warmup_ranking(
    val_losses: Mapping[str, float], keep_fraction: float, n_keep: int | None = None
) -> tuple[list[str], list[str]]:
    """Split jobs into (keep_ids, evict_ids) by validation loss at the end of warmup.

    Keeps the ceil(keep_fraction * n) lowest losses (or `n_keep`); NaN/inf rank last; equal
    losses keep the mapping's order (stable), so the result is deterministic for a given input order.
    """
    n_keep = keep_count(len(val_losses), keep_fraction) if n_keep is None else n_keep
    def key(item: tuple[int, tuple[str, float]]) -> tuple[bool, float, int]:
        position, (_, loss) = item
        finite = _finite(loss)
        return (not finite, float(loss) if finite else 0.0, position)

    ranked = [job_id for _, (job_id, _) in sorted(enumerate(val_losses.items()), key=key)]
    return ranked[:n_keep], ranked[n_keep:]


def regression_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Ordinary least-squares slope of ys against xs (needs two distinct xs)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("need two or more (x, y) pairs of equal length")
    mx = math.fsum(xs) / len(xs)
    my = math.fsum(ys) / len(ys)
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    if sxx == 0.0:
        raise ValueError("xs are all equal: slope undefined")
    return math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def relative_slope(steps: Sequence[int], values: Sequence[float]) -> float:
    """Slope per step relative to the loss scale (see the module docstring)."""
    per_step = regression_slope([float(s) for s in steps], values)
    scale = abs(math.fsum(values) / len(values))
    return per_step / max(scale, _EPS)


class JobMonitor:
    """Watches one job's losses and says when it should exit (diverging or overfitting).

    Call `observe_train` after every optimizer step and `observe_eval` after every evaluation;
    the latter returns an ExitDecision once a detector has held for `patience` evaluations.
    With `cfg.enabled` False it still tracks the EMA and the best checkpoint but never exits.

    Choices behind the numbers (docs/architecture.md, "Loss-aware early exit"):

    - **Train signal.** `ema_train` is an exponential moving average of the per-step train loss with
      `ema_alpha = 0.1` (a ~10-step memory) and Adam-style bias correction, so it is an unbiased
      average from the first step on. 0.9 smooths mini-batch noise while following a real rise
      within a few tens of steps, which is the time scale between evaluations.
    - **Slope normalisation.** Slopes are least-squares slopes over the last `window` evaluation
      points, fitted against the optimizer step and divided by the mean of the window's values:
      a *relative rise per step*. `tau_slope = 0.001` means "rising by at least 0.1% of its value per
      step", i.e. 5% per evaluation at `eval_every = 50`. Relative, because one threshold must mean
      the same for a loss of 0.3 and of 10 (vocabulary, objective). Per step rather than per
      evaluation point, because a rate of rise is what tells divergence (fast, compounding) from the
      noise of a plateau, whose step-to-step difference does not grow with the evaluation period:
      per evaluation point, 0.1% is below the evaluation noise of a fixed validation set, and a
      healthy plateau or a late-improving job would be exited by chance. Slow, steady rises are the
      warmup ranking's and the overfitting detector's business.
    - **Patience.** A detector fires after its condition holds at `patience` consecutive
      evaluations; one evaluation where it does not hold resets its counter, so a transient spike
      (one high point, then recovery) never exits a job. Before `min_steps` (a grace period, 0 by
      default) the counters run but no detector exits the job.
    - **Non-finite losses.** A NaN/inf train or validation loss is divergence at once: the job's
      weights are already garbage and no later evaluation can recover them.
    - **Best checkpoint.** `best_val`/`best_step`/`last_eval_was_best` tell the executor when to save
      the best-validation adapter; an overfitting exit hands that one back, not the last.
    """

    def __init__(self, cfg: EarlyExitSettings | None = None) -> None:
        self.cfg = cfg or EarlyExitSettings()
        self._ema_raw = 0.0
        self._ema_n = 0
        self.last_train_step: int | None = None
        self.best_val = math.inf
        self.best_step: int | None = None
        self.last_eval_was_best = False
        self.eval_steps: list[int] = []
        self.eval_val: list[float] = []
        self.eval_ema: list[float] = []
        self.diverge_count = 0
        self.overfit_count = 0
        self._nonfinite_train: tuple[int, float] | None = None
        # its first decision: what a job held for its warmup ranking exits with once kept
        self.decision: ExitDecision | None = None

    @property
    def ema_train(self) -> float:
        """Bias-corrected EMA of the train loss (NaN before the first step)."""
        if self._ema_n == 0:
            return math.nan
        beta = 1.0 - self.cfg.ema_alpha  # the EMA keeps beta of the past each step
        if beta == 0.0:
            return self._ema_raw
        return self._ema_raw / (1.0 - beta**self._ema_n)

    def observe_train(self, step: int, loss: float) -> ExitDecision | None:
        """Fold one step's train loss into the EMA; a non-finite loss is divergence at once."""
        self.last_train_step = step
        loss = float(loss)
        if not _finite(loss):
            if self._nonfinite_train is None:
                self._nonfinite_train = (step, loss)
            return self._decide(self._nonfinite_decision(step, "train_loss", loss))
        beta = 1.0 - self.cfg.ema_alpha
        self._ema_raw = beta * self._ema_raw + (1.0 - beta) * loss
        self._ema_n += 1
        return None

    def observe_eval(self, step: int, val_loss: float) -> ExitDecision | None:
        """Record one evaluation; returns an ExitDecision when the job should stop now."""
        val_loss = float(val_loss)
        if self.eval_steps and step <= self.eval_steps[-1]:
            raise ValueError(f"eval steps must increase: {step} after {self.eval_steps[-1]}")
        self.last_eval_was_best = _finite(val_loss) and val_loss < self.best_val
        if self.last_eval_was_best:
            self.best_val, self.best_step = val_loss, step
        if self._nonfinite_train is not None:
            s, v = self._nonfinite_train
            return self._decide(self._nonfinite_decision(s, "train_loss", v))
        if not _finite(val_loss):
            return self._decide(self._nonfinite_decision(step, "val_loss", val_loss))

        ema = self.ema_train
        self.eval_steps.append(step)
        self.eval_val.append(val_loss)
        self.eval_ema.append(ema)
        cfg = self.cfg

        w = cfg.window
        slope_val = slope_ema = math.nan
        if len(self.eval_steps) >= w and _finite(ema):
            steps = self.eval_steps[-w:]
            slope_val = relative_slope(steps, self.eval_val[-w:])
            slope_ema = relative_slope(steps, self.eval_ema[-w:])
            rising = slope_val >= cfg.tau_slope and slope_ema >= cfg.tau_slope
        else:
            rising = False
        self.diverge_count = self.diverge_count + 1 if rising else 0

        gap = (val_loss - ema) / ema if _finite(ema) and ema > 0 else math.nan
        self.overfit_count = self.overfit_count + 1 if gap > cfg.tau_gap else 0

        numbers = {
            "step": step,
            "val_loss": val_loss,
            "ema_train": ema,
            "slope_val": slope_val,
            "slope_ema_train": slope_ema,
            "gap_ratio": gap,
            "best_val": self.best_val,
            "best_step": self.best_step,
        }
        if step < cfg.min_steps:  # the grace period: the detectors count, nothing exits yet
            return None
        if self.diverge_count >= cfg.patience:
            return self._decide(ExitDecision(
                ExitReason.DIVERGING,
                {**numbers, "tau_slope": cfg.tau_slope, "window": w,
                 "consecutive_evals": self.diverge_count},
            ))
        if self.overfit_count >= cfg.patience:
            return self._decide(ExitDecision(
                ExitReason.OVERFITTING,
                {**numbers, "tau_gap": cfg.tau_gap, "consecutive_evals": self.overfit_count},
            ))
        return None

    def _nonfinite_decision(self, step: int, what: str, value: float) -> ExitDecision:
        return ExitDecision(ExitReason.DIVERGING, {
            "step": step, what: value, "non_finite": what,
            "best_val": self.best_val, "best_step": self.best_step,
        })

    def _decide(self, decision: ExitDecision) -> ExitDecision | None:
        if not self.cfg.enabled:
            return None
        if self.decision is None:
            self.decision = decision
        return decision


class WarmupRanking:
    """Collects each job's validation loss at the end of its warmup and ranks when all are in.

    Jobs may finish warmup at different times (queued configurations rotate in as others exit
    or finish warmup); the ranking is decided once every registered job has either reported its
    end-of-warmup loss or exited. Jobs that exited during warmup do not count as surviving.

    Staged (trainer.task_eval): a job's warmup-end evaluation starts on the leading part of the
    ranking's subset (`lead`). One that at least as many jobs as the ranking can keep beat there
    by LEAD_MARGIN (`clearly_out`) cannot be kept, whatever the rest of the subset says of it: it
    reports with `early=True` and is evicted at once; it still counts among the ranked jobs (the
    number kept is the same as without staging) and is never kept.
    """

    def __init__(self, job_ids: Iterable[str], keep_fraction: float = 0.25) -> None:
        self.keep_fraction = keep_fraction
        keep_count(0, keep_fraction)  # validates the ratio
        self._pending: dict[str, None] = dict.fromkeys(job_ids)
        self._losses: dict[str, float] = {}
        self._leads: dict[str, float] = {}  # each job's loss on the lead part of the subset
        self._early: set[str] = set()  # evicted on their lead loss
        self.exited: list[str] = []
        self.result: tuple[list[str], list[str]] | None = None

    def __setstate__(self, state: dict[str, Any]) -> None:  # a checkpoint from before staging
        self.__dict__.update({"_leads": {}, "_early": set(), **state})

    def add(self, job_id: str) -> None:
        """Register a configuration that has to go through warmup before the ranking."""
        if self.result is not None:
            raise RuntimeError("ranking already decided")
        if job_id in self._losses or job_id in self.exited:
            raise ValueError(f"job {job_id} already reported")
        self._pending[job_id] = None

    def lead(self, job_id: str, val_loss: float) -> None:
        """The job's validation loss on the lead part of the ranking's subset."""
        self._leads[self._known(job_id)] = float(val_loss)

    def clearly_out(self, job_id: str, margin: float = LEAD_MARGIN) -> dict[str, Any] | None:
        """Why the job cannot be kept, from the lead losses alone, or None: at least as many
        jobs as the ranking can keep (it counts the jobs still in warmup too) have a lead loss
        below this job's by `margin` of it. Losses compared on the same samples."""
        mine = self._leads.get(job_id)
        if mine is None or not _finite(mine):
            return None
        limit = keep_count(len(self._pending) + len(self._losses), self.keep_fraction)
        bar = mine - margin * abs(mine)
        beaten_by = sum(1 for j, v in self._leads.items() if j != job_id and _finite(v) and v < bar)
        if beaten_by < limit:
            return None
        return {"lead_val_loss": mine, "beaten_by": beaten_by, "keep_at_most": limit, "margin": margin}

    def report(self, job_id: str, val_loss: float, early: bool = False) -> None:
        """The job finished its warmup with this validation loss (`early`: on its lead samples,
        `clearly_out`, so it is evicted now)."""
        self._pending.pop(self._known(job_id))
        self._losses[job_id] = float(val_loss)
        if early:
            self._early.add(job_id)

    def exit(self, job_id: str) -> None:
        """The job exited (a detector fired) before finishing its warmup."""
        self._pending.pop(self._known(job_id))
        self._leads.pop(job_id, None)
        self.exited.append(job_id)

    def awaits(self, job_id: str) -> bool:
        """Whether the job reported its end-of-warmup loss and the ranking has not decided yet:
        its end (a detector's exit, its last step) waits for the decision (trainer.warmup_hold)."""
        return self.result is None and job_id in self._losses and job_id not in self._early

    @property
    def waiting(self) -> list[str]:
        """Jobs still in (or queued for) warmup."""
        return list(self._pending)

    @property
    def ranked_count(self) -> int:
        """How many jobs the decision ranks: the reported (those evicted on their lead too) and the waiting."""
        return len(self._losses) + len(self._pending)

    def lead_loss(self, job_id: str) -> float:
        """The job's loss on the lead part of the subset (inf where it has none: not staged, or not yet)."""
        v = self._leads.get(job_id)
        return v if v is not None and _finite(v) else math.inf

    @property
    def ready(self) -> bool:
        return not self._pending

    def decide(self) -> tuple[list[str], list[str]]:
        """(keep_ids, evict_ids) among jobs that finished warmup; call when `ready`. The early
        evicted are ranked (they count in how many are kept) but never kept."""
        if not self.ready:
            raise RuntimeError(f"{len(self._pending)} jobs have not finished warmup")
        if self.result is None:
            n_keep = keep_count(len(self._losses), self.keep_fraction)
            full = {j: v for j, v in self._losses.items() if j not in self._early}
            keep, evict = warmup_ranking(full, self.keep_fraction, n_keep)
            early = sorted(self._early, key=lambda j: (not _finite(self._losses[j]), self._losses[j]))
            self.result = keep, evict + early
        return self.result

    def eviction_decisions(self) -> dict[str, ExitDecision]:
        """An "underperforming" ExitDecision per evicted job, with the numbers behind it (its
        loss and rank, how many were ranked and kept, and the worst kept loss); after `decide`."""
        keep, evict = self.decide()
        ranked = keep + evict
        cutoff = self._losses[keep[-1]] if keep else math.nan
        return {
            job_id: ExitDecision(ExitReason.UNDERPERFORMING, {
                "val_loss": self._losses[job_id], "rank": ranked.index(job_id) + 1,
                "ranked": len(ranked), "kept": len(keep), "keep_fraction": self.keep_fraction,
                "worst_kept_val_loss": cutoff, "early": job_id in self._early,
            })
            for job_id in evict
        }

    def _known(self, job_id: str) -> str:
        if job_id not in self._pending:
            raise KeyError(f"job {job_id} is not waiting for warmup ranking")
        return job_id


def _finite(x: float) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False
