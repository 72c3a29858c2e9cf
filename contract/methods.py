"""The training methods, declared once: per method the files it trains on, its own search-space
knobs (bounds, defaults), its dry-run cost, its name in the OpenAI API and the trainer objective
that trains it (registered under the same name in trainer.objectives). Every layer reads this
table; a new method is an entry here and its objective (docs/architecture.md, "Where to add")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from contract.base import Field


@dataclass(frozen=True)
class Knob:
    """A method's own hyperparameter: one float per job, a list of them in the search space (the
    grid multiplies it for the method's tasks alone). Bounds as pydantic's (None: unbounded)."""

    name: str
    default: float
    description: str
    gt: float | None = None
    ge: float | None = None
    le: float | None = None

    def value_type(self) -> Any:
        """One value's type, with its bounds (a 422 naming the field at create)."""
        bounds = {k: v for k, v in (("gt", self.gt), ("ge", self.ge), ("le", self.le)) if v is not None}
        return Annotated[float, Field(allow_inf_nan=False, **bounds)]


@dataclass(frozen=True)
class MethodSpec:
    """One training method across the stack.

    formats: the training-file formats it trains on (service.files' format names);
    knobs: its own search-space knobs, beyond the knobs every method searches (GRID_KNOBS);
    cost_factor: the dry run's and usage's tokens per record relative to the record's own
    estimate (1.0: one record's tokens, trained once per step);
    openai: its `method.type` in OpenAI's fine-tuning API (None: not offered there);
    summary: one line for the CLI, the dashboard and the docs.
    """

    name: str
    formats: tuple[str, ...]
    summary: str
    knobs: tuple[Knob, ...] = ()
    cost_factor: float = 1.0
    openai: str | None = None

    def knob_names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.knobs)


BETA = Knob("beta", 0.1, "DPO only: strength of the pull to the base model, each in (0, 10].",
            gt=0, le=10)
ORPO_LAMBDA = Knob("orpo_lambda", 0.1, "ORPO only: weight of the odds-ratio term beside the chosen "
                   "answers' NLL (the paper's lambda), each in (0, 10].", gt=0, le=10)

SFT = MethodSpec("sft", ("chat", "completion", "text"), "supervised fine-tuning on completions",
                 openai="supervised")
# The reference log-probs are one no-grad forward per pair for all jobs and epochs: the
# record's tokens stay the estimate (cost_factor 1).
DPO = MethodSpec("dpo", ("preference",), "direct preference optimisation against the frozen "
                 "base model (Rafailov et al. 2023)", knobs=(BETA,), openai="dpo")

ORPO = MethodSpec("orpo", ("preference",), "odds-ratio preference optimisation, no reference "
                  "model (Hong et al. 2024)", knobs=(ORPO_LAMBDA,))

METHODS: dict[str, MethodSpec] = {m.name: m for m in (SFT, DPO, ORPO)}
DEFAULT_METHOD = SFT.name
Method = Literal[tuple(METHODS)]  # type: ignore[valid-type]  # "sft", "dpo", ...
GRID_KNOBS = ("learning_rate", "lora_rank", "lora_alpha", "batch_size")
# every method's own knob, in the order of METHODS (the search space and the job carry them all)
METHOD_KNOBS: dict[str, Knob] = {k.name: k for m in METHODS.values() for k in m.knobs}


def method_spec(name: str) -> MethodSpec:
    """The method of this name; ValueError names the choices."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; expected one of {sorted(METHODS)}") from None


def grid_knobs(method: str) -> tuple[str, ...]:
    """The hyperparameters a task's search space multiplies into jobs, for its method."""
    return (*GRID_KNOBS, *method_spec(method).knob_names())


def openai_methods() -> dict[str, MethodSpec]:
    """The methods OpenAI's fine-tuning API offers, by their OpenAI name."""
    return {m.openai: m for m in METHODS.values() if m.openai is not None}
