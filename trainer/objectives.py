"""The objectives by method name: each method of contract.methods has its component here (what a
batch item is, its loss as the engine calls it, the per-task numbers a checkpoint keeps). The
recipe (trainer.executor) asks the objective and never which one it is; a new method is its
module (an Sft or PairObjective subclass) and its line in OBJECTIVES."""

from __future__ import annotations

from contract.methods import METHODS
from trainer.dpo import Dpo
from trainer.orpo import Orpo
from trainer.sft import Sft

OBJECTIVES: dict[str, type[Sft]] = {c.name: c for c in (Sft, Dpo, Orpo)}
assert OBJECTIVES.keys() == METHODS.keys(), "every method of contract.methods has its objective"


def objective_for(method: str) -> Sft:
    """A fresh objective of a task's method (one per engine: it may cache per-sample numbers);
    ValueError names the choices."""
    try:
        return OBJECTIVES[method]()
    except KeyError:
        raise ValueError(f"unknown method {method!r}; expected one of {sorted(OBJECTIVES)}") from None
