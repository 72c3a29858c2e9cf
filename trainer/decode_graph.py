"""Greedy decoding with a static KV cache, each token step replayed as one CUDA graph (issue 44:
the end-of-task samples must add at most 10 s; eagerly, a token step of 32 rows at 32 layers of
the 8B shape took ~70 ms, almost all of it launches the host issues one by one).

The prompts are prefilled eagerly into the model's own StaticCache (transformers' cache of
preallocated keys and values, written at its device-side length: no host value changes from one
step to the next). A token step is then a fixed sequence of kernels on fixed tensors:
  the step's column of the attention mask opened (a boolean [rows, 1, 1, cache length] mask, the
  prompts' padding closed), the backbone's forward of each row's last token at its position, the
  head's argmax, the token written to the next input and to the rows' output, positions + 1.
The first step runs eagerly (it warms the kernels up), the second is captured, the rest replay
it; every 16 steps the host reads the tokens once to stop when every row has met an EOS. A
capture that fails (a family whose forward reads the device) leaves the same step running eagerly.

Used where the result is the eager loop's (trainer.sampling): greedy, the model's SDPA attention,
no sliding-window layer (a static mask would not close the window), on CUDA; the CPU runs the
same static path eagerly in tests.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import torch
from transformers import StaticCache

from trainer.graph_parts import capturing
from trainer.memory_plan import allocator_counts

log = logging.getLogger("loraplex.sampling")
CHECK_EVERY = 16  # token steps between the host's reads of the tokens (the EOS check)
POOL_NEED = 1 << 30  # a token step's graph pool, bytes, at most (a few rows' activations and logits)


@contextlib.contextmanager
def part(parts: dict[str, float] | None, name: str, device: torch.device) -> Iterator[None]:
    """Add the seconds of the block to parts[name] (None: not timed), the device's queued work
    included (a sync at the end: the decode reads its tokens back anyway); on a GPU also the
    caching allocator's retries (a full device: cached blocks freed, a sync each) and cudaMalloc
    calls in it, as name_retries and name_mallocs where there were any."""
    if parts is None:
        yield
        return
    before = allocator_counts(device)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0
        for counter, n_after in allocator_counts(device).items():
            if n_after > before[counter]:
                what = {"alloc_retries": "retries", "device_mallocs": "mallocs"}[counter]
                parts[f"{name}_{what}"] = parts.get(f"{name}_{what}", 0) + n_after - before[counter]


def static_decodable(model: torch.nn.Module, temperature: float) -> bool:
    """Whether the static path gives what the eager loop gives for this model and decoding."""
    cfg = model.config
    layer_types = getattr(cfg, "layer_types", None) or []
    return (temperature == 0 and getattr(cfg, "_attn_implementation", None) == "sdpa"
            and not getattr(cfg, "sliding_window", None) and all(t == "full_attention" for t in layer_types)
            and not getattr(cfg, "is_encoder_decoder", False))


class StaticDecoder:
    """One batch's greedy decode over a static cache: `run()` -> each row's new tokens (an EOS
    included where one ended it, at most max_new_tokens)."""

    def __init__(self, backbone: torch.nn.Module, config: object, logits: Callable[[torch.Tensor], torch.Tensor],
                 cache_arg: str, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 max_new_tokens: int, eos: frozenset[int], graphs: bool,
                 parts: dict[str, float] | None = None) -> None:
        self.backbone, self.logits, self.cache_arg = backbone, logits, cache_arg
        self.parts = parts  # seconds by part (prefill, eager step, capture, replays), when timed
        self.ids, self.mask2d, self.positions = ids, mask, positions
        self.new, self.eos, self.graphs = max_new_tokens, eos, graphs
        rows, length = ids.shape
        self.total = length + max_new_tokens
        self.cache = StaticCache(config=config, max_cache_len=self.total)
        device = ids.device
        # the decode's fixed tensors: every step reads and advances them in place
        self.allowed = torch.zeros(rows, 1, 1, self.total, dtype=torch.bool, device=device)
        self.allowed[:, 0, 0, :length] = mask.bool()
        self.token = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.position = positions[:, -1:].clone()
        self.column = torch.full((1,), length, dtype=torch.long, device=device)
        self.produced = torch.zeros(rows, max_new_tokens, dtype=torch.long, device=device)
        self.count = torch.ones(1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _prefill(self) -> None:
        if self.parts is not None:  # the prefill's rows x their padded length
            self.parts["prefill_tokens"] = self.parts.get("prefill_tokens", 0) + self.ids.numel()
        padded = torch.cat([self.mask2d, self.mask2d.new_zeros(self.mask2d.shape[0], self.new)], dim=1)
        out = self.backbone(input_ids=self.ids, attention_mask=padded, position_ids=self.positions,
                            use_cache=True, **{self.cache_arg: self.cache})
        first = self.logits(out.last_hidden_state[:, -1]).argmax(-1)
        self.token.copy_(first[:, None])
        self.produced[:, 0] = first

    def _step(self) -> None:
        self.position.add_(1)
        self.allowed.index_fill_(3, self.column, True)
        out = self.backbone(input_ids=self.token, attention_mask=self.allowed, position_ids=self.position,
                            use_cache=True, **{self.cache_arg: self.cache})
        nxt = self.logits(out.last_hidden_state[:, -1]).argmax(-1)
        self.token.copy_(nxt[:, None])
        self.produced.index_copy_(1, self.count, nxt[:, None])
        self.column.add_(1)
        self.count.add_(1)

    def _capture(self) -> None:
        """The next step as a CUDA graph (captured, not run); on failure the step stays eager."""
        try:
            graph = torch.cuda.CUDAGraph()
            # this thread's calls alone are checked: the task's writer thread may wait on a
            # snapshot's event meanwhile (the samples no longer wait for it), which the default
            # mode (global) turns into an error there (an H100's 60-step task lost its export);
            # the cached blocks stay where the device has room for the step's pool
            with capturing(graph, None, "thread_local", POOL_NEED):
                self._step()
            self.graph = graph
        except Exception as exc:  # noqa: BLE001 - a forward that cannot be captured decodes eagerly
            log.info("decode step not captured (%s): eager steps", type(exc).__name__)
            self.graph = None
            self.graphs = False

    def _done(self, steps: int) -> bool:
        seen = self.produced[:, :steps].tolist()
        return all(any(t in self.eos for t in row) for row in seen)

    def _steps(self, device: torch.device) -> int:
        """The token steps after the prefill's; how many tokens each row has."""
        steps = 1
        while steps < self.new:
            if steps % CHECK_EVERY == 0 and self.eos and self._done(steps):
                break
            if self.graph is not None:
                self.graph.replay()
            else:
                if self.graphs and steps == 2:  # step 1 ran eagerly: the kernels are warm
                    with part(self.parts, "capture", device):
                        self._capture()
                    if self.graph is not None:
                        continue  # captured, not run: replayed as this step
                with part(self.parts, "eager_steps", device):
                    self._step()
            steps += 1
        return steps

    def run(self) -> list[list[int]]:
        device = self.ids.device
        with part(self.parts, "prefill", device):
            self._prefill()
        with part(self.parts, "steps", device):  # every token step (the eager and captured ones too)
            steps = self._steps(device)
        if self.parts is not None:
            self.parts["token_steps"] = self.parts.get("token_steps", 0) + steps
        result = []
        for row in self.produced[:, :steps].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))
            result.append(row[:end])
        self.graph = None
        return result
