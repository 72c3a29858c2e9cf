"""What one task on an executor is given: its `ExecutorConfig` (the task's settings as the
contract declares them, its files and jobs, and the executor's own knobs) and the `Callbacks`
through which everything reaches the outside world."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from contract.protocol import EvalSettings, TaskSettings
from trainer.jobs import TrainJob


def _noop(*_: Any) -> None:
    return None


@dataclass
class Callbacks:
    """What the executor reports; every callable gets the job id first."""

    on_train_loss: Callable[[str, int, float], None] = _noop  # job, step, loss
    on_eval: Callable[[str, int, float], None] = _noop  # job, step, val loss
    on_job_state: Callable[[str, str, dict], None] = _noop  # job, state, details
    on_adapter: Callable[[str, str, Path], None] = _noop  # job, "best" | "final", directory
    on_event: Callable[[str, str, dict], None] = _noop  # job ("" = task), message, fields
    # job, step, "train" | "val", extra numbers of that point beside the loss (SFT val: mean
    # token_accuracy; DPO: reward accuracy and margin); called just BEFORE the on_train_loss /
    # on_eval of the same point
    on_metrics: Callable[[str, int, str, dict], None] = _noop
    # no job id: the fields of contract.protocol.ThroughputReport but the placement (measured
    # tokens/s over the steps since the last report, the batch mix, the memory model)
    on_throughput: Callable[[dict], None] = _noop
    # no job id: the task left the executor, its last call: the outcome (contract.states.
    # TaskOutcome) and {"error": "Type: message" or None, "global_step": its steps}; made even
    # when the task's own callbacks failed (what a co-located task's runner waits for)
    on_task_end: Callable[[str, dict], None] = _noop
    # job, step, its exact sequence tokens of that step (trainer.data.sequence_tokens), its
    # share of the executor's GPU-seconds (StepNumbers.gpu_seconds); called just BEFORE the
    # on_train_loss of the same point: the job's usage
    on_usage: Callable[[str, int, int, float], None] = _noop


CALLBACK_KINDS = tuple(f.name for f in fields(Callbacks))


def executor_defaults() -> TaskSettings:
    """The settings of an ExecutorConfig built without any (a bench or a test): 512 tokens, an
    evaluation every 10 steps over the whole validation set."""
    return TaskSettings(max_seq_len=512, eval=EvalSettings(eval_every_steps=10, eval_max_samples=None))


@dataclass
class ExecutorConfig:
    """One task on one executor: base model, data, jobs and the policies around them."""

    model_dir: str
    train_file: str
    output_dir: str
    jobs: list[TrainJob]
    val_file: str | None = None
    # the task's settings exactly as the placement carries them (validation split and seed,
    # max_seq_len, evaluation, early exit, target modules), read where they are used; a new
    # task setting is a field of contract.protocol.TaskSettings and the code that reads it
    settings: TaskSettings = field(default_factory=executor_defaults)
    # the fewest validation examples of one evaluation forward; a forward holds as many
    # sequences as a training step may (the admitted budget), so evaluation runs at full width
    eval_batch_size: int = 8
    # checkpoints: every checkpoint_every executor steps (None: no step count) or checkpoint_every_s
    # seconds since the last one (None: no clock), first reached; the node's default is by time
    # alone (worker.runner: a step count says nothing of the seconds of work a crash loses)
    checkpoint_every: int | None = None
    checkpoint_every_s: float | None = 300.0
    # activation recompute: True always, False never, "auto" where a step needs it (one CUDA GPU
    # with measured memory models: a step whose batch fits without recompute runs without it;
    # elsewhere always, as True)
    gradient_checkpointing: bool | str = "auto"
    device: str = "auto"
    backend: str = "auto"
    adapter_dtype: str = "float32"
    max_active_jobs: int | None = None
    max_tokens_per_step: int | None = None  # admission budget without a memory model (CPU)
    memory_model: tuple[float, float] | None = None  # (k0, k1) from a profiling run
    memory_budget_bytes: float | None = None
    # JSON file of measured memory models, keyed by model, max_seq_len, GPU kind, torch version
    # and the other inputs of a profile: a node measures once and every later executor reuses it
    profile_cache: str | None = None
    # SDPA's cuDNN backend (torch's default). It plans anew for every new (rows, length) shape:
    # ~10 ms of host time per attention call on variable-length packed steps; without it the
    # masked (packed) attention runs on the memory-efficient kernel, slower on wide steps. On
    # H100 the whole task was faster with it (bench/results/task_e2e_h100.md), so it stays on.
    cudnn_attention: bool = True
    # the engine's packing and attention (MultiLoraEngine.set_attention): "rows" (each job's
    # sequences in its own padded rows, block mask), "varlen" (sequences back to back in one row,
    # attention by sequence bounds: no padding; SFT only) or "auto": varlen where torch's flash
    # varlen kernel runs (CUDA, SFT, one GPU), else rows. On H100 varlen took a 32-configuration
    # task from 105.5 s to 42.5 s (bench/results/task_e2e_h100.md)
    attention: str = "auto"
    # the training step's forward and backward replayed as CUDA graphs per shape where the step
    # allows it (trainer.step_graphs: SFT, varlen, one GPU); False: every step launched eagerly
    cuda_graphs: bool = True
    stop_after_steps: int | None = None  # stop (as if killed) after this many executor steps
    # one GPU: checkpoints and exports are snapshots written by a writer thread while training
    # goes on (trainer.colocate: announced once complete); False: written in the step loop.
    # write_buffer_bytes bounds the snapshots waiting (the loop waits beyond it; one always may)
    async_writes: bool = True
    write_buffer_bytes: float = 4 * 2**30
    method: str = "sft"  # a method of contract.methods (trainer.objectives holds its objective)
    world_size: int = 1  # GPUs of the placement; > 1: adapter parallelism (FSDP2 backbone)

    def __post_init__(self) -> None:
        if self.settings.max_seq_len is None:
            raise ValueError("settings.max_seq_len: an executor needs the task's resolved length")

    @property
    def max_seq_len(self) -> int:
        return self.settings.max_seq_len  # type: ignore[return-value]  # set: __post_init__

    @property
    def targets(self) -> tuple[str, ...] | None:
        """The task's target modules; None: the model family's defaults."""
        names = self.settings.target_modules
        return tuple(names) if names else None


# what a task must share with the executor it joins: the backbone, the engine and the step
HOST_FIELDS = ("model_dir", "method", "max_seq_len", "targets", "gradient_checkpointing", "device",
               "backend", "adapter_dtype", "world_size", "cudnn_attention", "attention")
