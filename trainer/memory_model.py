"""The memory model without a profiling pass: M(B) = k0 + k1 * B * L built from the model's config
and the step's shapes (docs/architecture.md, technique 3), then corrected online from the
allocator's peaks of the real steps and stored for the node's later tasks.

Analytic terms (bytes, bf16 activations a = 2):
- what is resident (the backbone, the attached and device-parked jobs' states): read from the
  allocator when admission decides (one GPU: the live form); each job admitted adds its state
  (adapter, float32 gradient, two AdamW moments); with several ranks (which must decide alike)
  the static form's k0 holds the resident bytes at planning and one job of the largest rank.
- k0 (live form): the step's fixed transient: the head's float32 logits of one chunk (forward,
  softmax, gradient), AdamW's grouped temporary, a workspace.
- k1, per token of a step: without recompute every layer keeps what its backward reads (the two
  norms' inputs and outputs, q/k/v, the attention's output, gate/up/their product, each LoRA
  target's x.A); with recompute a layer keeps only its input, and one layer's activations live
  again during its backward; plus the hidden states' gradients and the per-token losses.
- per step whatever its tokens: the head's logits of min(tokens, chunk) tokens, AdamW's grouped
  temporary and STEP_FIXED; where the adapters are not in the compute dtype, the step's copy of
  the whole arena in it (counted by the plan with what is resident, and in each new job's state).
  The head's float32 logits, softmax and gradient (HEAD_BYTES a logit), or, where the head's
  cross-entropy runs fused (trainer.head: its bf16 logits, their gradient written over them),
  FUSED_HEAD_BYTES.
- the attention's key and value as each layer keeps them: at their own heads' width where the
  flash kernel takes grouped-query heads as they are (trainer.varlen), else expanded to the
  query's heads (`kv_expanded`, every other attention path: transformers' own repeat them).
`ACTIVATION_SLACK`, `HEAD_BYTES` and `STEP_FIXED` cover what the count above leaves out (the
norms' float32 upcasts, RoPE's temporaries, the allocator's rounding; FUSED_ACTIVATION_SLACK where
the norms and the gate run fused, trainer.fused_blocks); their values come from the
peaks of an 8B-shaped task's steps on an H100 (bench/executor_task.py's memory trace, kept in
tests/unit/data/memory_peaks_h100.json, which tests/unit/test_memory_model.py checks).

Online correction (`OnlineCorrection`): after each step the allocator saw (eager steps and
captures; a replay allocates nothing) its transient peak (peak - resident before the step) is
compared with the model's; a step it under-predicted raises the model at once (the slope for a
step as large as any before, else a constant held in k0), and once `settle` steps span a doubling
of tokens the line moves to the covering one of least over-prediction relative to their peaks
(+5%) where that is tighter than the line it replaces.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.admission import MemoryModel
from trainer.jobs import ADAMW_CHUNK

ACT_BYTES = 2  # bf16 activations
HEAD_BYTES = 16  # per logit of the head's chunk: bf16 logits, their float32 upcast, softmax, gradients
# the fused cross-entropy's: bf16 logits (their gradient written over them), workspaces. The variable
# is for measuring how this count steers admission (16 gives it the float32 path's count of before:
# session 38's warmup packed 36 jobs into recomputed steps with 8), not a setting
FUSED_HEAD_BYTES = int(os.environ.get("LORAPLEX_FUSED_HEAD_BYTES", "8"))
STEP_FIXED = 768 << 20  # what a step holds whatever its tokens beyond the head (H100, 8B: ~0.8 GB)
WORKSPACE = 512 << 20  # cuBLAS/Triton workspaces, the allocator's rounding of the big blocks
# fitted (sessions 19 and 26) while the expanded key/value were not counted: 1.5 and 1.15 then; since
# session 38 counted (`kv_expanded`), and the fused slack refitted from session 38's H100 peaks
ACTIVATION_SLACK = 1.41
# with the norms and the MLP's gate on fused kernels (trainer.fused_blocks) a layer keeps what the
# count below names and little else: no float32 copy of a norm's input, no silu(gate)
FUSED_ACTIVATION_SLACK = 1.06
ARENA_SLACK = 1.125  # the arena grows by an eighth at least: a job's state costs up to this more
MAX_POINTS = 512  # the steps the envelope is drawn over (the largest always among them)
# the least share of its starting slope a corrected model keeps: a step's peak read low (a buffer
# freed during it that was resident at its start, e.g. a pending export's copy) must never lower
# k1 to 0, which would make admission take any batch and a retry's widened slope stay 0
K1_FLOOR = 0.5
LASTING = 256 << 20  # a step that leaves more allocated than this (new jobs' states) is not corrected from


@dataclass(frozen=True)
class Shapes:
    """What the model's peak depends on, read from its config."""

    hidden: int
    intermediate: int
    layers: int
    kv: int  # key/value width (kv heads * head dim)
    vocab: int
    heads: int
    q: int = 0  # query width (heads * head dim); 0: the hidden size

    @classmethod
    def of(cls, config: Any) -> Shapes:
        text = getattr(config, "text_config", None) or config
        h = int(text.hidden_size)
        heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or h // heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        return cls(hidden=h, intermediate=int(text.intermediate_size), layers=int(text.num_hidden_layers),
                   kv=kv_heads * head_dim, vocab=int(text.vocab_size), heads=heads, q=heads * head_dim)


def layer_activation_bytes(s: Shapes, n_targets: int, rank: int, fused: bool = False, rebuild: bool = False,
                           kv_expanded: bool = True) -> float:
    """Per token: what one decoder layer keeps for its backward (no recompute); `fused`: its
    norms and gate on the fused kernels; `rebuild`: down's input rebuilt in the backward
    (trainer.fused_blocks.MLP_REBUILD), not kept; `kv_expanded`: the attention keeps key and
    value repeated to the query's heads."""
    h, i, kv = s.hidden, s.intermediate, s.kv
    elems = 4 * h          # norm inputs and outputs, both norms
    elems += h + 2 * kv    # q, k, v after RoPE
    elems += 2 * max(0, (s.q or h) - kv) if kv_expanded else 0  # key and value repeated per query head
    elems += h             # the attention's output (o_proj's input)
    elems += (2 if rebuild else 3) * i  # gate, up, act(gate) * up (down's input)
    elems += n_targets * rank  # each LoRA target's x.A
    slack = FUSED_ACTIVATION_SLACK if fused else ACTIVATION_SLACK
    return slack * ACT_BYTES * elems + 4 * (2 + s.heads)  # norms' rstd, attention's lse


def per_token_bytes(s: Shapes, recompute: bool, n_targets: int, rank: int, fused: bool = False,
                    rebuild: bool = False, kv_expanded: bool = True) -> float:
    """k1: bytes per token of a training step (`rebuild`: without recompute only)."""
    layer = layer_activation_bytes(s, n_targets, rank, fused, rebuild and not recompute, kv_expanded)
    if recompute:  # every layer's input kept, and one layer's activations live again
        body = s.layers * ACT_BYTES * s.hidden + layer
    else:
        body = s.layers * layer
    head = 2 * 4 * s.hidden + 3 * 4  # the last hidden state's float32 gradient, loss, target
    return body + head


def eval_token_bytes(config: Any, n_targets: int, max_rank: int) -> float:
    """Per token of an evaluation forward (no grad): one layer's activations live at once (counted
    as a training step keeps them, an upper bound), beside the residual stream, its normed copy
    and the last hidden state, and the per-token losses, hits and packed ints."""
    s = Shapes.of(config)
    return layer_activation_bytes(s, n_targets, _tile(max_rank)) + 3 * ACT_BYTES * s.hidden + 64


def eval_fixed_bytes(config: Any, head_chunk: int, fused_head: bool = False) -> float:
    """What an evaluation forward holds whatever its tokens: the head's chunk of logits (counted
    as a step's, gradient included) and a workspace."""
    return head_bytes(Shapes.of(config), head_chunk, fused_head) + WORKSPACE


def head_bytes(s: Shapes, tokens: int, fused_head: bool = False) -> float:
    """The head's logits of `tokens` tokens (one chunk at most): float32 forward, softmax and
    gradient, or the fused cross-entropy's bf16 logits (`fused_head`)."""
    return float(FUSED_HEAD_BYTES if fused_head else HEAD_BYTES) * tokens * s.vocab


def engine_terms(engine: Any) -> dict[str, bool]:  # noqa: ANN401
    """What the count depends on in how this engine runs: `fused_head`, the head's cross-entropy
    fused (trainer.head.ModelHead.plain_weight), and `kv_expanded`, false where the attention is
    the flash varlen kernel (trainer.varlen: grouped-query heads as they are)."""
    from trainer.varlen import flash_exact, gqa_unexpanded

    plain = getattr(engine.output_logits, "plain_weight", None)
    probe = torch.empty(0, dtype=engine.compute_dtype, device=engine.device)
    flash = (engine.attention == "varlen" and engine.device.type == "cuda" and gqa_unexpanded()
             and flash_exact(engine.model.config) and engine.compute_dtype in (torch.float16, torch.bfloat16))
    return {"fused_head": plain is not None and plain(probe) is not None, "kv_expanded": not flash}


def state_bytes_per_param(adapter_itemsize: int, copy_itemsize: float = 0.0) -> float:
    """A job's state per adapter parameter: the adapter and its two AdamW moments in the adapter
    dtype, its float32 gradient, and (`copy_itemsize`) a step's copy of it in the compute dtype;
    with the arena's growth."""
    return (3 * adapter_itemsize + 4 + copy_itemsize) * ARENA_SLACK


def adamw_temporary(adapter_params: int) -> float:
    """AdamW's grouped temporary (trainer.jobs.multi_adamw) over this many adapter parameters."""
    return 4.0 * min(adapter_params, ADAMW_CHUNK)


def fixed_transient(head_per_token: float, tokens: int, adapter_params: int, copy_per_param: float = 0.0) -> float:
    """What a step allocates beside its activations: the head's logits of `tokens` tokens (one
    chunk at most), AdamW's temporary, STEP_FIXED, and where the arena is not in the compute
    dtype its copy in it (`copy_per_param` bytes for each of the arena's `adapter_params`:
    AdapterArena.layout_arenas, every job's region, attached or not)."""
    return head_per_token * tokens + adamw_temporary(adapter_params) + STEP_FIXED + copy_per_param * adapter_params


def analytic_model(config: Any, *, head_chunk: int, max_rank: int, n_targets: int, recompute: bool,
                   sequences_per_item: int = 1, resident: float | None = None,
                   state_bytes_per_rank: float = 0.0, fused: bool = False, rebuild: bool = False,
                   fused_head: bool = False, kv_expanded: bool = True) -> MemoryModel:
    """M(B) = k0 + k1 * B * L for this model and step (see the module docstring); B counts batch
    items (a DPO item is a pair: its k1 counts both sequences). Live form (resident None): k0 is
    the step's fixed transient and a workspace; admission adds what is resident when it decides
    and each job's state. Static form: k0 also holds `resident` and one job of the largest rank."""
    s = Shapes.of(config)
    k0 = fixed_transient(head_bytes(s, 1, fused_head), head_chunk, ADAMW_CHUNK) + WORKSPACE
    if resident is not None:
        k0 += resident + state_bytes_per_rank * max_rank
    k1 = per_token_bytes(s, recompute, n_targets, _tile(max_rank), fused, rebuild, kv_expanded) * sequences_per_item
    return MemoryModel(k0=float(k0), k1=float(k1))


def _tile(rank: int) -> int:
    return max(16, 1 << max(0, rank - 1).bit_length())


@dataclass
class StepPeak:
    """One step as the allocator saw it."""

    tokens: int        # the step's token cells (padding included)
    recompute: bool
    resident: int      # allocated before the step
    peak: int          # the allocator's peak during it
    predicted: float   # resident + the model's transient for these tokens
    adapter_params: int = 0  # the adapter arena's elements then


@dataclass
class OnlineCorrection:
    """The model corrected from real steps (see the module docstring); `trace` keeps them all.
    A step's transient is predicted as its counted fixed part (`fixed`: the head's logits of
    min(tokens, head_chunk) tokens at `head_per_token`, the AdamW temporary, the arena's copy at
    `copy_per_param`) + `extra` + k1 x tokens, where `extra` (a constant the steps showed beyond
    the counted fixed part: a workspace, a kernel's scratch) is what the model's k0 holds above
    the k0 it started from.

    Each step's excess x (its transient less the counted fixed part) corrects the line e + k1 t:
    - under-predicted, a step at least as large as any before raises the slope (the safe guess
      for larger steps), a smaller one the constant (a small step's few-hundred-MB deficit
      charged per token made an 8B task's k1 1.7x too large: 15-27% over-predicted peaks and
      needless recompute);
    - once `settle` steps spanning at least a doubling of tokens were seen, the line moves to
      the one that covers them all (`envelope`: the least largest over-prediction relative to
      each step's peak), with `margin` on both terms, where that over-predicts them less than
      the line it replaces. Session 38's envelope went through the largest step: on an H200 a
      search's largest step came after its warmup ranking, lighter per token than the warmup's
      48-job steps, and the line through it had a 3.5 MB slope and an 18 GB constant: its
      later small steps over-predicted by 23-60%.
    The slope never falls under K1_FLOOR of `floor_of` (the model built from the config)."""

    model: MemoryModel
    head_per_token: float
    head_chunk: int
    settle: int = 8
    margin: float = 1.05
    copy_per_param: float = 0.0
    trace: list[StepPeak] = field(default_factory=list)
    _k0_start: float = field(init=False, default=0.0)
    _points: list[tuple[int, float, float]] = field(init=False, default_factory=list)  # (tokens, excess, peak)
    # the least slope: K1_FLOOR of `floor_of` (the model built from the config, which no stored
    # correction moves; else the starting slope), so it never halves task after task on a node
    floor_of: float | None = None
    _k1_floor: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self._k0_start = self.model.k0
        self._k1_floor = K1_FLOOR * (self.model.k1 if self.floor_of is None else self.floor_of)

    @property
    def extra(self) -> float:
        """The constant the steps added to the counted fixed part (bytes, >= 0)."""
        return max(0.0, self.model.k0 - self._k0_start)

    def fixed(self, tokens: int, adapter_params: int) -> float:
        return fixed_transient(self.head_per_token, min(tokens, self.head_chunk), adapter_params, self.copy_per_param)

    def predict_transient(self, tokens: int, adapter_params: int = 0) -> float:
        return self.fixed(tokens, adapter_params) + self.extra + self.model.k1 * tokens

    def observe(self, tokens: int, recompute: bool, resident: int, peak: int, adapter_params: int = 0,
                after: int = 0) -> bool:
        """Record a step the allocator saw (not a graph's replay: its memory was taken at its
        capture); `after`: what stayed allocated after it (a first step's lasting allocations,
        e.g. AdamW's moments or a library's workspace, are not its transient). True when the
        model changed (to be stored, admission updated)."""
        transient = self.predict_transient(tokens, adapter_params)
        lasting = after - resident > LASTING
        # the lasting allocations (new jobs' AdamW moments) come after the activations are freed
        predicted = max(resident + transient, after + adamw_temporary(adapter_params)) if lasting \
            else resident + transient
        self.trace.append(StepPeak(tokens, recompute, resident, peak, predicted, adapter_params))
        if tokens <= 0 or peak <= resident or lasting:
            return False  # nothing to learn from a step whose peak may be its lasting allocations
        excess = float(peak - resident - self.fixed(tokens, adapter_params))
        largest = max((t for t, _, _ in self._points), default=0)
        self._points.append((tokens, excess, float(peak)))
        if len(self._points) > MAX_POINTS:  # a long task: the largest step and the latest ones
            top = max(range(len(self._points)), key=lambda i: self._points[i])
            self._points = [self._points[top]] + [p for i, p in enumerate(self._points) if i != top][-(MAX_POINTS - 1):]
        e, k = self.extra, self.model.k1
        if excess > e + k * tokens:  # never under: raise at once
            if tokens >= largest:
                k = max(0.0, (excess * self.margin - e) / tokens)
            else:
                e = excess * self.margin - k * tokens
        elif len(self._points) >= self.settle:
            fit = envelope(self._points, self._k1_floor / self.margin)
            if fit is not None:
                fe, fk = fit[0] * self.margin, fit[1] * self.margin
                if over(self._points, fe, fk) < over(self._points, e, max(k, self._k1_floor)):
                    e, k = fe, fk
        k = max(k, self._k1_floor)
        if (e, k) == (self.extra, self.model.k1):
            return False
        self.model = MemoryModel(self._k0_start + max(0.0, e), k)
        return True


def over(points: list[tuple[int, float, float]], e: float, k: float) -> float:
    """The line e + k t's largest over-prediction of the points (tokens, excess, peak), relative
    to each one's peak (negative where it under-predicts one)."""
    return max((e + k * t - x) / w for t, x, w in points)


def envelope(points: list[tuple[int, float, float]], floor: float = 0.0) -> tuple[float, float] | None:
    """The line e + k t (e >= 0, k >= floor) above every point (tokens, excess, peak) whose
    largest over-prediction relative to a point's peak is least; None until the points span at
    least a doubling of tokens (a slope needs a span). For a slope k the least covering constant
    is e(k) = max(0, max x - k t), convex in k, so the relative over-prediction is convex in k
    too: a golden-section search over [floor, the slope through the origin covering them all]."""
    ts = [t for t, _, _ in points]
    if max(ts) < 2 * min(ts):
        return None

    def line(k: float) -> tuple[float, float]:
        return max(0.0, max(x - k * t for t, x, _ in points)), k

    def cost(k: float) -> float:
        return over(points, *line(k))

    lo, hi = floor, max(floor, max(x / t for t, x, _ in points))
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = cost(a), cost(b)
    for _ in range(48):  # each step keeps one of its two slopes: 0.618^48 of the range, ~1e-10
        if fa < fb:  # a tie moves right: of equally tight lines, the steeper (the safer for larger steps)
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = cost(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = cost(b)
    return line(a if fa < fb else b)
