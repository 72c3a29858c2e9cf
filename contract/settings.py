"""The task's settings: ONE set of bounds, checked at create (422) and consumed by the trainer as
they are (trainer.early_exit and trainer.executor read these classes, no second config); the
job's hyperparameters and the search-space knobs. Re-exported by contract.protocol."""

from __future__ import annotations

import math
from typing import Annotated

from contract.base import ConfigDict, Field, Message, model_validator
from contract.methods import GRID_KNOBS, METHOD_KNOBS, Method, grid_knobs  # noqa: F401 - re-exported

INT32_MAX = 2**31 - 1

Finite = Annotated[float, Field(allow_inf_nan=False)]
LearningRate = Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)]
LoraRank = Annotated[int, Field(ge=1, le=1024)]
LoraAlpha = Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]
BatchSize = Annotated[int, Field(ge=1, le=4096)]
DpoBeta = METHOD_KNOBS["beta"].value_type()


class EarlyExitSettings(Message):
    """Loss-aware early exit knobs; defaults from docs/architecture.md (ALTO). Frozen: the trainer shares
    one instance between every job's monitor."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    window: int = Field(default=2, ge=2, le=1000,
                        description="w: points in the slope window (a slope needs two).")
    patience: int = Field(default=2, ge=1, le=1000, description="p: consecutive evals to trigger.")
    tau_gap: float = Field(default=0.1, ge=0, le=1000, allow_inf_nan=False,
                           description="Overfitting threshold on (val - ema_train) / ema_train.")
    tau_slope: float = Field(default=0.001, ge=0, le=1000, allow_inf_nan=False,
                             description="Divergence threshold on both loss slopes.")
    warmup_fraction: float = Field(default=0.05, ge=0, lt=1, allow_inf_nan=False,
                                   description="Share of a job's steps before the ranking.")
    keep_fraction: float = Field(default=0.25, gt=0, le=1, allow_inf_nan=False,
                                 description="Share of the configurations the ranking keeps.")
    ema_alpha: float = Field(default=0.1, gt=0, le=1, allow_inf_nan=False,
                             description="EMA factor of the train loss (1 = no smoothing).")
    min_steps: int = Field(
        default=0, ge=0, le=10_000_000,
        description="Grace period: no job is stopped as diverging or overfitting before it has "
                    "trained this many steps (the detectors watch, the decision waits; a "
                    "non-finite loss still stops it at once). Ray Tune's ASHA grace_period.")
    train_while_waiting: bool = Field(
        default=False,
        description="A job that ends its warmup before the others: true, it trains on while the "
                    "ranking waits for them; false, it waits parked, so the steps serve the jobs "
                    "still warming up (a kept job resumes after the ranking, an evicted one ends "
                    "where the ranking measured it). Waiting jobs park whenever a queued "
                    "configuration needs the room.")

    def warmup_steps(self, total_steps: int) -> int:
        """Warmup length of a job with `total_steps` steps: ceil(fraction * total), in [1, total]."""
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        # the epsilon keeps float products like 0.05 * 100 = 5.000000000000001 from rounding up
        return min(total_steps, max(1, math.ceil(self.warmup_fraction * total_steps - 1e-9)))


SAMPLE_CADENCE = 1024  # the default: evaluate every 1024 samples a job trained on
STEP_CADENCE = 50  # the step cadence when a request nulls the sample one without naming steps


class EvalSettings(Message):
    """When each job evaluates, and on how many validation samples. By default every 1024
    samples it trained on; each evaluation uses validation samples in proportion to the samples
    the job trained on since its last one (`eval_samples_per_trained`, 0.25: 256 per 1024; one
    costs about 0.3 of a training sample, so evaluation stays near 8% of a job's time), never
    fewer than `eval_min_samples` nor more than the evaluation set (`eval_max_samples`). Every
    evaluation takes a leading subset of one fixed order, so jobs compare on the same samples;
    the warmup ranking evaluates every job on the same subset, and a job's last evaluation is
    sized by all it trained on. One cadence is in use and shown: eval_every_samples, or
    eval_every_steps when a request names it alone (the other is null)."""

    eval_every_steps: int | None = Field(
        default=None, ge=1, le=1_000_000,
        description="Evaluate a job every this many of its steps instead of by samples: the "
                    "cadence when eval_every_samples is null or left out while this is given; "
                    "null while eval_every_samples is in use (which wins when both are given). "
                    f"{STEP_CADENCE} when both are null.")
    eval_max_samples: int | None = Field(
        default=256, ge=1, le=1_000_000,
        description="The evaluation set: the first N of the held-out set (in a fixed "
                    "shuffled order, the same for every job); null: all of them. No evaluation "
                    "uses more.")
    eval_samples_per_trained: float | None = Field(
        default=0.25, gt=0, le=1000, allow_inf_nan=False,
        description="Validation samples an evaluation uses per sample the job trained on since "
                    "its last evaluation (its last one: per sample trained in all), between "
                    "eval_min_samples and the evaluation set; null: the whole evaluation set "
                    "every time.")
    eval_min_samples: int = Field(
        default=64, ge=1, le=1_000_000,
        description="The fewest validation samples of any evaluation (or the whole evaluation "
                    "set when smaller).")
    eval_every_samples: int | None = Field(
        default=SAMPLE_CADENCE, ge=1, le=1_000_000_000,
        description="Evaluate a job each time it has trained on this many more samples "
                    "(steps x its batch size), so jobs of every batch size evaluate equally "
                    "often per sample; null: every eval_every_steps of the job's steps "
                    "(also when eval_every_steps is given without this field).")

    @model_validator(mode="before")
    @classmethod
    def _one_cadence(cls, data: object) -> object:
        # Exactly one cadence is set, the one the trainer uses (trainer.colocate's cadence_due):
        # eval_every_steps named alone means that step cadence (as before the sample default);
        # otherwise samples, and eval_every_steps shows null. Stored documents that hold both
        # (tasks created before issue 43) read back the same way.
        if not isinstance(data, dict):
            return data
        steps = data.get("eval_every_steps")
        if steps is not None and "eval_every_samples" not in data:
            return {**data, "eval_every_samples": None}
        samples = data.get("eval_every_samples", SAMPLE_CADENCE)
        if samples is not None:
            return {**data, "eval_every_steps": None, "eval_every_samples": samples}
        return {**data, "eval_every_steps": STEP_CADENCE if steps is None else steps}


PROMPT_CHARS = 8000  # a sample prompt's bound (given inline, asked on demand, reported)
MAX_PROMPTS = 32
Prompt = Annotated[str, Field(min_length=1, max_length=PROMPT_CHARS)]


class Decoding(Message):
    """How completions are decoded: the end-of-task samples (SampleSettings) and samples asked on
    demand (contract.sample_requests) alike."""

    max_new_tokens: int = Field(default=128, ge=1, le=1024)
    temperature: float = Field(default=0.0, ge=0, le=2, allow_inf_nan=False,
                               description="0: greedy; above, sampled with top_p and seed.")
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0, le=INT32_MAX,
                      description="Sampling with the same seed repeats exactly.")


class SampleSettings(Decoding):
    """The completions a task ends with (trainer.sampling): a few held-out prompts answered by the
    leading adapters and by the base model, side by side, from the search's own backbone."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    top_k: int = Field(default=3, ge=0, le=8,
                       description="Adapters: the k jobs of the best validation loss (0: the base model alone).")
    prompts: list[Prompt] | None = Field(
        default=None, max_length=MAX_PROMPTS,
        description="The prompts, given inline (the chat template is applied when the training "
                    "data was chat); null: the first n_prompts prompts of the validation set.")
    n_prompts: int = Field(default=8, ge=1, le=MAX_PROMPTS,
                           description="Validation prompts used when none are given inline.")


class TaskSettings(Message):
    """How a task trains, declared once: the API's create schema extends it, the database keeps
    it as one document (tasks.settings), the placement carries it and the executor holds it. A
    new setting is a field here and the code that reads it."""

    validation_split: float = Field(
        default=0.1, gt=0, lt=0.5, allow_inf_nan=False,
        description="Held-out share when no validation_file.")
    epochs: int = Field(default=1, ge=1, le=100)
    max_seq_len: int | None = Field(default=None, ge=16, le=1_048_576,
                                    description="Defaults to min(2048, the model's limit).")
    seed: int = Field(default=0, ge=0, le=INT32_MAX)
    early_exit: EarlyExitSettings = Field(default_factory=EarlyExitSettings)
    eval: EvalSettings = Field(default_factory=EvalSettings)
    samples: SampleSettings = Field(default_factory=SampleSettings)
    target_modules: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = Field(
        default=None, max_length=32,
        description="Linear layers to adapt (e.g. q_proj, v_proj; qkv_proj on Phi-3); each must "
                    "exist in the base model's family. Null: all of the family's linears.")


class _SharedHyperparameters(Message):
    learning_rate: LearningRate
    lora_rank: LoraRank
    lora_alpha: LoraAlpha
    batch_size: BatchSize


# One configuration of the search space: the knobs every method searches, then every method's
# own knob (contract.methods: set for its method's jobs, None for the others).
JobHyperparameters = type("JobHyperparameters", (_SharedHyperparameters,), {
    "__module__": __name__,
    "__doc__": "One configuration of the search space: every knob a job of any method carries.",
    "__annotations__": {k.name: k.value_type() | None for k in METHOD_KNOBS.values()},
    **{k.name: Field(default=None, description=k.description) for k in METHOD_KNOBS.values()},
})


