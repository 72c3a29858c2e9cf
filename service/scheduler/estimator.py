"""Duration and GPU-count estimates for the planner: d_i = tokens to train / throughput, g_i from
memory. Throughput comes from profiles when present, else from FLOPs per token and the GPU's rate.

Profiles are what executors measured (service.profiles stores their reports): real tokens/s of a
whole placement, keyed (base_model, gpu_type, seq_len, batch_key) and the GPU count it ran on. A
task's jobs still to train give its batch key; without that exact mix the nearest mix of the same
model, GPU type and length is used (closest samples per step, then job count). A measurement on
the task's GPU count is taken as it is; one on another count is converted per GPU with the same
``multi_gpu_scaling`` rule as the analytic rate.

Analytic throughput (LoRA on a frozen bf16 backbone with gradient checkpointing per layer):
forward 2P + input-gradient backward 2P (no weight gradients for the frozen backbone) + the
recomputed forward 2P = 6P FLOPs per token, plus attention 8*L*h*s_avg (causal QK^T and AV are
2*s*h per layer and token forward, done 4 times: forward, recompute, 2x backward). The LoRA
matmuls (rank r << h) are left out. tokens/s = rate * efficiency / flops_per_token per GPU;
adapter parallelism scales over g GPUs with ``multi_gpu_scaling`` per extra GPU.
Memory per GPU with g GPUs (FSDP2 shards the backbone): 2P/g bf16 weights + per-layer
checkpoints L*h*2 bytes per token + one layer's recompute (~34*h bytes per token) + fp32
logits for one micro-batch + workspace; g is the smallest power of two that fits in
``usable_fraction`` of the GPU's memory.
Estimate error fed back: each published placement records its raw estimate and a finished one
its measured run (claim to finish); a model's next estimates from profiles or FLOPs are
multiplied by correction_factor of its latest runs (median ratio, shrunk toward 1 while few runs
are known, within 1/4..4x). Early exit and mixes the profiles miss are what it mostly learns.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from contract.states import JOB_TERMINAL, JobState

GIB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    memory_bytes: int
    matrix_flops: float  # dense bf16 FLOP/s (override with the node's measured rate)


# Dense bf16 tensor-core peaks from the vendors' datasheets; a node that reports a measured
# matmul rate (meta "matmul_tflops") overrides this.
GPU_SPECS: dict[str, GpuSpec] = {
    "H100": GpuSpec(80 * GIB, 989e12),
    "H200": GpuSpec(141 * GIB, 989e12),
    "A100-80GB": GpuSpec(80 * GIB, 312e12),
    "A100": GpuSpec(40 * GIB, 312e12),
    "L40S": GpuSpec(48 * GIB, 362e12),
    "A10G": GpuSpec(24 * GIB, 125e12),
    "cpu": GpuSpec(16 * GIB, 1e12),
}


def gpu_spec(gpu_type: str, memory_bytes: int | None = None,
             measured_flops: float | None = None) -> GpuSpec:
    """The spec of a GPU type, matched by prefix (``H100-80GB`` -> H100), with overrides."""
    key = next((k for k in sorted(GPU_SPECS, key=len, reverse=True)
                if gpu_type.upper().startswith(k.upper())), None)
    base = GPU_SPECS[key] if key else GpuSpec(memory_bytes or 16 * GIB, 100e12)
    return GpuSpec(memory_bytes or base.memory_bytes, measured_flops or base.matrix_flops)


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    layers: int
    hidden: int
    vocab: int = 128_256

    @classmethod
    def from_config(cls, parameters: int | None, config: Mapping) -> ModelShape:
        hidden = int(config.get("hidden_size", 4096))
        layers = int(config.get("num_hidden_layers", 32))
        vocab = int(config.get("vocab_size", 128_256))
        inter = int(config.get("intermediate_size", 4 * hidden))
        heads = int(config.get("num_attention_heads", 32))
        kv_dim = int(config.get("num_key_value_heads", heads)) * (hidden // max(1, heads))
        attention = 2 * hidden * hidden + 2 * hidden * kv_dim  # q, o and the (GQA) k, v
        tied = bool(config.get("tie_word_embeddings", False))
        params = parameters or (layers * (attention + 3 * hidden * inter)
                                + (1 if tied else 2) * vocab * hidden)
        return cls(params, layers, hidden, vocab)

    @classmethod
    def guess(cls, parameters: int) -> ModelShape:
        """Shape of a typical dense decoder of this size: P ~ 12*L*h^2 with h ~ 128*L."""
        layers = max(1, round((parameters / (12 * 128**2)) ** (1 / 3)))
        hidden = max(64, int(round(math.sqrt(parameters / (12 * layers)) / 128)) * 128)
        return cls(parameters, layers, hidden)


@dataclass(frozen=True)
class EstimatorConfig:
    efficiency: float = 0.4  # model FLOPs utilisation of the analytic estimate
    multi_gpu_scaling: float = 0.9  # throughput per extra GPU of a placement (relative)
    usable_fraction: float = 0.9
    workspace_bytes: int = 2 * GIB
    bytes_per_token: float = 4.0  # JSONL bytes per token when guessing sample lengths
    max_gpus: int = 8


def flops_per_token(shape: ModelShape, avg_seq_len: float) -> float:
    return 6.0 * shape.parameters + 8.0 * shape.layers * shape.hidden * avg_seq_len


def memory_per_gpu(shape: ModelShape, gpus: int, micro_batch_tokens: int, seq_len: int,
                   cfg: EstimatorConfig) -> float:
    weights = 2.0 * shape.parameters / gpus
    checkpoints = shape.layers * shape.hidden * 2.0 * micro_batch_tokens
    recompute = 34.0 * shape.hidden * micro_batch_tokens
    logits = 4.0 * shape.vocab * micro_batch_tokens * 2  # fp32 logits and their gradient
    return weights + checkpoints + recompute + logits + cfg.workspace_bytes


def gpus_needed(shape: ModelShape, gpu: GpuSpec, micro_batch_tokens: int, seq_len: int,
                cfg: EstimatorConfig = EstimatorConfig(), minimum: int = 1) -> int:
    """Smallest power of two >= minimum whose per-GPU memory fits; cfg.max_gpus * 2 if none."""
    g = 1
    while g < minimum:
        g *= 2
    while g <= cfg.max_gpus:
        if memory_per_gpu(shape, g, micro_batch_tokens, seq_len, cfg) <= \
                cfg.usable_fraction * gpu.memory_bytes:
            return g
        g *= 2
    return cfg.max_gpus * 2  # fits nowhere: the planner reports it as unschedulable


def batch_key(batch_sizes: Sequence[int]) -> str:
    """Key of a batch composition in throughput_profiles: sorted 'size x count' pairs."""
    counts: dict[int, int] = {}
    for b in batch_sizes:
        counts[b] = counts.get(b, 0) + 1
    return ",".join(f"{b}x{n}" for b, n in sorted(counts.items()))


def batch_sizes_of(key: str) -> list[int]:
    """The batch sizes a batch_key stands for (inverse of batch_key); [] for a malformed key."""
    sizes: list[int] = []
    for pair in filter(None, key.split(",")):
        size, _, count = pair.partition("x")
        if not (size.isdigit() and count.isdigit()):
            return []
        sizes += [int(size)] * int(count)
    return sizes


def batch_distance(a: Sequence[int], b: Sequence[int]) -> tuple[float, float]:
    """How far two batch mixes are apart, for the nearest-profile fallback: log-ratio of their
    samples per step (what fills a GPU), then of their job counts."""
    def ratio(x: float, y: float) -> float:
        return abs(math.log(max(x, 1) / max(y, 1)))

    return ratio(sum(a), sum(b)), ratio(len(a), len(b))


@dataclass(frozen=True)
class Profile:
    """One measurement of throughput_profiles: real tokens/s of a whole placement of ``gpus``."""

    tokens_per_s: float
    gpus: int = 1


ProfileKey = tuple[str, str, int, str]  # (base_model, gpu_type, seq_len, batch_key)
ProfileValue = float | Profile | Sequence[Profile]  # a bare float: one GPU's tokens/s


def _measurements(value: ProfileValue) -> Sequence[Profile]:
    if isinstance(value, Profile):
        return (value,)
    if isinstance(value, int | float):
        return (Profile(float(value), 1),)
    return value



@dataclass(frozen=True)
class JobProgress:
    """One job of a task: its batch size, steps done, state ('pending', 'running', terminal)."""

    batch_size: int
    last_step: int = 0
    state: str = JobState.PENDING.value


@dataclass(frozen=True)
class TaskWork:
    """What a task has to train: samples per epoch, epochs, tokens per sample, its jobs."""

    base_model: str
    samples: int
    epochs: int
    avg_tokens_per_sample: float
    max_seq_len: int
    jobs: Sequence[JobProgress]
    early_exit: bool = True
    warmup_fraction: float = 0.05
    keep_fraction: float = 0.25

    def steps(self, job: JobProgress) -> int:
        return max(1, math.ceil(self.samples * self.epochs / max(1, job.batch_size)))


def remaining_tokens(work: TaskWork) -> float:
    """Expected tokens still to train. Terminal jobs (completed or exited early) count zero;
    before warmup ends a job is expected to survive the warmup ranking with keep_fraction."""
    total = 0.0
    for job in work.jobs:
        if job.state in JOB_TERMINAL:
            continue
        steps = work.steps(job)
        done = min(job.last_step, steps)
        per_step = job.batch_size * work.avg_tokens_per_sample
        if work.early_exit:
            warm = math.ceil(work.warmup_fraction * steps)
            if done < warm:
                rest = (warm - done) + work.keep_fraction * (steps - warm)
            else:
                rest = steps - done
        else:
            rest = steps - done
        total += rest * per_step
    return total


CORRECTION_BOUNDS = (0.25, 4.0)
CORRECTION_PRIOR = 3  # pseudo-samples of "no error" that a few measurements are shrunk toward
CORRECTION_SAMPLES = 50  # the latest finished placements of a model that count


def correction_factor(samples: Sequence[tuple[float, float]]) -> float:
    """Estimate error fed back: from (raw estimate s, measured run s) pairs of a model's finished
    placements, the factor its next raw estimates are multiplied by. The median log-ratio (robust
    to one odd run), shrunk toward 1 by n / (n + CORRECTION_PRIOR) so one run moves it little,
    and held within CORRECTION_BOUNDS; 1.0 without usable samples."""
    logs = sorted(math.log(run / est) for est, run in samples if est > 0 and run > 0)
    n = len(logs)
    if n == 0:
        return 1.0
    mid = logs[n // 2] if n % 2 else (logs[n // 2 - 1] + logs[n // 2]) / 2
    low, high = CORRECTION_BOUNDS
    return min(high, max(low, math.exp(mid * n / (n + CORRECTION_PRIOR))))


class Estimate(NamedTuple):
    """One task's estimate on one GPU type: GPUs, seconds (corrected by the model's measured
    error), and the raw seconds before that correction."""

    gpus: int
    seconds: int
    raw_seconds: int


@dataclass
class Estimator:
    """d_i and g_i per GPU type. ``profiles`` maps (base_model, gpu_type, seq_len, batch_key)
    to its measurements (Profile: tokens/s of a whole placement and its GPU count; a bare float
    is one GPU's tokens/s); ``shapes`` maps base_model to its ModelShape; ``corrections`` maps
    base_model to its correction_factor, applied to estimates from profiles or FLOPs (not to a
    running task's own measured rate: that already is the measurement)."""

    shapes: Mapping[str, ModelShape]
    profiles: Mapping[ProfileKey, ProfileValue] = field(default_factory=dict)
    cfg: EstimatorConfig = EstimatorConfig()
    corrections: Mapping[str, float] = field(default_factory=dict)

    def _scale(self, gpus: int) -> float:
        """Throughput of `gpus` GPUs relative to one (adapter parallelism)."""
        return 1 + self.cfg.multi_gpu_scaling * (gpus - 1)

    def profile_rate(self, work: TaskWork, gpu_type: str, gpus: int) -> float | None:
        """Tokens/s of the task on `gpus` GPUs of this type from the profiles; None if no profile
        of its model, GPU type and length exists. See the module docstring for the choice."""
        same = {k[3]: v for k, v in self.profiles.items()
                if k[:3] == (work.base_model, gpu_type, work.max_seq_len)}
        if not same:
            return None
        live = [j.batch_size for j in work.jobs if j.state not in JOB_TERMINAL]
        sizes = live or [j.batch_size for j in work.jobs]
        mix = batch_key(sizes)
        if mix not in same:  # another batch composition of the same model, GPU and length
            mix = min(same, key=lambda k: (batch_distance(batch_sizes_of(k), sizes), k))
        best = min(_measurements(same[mix]),
                   key=lambda p: (abs(math.log(max(1, p.gpus) / gpus)), -p.gpus))
        if best.gpus == gpus:
            return best.tokens_per_s
        return best.tokens_per_s / self._scale(max(1, best.gpus)) * self._scale(gpus)

    def analytic_tokens_per_s_per_gpu(self, work: TaskWork, gpu: GpuSpec) -> float:
        shape = self.shapes[work.base_model]
        avg = min(work.avg_tokens_per_sample, work.max_seq_len)
        return gpu.matrix_flops * self.cfg.efficiency / flops_per_token(shape, avg)

    def tokens_per_s(self, work: TaskWork, gpu_type: str, gpu: GpuSpec, gpus: int) -> float:
        """Tokens/s of the task on a placement of `gpus` GPUs: measured profile, else analytic."""
        measured = self.profile_rate(work, gpu_type, gpus)
        if measured is not None:
            return measured
        return self.analytic_tokens_per_s_per_gpu(work, gpu) * self._scale(gpus)

    def gpus(self, work: TaskWork, gpu: GpuSpec, minimum: int = 1) -> int:
        micro = max((j.batch_size for j in work.jobs), default=1) * work.max_seq_len
        return gpus_needed(self.shapes[work.base_model], gpu, micro, work.max_seq_len,
                           self.cfg, minimum)

    def estimate(self, work: TaskWork, gpu_type: str, gpu: GpuSpec, minimum_gpus: int = 1,
                 measured_tokens_per_s: float | None = None) -> tuple[int, int]:
        """(gpus, seconds) for the task on this GPU type: ``estimate_with_raw`` without the raw
        seconds."""
        e = self.estimate_with_raw(work, gpu_type, gpu, minimum_gpus, measured_tokens_per_s)
        return e.gpus, e.seconds

    def estimate_with_raw(self, work: TaskWork, gpu_type: str, gpu: GpuSpec,
                          minimum_gpus: int = 1, measured_tokens_per_s: float | None = None
                          ) -> Estimate:
        """The task's GPUs and seconds on this GPU type, corrected and raw, from one rate. A
        running task passes its measured tokens/s (whole placement), which replaces the profile
        or analytic rate and is taken as it is (raw = corrected). Otherwise the model's
        correction factor gives ``seconds``; ``raw_seconds`` is the estimate without it, what
        placements record so that the error can be measured against the estimator's own number."""
        g = self.gpus(work, gpu, minimum_gpus)
        factor = 1.0
        if measured_tokens_per_s and measured_tokens_per_s > 0:
            rate = measured_tokens_per_s
        else:
            rate = self.tokens_per_s(work, gpu_type, gpu, g)
            factor = self.corrections.get(work.base_model, 1.0)
        seconds = remaining_tokens(work) / rate
        return Estimate(g, max(1, math.ceil(seconds * factor)), max(1, math.ceil(seconds)))
