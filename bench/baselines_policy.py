"""What the sequential baselines of bench/baselines.py train and when they evaluate: the grids of
configurations (bench/task_e2e.py's 32 or the full factorial 48) and loraplex's evaluation
policy for one job run alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from contract.protocol import EarlyExitSettings, EvalSettings
from trainer.jobs import TrainJob
from trainer.task_eval import eval_subset_size

SEED_STRIDE = 1000  # --seed s: job seeds index + 1000 s (s = 0: bench/task_e2e.py's jobs)


# ----------------------------------------------------------------------------- grids
def grid48(n_train: int, seed: int = 0) -> list[TrainJob]:
    """48 configurations, learning rate x batch size x rank, full factorial: lr 1e-4..1e-1 (the
    last one diverges), batch sizes 1/2/4/16, ranks 8/16/64 (alpha = 2 rank), one epoch."""
    del n_train  # one epoch of every job: its steps follow from the data
    jobs = []
    for lr in (1e-4, 1e-3, 1e-2, 1e-1):
        for bs in (1, 2, 4, 16):
            for rank in (8, 16, 64):
                jobs.append(TrainJob(f"lr{lr:g}_b{bs}_r{rank}", lora_rank=rank, lora_alpha=2.0 * rank, learning_rate=lr,
                                    batch_size=bs, epochs=1.0, seed=len(jobs) + SEED_STRIDE * seed))
    return jobs


def grid_for(n_configs: int, n_train: int, seed: int = 0) -> list[TrainJob]:
    """The 32-configuration grid of bench/task_e2e.py or the 48 one, job seeds offset by seed."""
    if n_configs == 48:
        return grid48(n_train, seed)
    if n_configs != 32:
        raise ValueError(f"--configs is 32 or 48, not {n_configs}")
    from task_e2e_data import grid

    return [replace(j, seed=j.seed + SEED_STRIDE * seed) for j in grid(n_train)]


# ----------------------------------------------------------------------------- evaluation policy
@dataclass(frozen=True)
class EvalPolicy:
    """When a job evaluates and on how many validation samples: trainer.colocate.TaskRun's
    cadence_due / eval_size / ranking_samples, for one job run alone. `ranking_samples` None: no
    warmup ranking (loraplex without early exit, c1, c2); else the rung (c3, loraplex (a))."""

    ev: EvalSettings
    ee: EarlyExitSettings
    full: int  # the evaluation set (eval_max_samples of the shuffled validation set)
    ranking_samples: int | None = None

    @classmethod
    def for_jobs(cls, ev: EvalSettings, ee: EarlyExitSettings, full: int, jobs: Sequence[TrainJob],
                 n_train: int, ranked: bool) -> EvalPolicy:
        samples = max(ee.warmup_steps(j.total_steps(n_train)) * j.batch_size for j in jobs)
        return cls(ev, ee, full, samples if ranked else None)

    def rung(self, total: int) -> int | None:
        return self.ee.warmup_steps(total) if self.ranking_samples is not None else None

    def due(self, step: int, total: int, bs: int) -> bool:
        every = self.ev.eval_every_samples
        cadence = ((step * bs) // every > ((step - 1) * bs) // every if every
                   else step % self.ev.eval_every_steps == 0)
        return cadence or step == total or step == self.rung(total)

    def size(self, step: int, last: int, total: int, bs: int) -> int:
        ratio = self.ev.eval_samples_per_trained
        if ratio is None or self.full == 0:
            return self.full
        if step >= total:
            trained = step * bs
        elif step == self.rung(total):
            trained = self.ranking_samples
        else:
            trained = (step - last) * bs
        return eval_subset_size(ratio * trained, self.ev.eval_min_samples, self.full)

    def evals(self, total: int, bs: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
        """(step, size) of every evaluation of a job whose steps lo+1..hi run now (the last
        evaluation before lo at its latest cadence point, as a resumed job has it)."""
        out, last = [], max([s for s in range(1, lo + 1) if self.due(s, total, bs)] or [0])
        for step in range(lo + 1, (total if hi is None else hi) + 1):
            if self.due(step, total, bs):
                out.append((step, self.size(step, last, total, bs)))
                last = step
        return out

