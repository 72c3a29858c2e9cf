"""Completions of many adapters at once from the engine's own backbone (issue 44's samples): one
batch, each row decoded with its own job's adapter (or the base model alone) through the
multi-LoRA layers in their decoding form (each group of rows its adapter's A and B as plain
matmuls, two batched ones for all groups where they hold the same number of rows: few launches
for a decode step's few tokens), with the model's KV cache, its own output
head and greedy or nucleus sampling.

Rows are grouped by job so that every job's rows are contiguous; the base model's rows form one
group that adds nothing.
Prompts are left-padded for one prefill (attention mask, position ids counted from each row's first
real token), then one token per row per step until every row has met an EOS or max_new_tokens.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from trainer.decode_attention import register_decode_attention
from trainer.decode_graph import StaticDecoder, part, static_decodable
from trainer.jobs import JobRun

if TYPE_CHECKING:
    from trainer.engine import MultiLoraEngine

Picker = Callable[[torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def repeatable(device: torch.device, algorithms: bool = True) -> Iterator[None]:
    """On CUDA, with cuBLAS's workspaces fixed (CUBLAS_WORKSPACE_CONFIG, set before the process's
    first cuBLAS call: worker.processes.spawn sets it for every process of a node): SDPA on the
    math backend and, with `algorithms`, torch's deterministic algorithms (warn-only: an op
    without a deterministic kernel still runs, and its warning is not the user's), restored after.
    SDPA is what did not repeat: with a mask (left-padded rows), torch picks its memory-efficient
    kernel, and on an H200 its output for the token steps (one query over the cache) differed
    between two identical bf16 decodes at 32 layers while every input was equal
    (bench/decode_probe.py, session 23); on the math backend the decode repeats, greedy and seeded,
    eager and graphed. The token steps now run on trainer.decode_attention's GEMMs; the prefill
    and other models' steps still reach SDPA. LORAPLEX_DECODE_SDPA names other backends (a comma
    list of math, efficient, flash, cudnn; `auto`: torch's own choice).
    The static greedy decode goes without the deterministic algorithms (`generate`): its ops write
    each cache position once and sum nothing across threads in a varying order, and under them
    torch routes the cache's `index_copy_` through a sorted index_put that copies each layer's
    whole cache out and back, and fills every new tensor with NaN (~7 GB and ~1,000 kernels a token
    step at 32 layers of the 8B shape). The GPU test of a node's decode checks that it repeats.
    Elsewhere nothing changes: the CPU's kernels repeat as they are.
    LORAPLEX_REPEATABLE_DECODE=0: all of it off."""
    if (device.type != "cuda" or not os.environ.get("CUBLAS_WORKSPACE_CONFIG")
            or os.environ.get("LORAPLEX_REPEATABLE_DECODE", "1") == "0"):
        yield
        return
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if algorithms:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(), _attention_backends():
            warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


_SDPA = {"math": "MATH", "efficient": "EFFICIENT_ATTENTION", "flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}


def _attention_backends() -> contextlib.AbstractContextManager:
    """The attention backends a repeatable decode may use: LORAPLEX_DECODE_SDPA, a comma list of
    math, efficient, flash, cudnn (default: math, the one that repeats); `auto`: torch's own choice."""
    names = [n.strip() for n in os.environ.get("LORAPLEX_DECODE_SDPA", "math").split(",") if n.strip()]
    if names == ["auto"]:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    unknown = [n for n in names if n not in _SDPA]
    if unknown or not names:
        raise ValueError(f"LORAPLEX_DECODE_SDPA: unknown attention backends {unknown or names}; "
                         f"known: {sorted(_SDPA)} or auto")
    return sdpa_kernel([getattr(SDPBackend, _SDPA[n]) for n in names])


def nucleus_pick(logits: torch.Tensor, temperature: float, top_p: float,
                 generator: torch.Generator | None) -> torch.Tensor:
    """Each row's next token [B] from its logits [B, V]: the argmax when temperature == 0, else a
    draw from softmax(logits / temperature) kept to its top-p nucleus (the most likely tokens whose
    mass first reaches top_p; the most likely one always stays)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        ordered, index = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # the mass of the likelier tokens
        ordered = ordered.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, index, ordered)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _groups(job_ids: Sequence[str | None]) -> tuple[list[str | None], list[int], list[int]]:
    """The row groups in slot order (the base model's first, then jobs as they first appear), the
    rows of each group, and the permutation that sorts the rows into those groups (stable)."""
    keys = sorted(dict.fromkeys(job_ids), key=lambda k: k is not None)
    slot = {k: i for i, k in enumerate(keys)}
    order = sorted(range(len(job_ids)), key=lambda r: slot[job_ids[r]])
    counts = [sum(1 for j in job_ids if j == k) for k in keys]
    return keys, counts, order


def _point(engine: MultiLoraEngine, states: list[JobRun | None], counts: list[int]) -> None:
    """Point every multi-LoRA layer at the groups' adapters as plain matmuls over their batch
    rows (row group i: rows offsets[i]:offsets[i+1]; the base model's group adds nothing): a
    decode step's few tokens then cost a few small launches per layer, not the training kernels'
    (at 32 layers of 8B the Triton path made a token step ~0.28 s of host time)."""
    if not any(s is not None for s in states):
        return  # the base model alone: every layer is its plain linear
    bounds = [0, *itertools.accumulate(counts)]
    dtype = engine.compute_dtype
    index = {layer.name: k for k, layer in enumerate(engine.layer_list)}
    per_layer: list[list[tuple[int, int, torch.Tensor, torch.Tensor] | None]] = [
        [None] * len(states) for _ in engine.layer_list]
    for g, state in enumerate(states):
        if state is None:
            continue
        adapter = state.adapter
        for name, a, b in adapter.pairs():
            per_layer[index[name]][g] = (bounds[g], bounds[g + 1], a.detach().t().to(dtype).contiguous(),
                                         (b.detach() * adapter.scaling).t().to(dtype).contiguous())
    if len(set(counts)) == 1 and len(states) > 1:  # groups of equal rows: stacked, ranks padded
        r_max = max(s.adapter.rank for s in states if s is not None)
        for layer, groups in zip(engine.layer_list, per_layer, strict=True):
            a_t = torch.zeros(len(states), layer.in_features, r_max, dtype=dtype, device=engine.device)
            b_t = torch.zeros(len(states), r_max, layer.out_features, dtype=dtype, device=engine.device)
            for g, group in enumerate(groups):
                if group is not None:
                    a_t[g, :, : group[2].shape[1]] = group[2]
                    b_t[g, : group[3].shape[0]] = group[3]
            layer.dense = (a_t, b_t)
        return
    for layer, groups in zip(engine.layer_list, per_layer, strict=True):
        layer.dense = groups


def _unpoint(engine: MultiLoraEngine) -> None:
    for layer in engine.layer_list:
        layer.dense = None


def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention mask and position ids [B, L] of the prompts, padded on the left."""
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, length - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[r, length - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def _cache_arg(backbone: torch.nn.Module) -> str:
    """The name under which the backbone's forward takes its KV cache."""
    params = inspect.signature(backbone.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _decode(engine: MultiLoraEngine, prompts: Sequence[Sequence[int]],
            states: list[JobRun | None], counts: list[int], *, max_new_tokens: int, pick: Picker, eos: frozenset[int],
            pad_id: int, static: bool = False, parts: dict[str, float] | None = None) -> list[list[int]]:
    """The decode loop over rows already grouped by job: a prefill of the padded prompts, then one
    token per row per step with the model's KV cache; each row's new tokens."""
    with part(parts, "point", engine.device):
        ids, mask, positions = _left_padded(prompts, pad_id, engine.device)
        backbone = engine.model.base_model
        _point(engine, states, counts)
    if static:  # greedy on CUDA: a static cache, each token step one CUDA graph (trainer.decode_graph)
        return StaticDecoder(backbone, engine.model.config, engine.output_logits, _cache_arg(backbone), ids, mask,
                             positions, max_new_tokens, eos, graphs=engine.device.type == "cuda", parts=parts).run()
    with part(parts, "steps", engine.device):  # the eager loop: its prefill and token steps
        return _eager_loop(backbone, engine, prompts, ids, mask, positions, max_new_tokens, pick, eos)


def _eager_loop(backbone: torch.nn.Module, engine: MultiLoraEngine, prompts: Sequence[Sequence[int]],
                ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, max_new_tokens: int, pick: Picker,
                eos: frozenset[int]) -> list[list[int]]:
    # the model's own KV cache (sliding-window layers included), filled in place by each forward;
    # transformers 5 renames the forward's `past_key_values` to `cache`
    cache = {_cache_arg(backbone): DynamicCache(config=engine.model.config)}
    out = backbone(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache)
    position = positions[:, -1:] + 1
    new: list[list[int]] = [[] for _ in prompts]
    running = set(range(len(prompts)))
    while True:
        tokens = pick(engine.output_logits(out.last_hidden_state[:, -1]))
        for r, t in enumerate(tokens.tolist()):
            if r in running:
                new[r].append(t)
                if t in eos or len(new[r]) >= max_new_tokens:
                    running.discard(r)
        if not running:
            return new
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
        out = backbone(input_ids=tokens[:, None], attention_mask=mask, position_ids=position,
                       use_cache=True, **cache)
        position = position + 1


def _check(engine: MultiLoraEngine, prompts: Sequence[Sequence[int]],
           job_ids: Sequence[str | None], temperature: float, top_p: float) -> None:
    if len(prompts) != len(job_ids):
        raise ValueError(f"{len(prompts)} prompts but {len(job_ids)} job ids")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    unknown = sorted({j for j in job_ids if j is not None and j not in engine.jobs})
    if unknown:
        raise ValueError(f"jobs {unknown} are not attached to the engine")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def generate(
    engine: MultiLoraEngine,
    prompts: list[list[int]],
    job_ids: list[str | None],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | list[int] | None = None,
    pad_id: int,
    static: bool | None = None,
    parts: dict[str, float] | None = None,
) -> list[list[int]]:
    """Row r's continuation of prompts[r] by the adapter of attached job job_ids[r] (None: the base
    model alone), all rows in one batch: its new tokens, the EOS included where one ended it, at
    most max_new_tokens. Greedy when temperature == 0, else softmax(logits / temperature) with
    top-p filtering drawn from a generator seeded with `seed` on the engine's device (the same
    inputs and seed give the same tokens). static (default: on CUDA, unless
    LORAPLEX_STATIC_DECODE=0): greedy decoding over a static KV cache with graphed token steps
    (trainer.decode_graph) where it gives the eager loop's result. `parts`, when given, gains the
    seconds of the decode's parts (point, prefill, steps, capture, eager_steps; the device synced at
    each part's end) and its token steps. A model on SDPA attention decodes
    on trainer.decode_attention's (the token steps on two GEMMs over the cache's own key/value
    heads, no repeat_kv and no float32 copy of the cache; LORAPLEX_DECODE_GQA=0: off).
    The engine is left as found,
    even on an error: no layout on its layers, its attention mode and every module's training
    flag as they were."""
    _check(engine, prompts, job_ids, temperature, top_p)
    if static is None:  # by default on CUDA, where the host's launches bound an eager token step
        static = engine.device.type == "cuda" and os.environ.get("LORAPLEX_STATIC_DECODE", "1") != "0"
    if max_new_tokens <= 0 or not prompts:
        return [[] for _ in prompts]
    keys, counts, order = _groups(job_ids)
    states = [None if k is None else engine.jobs[k] for k in keys]
    eos = frozenset([] if eos_token_id is None else
                    [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=engine.device).manual_seed(seed)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        return nucleus_pick(logits, temperature, top_p, generator)

    engine.slots.settle()  # a step capture on a thread reads the modules' mode, attention and layouts
    model, attention = engine.model, engine.attention
    modes = [(m, m.training) for m in model.modules()]
    regrouped = False
    try:
        model.eval()  # also what turns the gradient checkpointing off for these forwards
        engine.set_attention("rows")  # the model's own attention, which the KV cache serves
        static = static and static_decodable(model, temperature)
        if model.config._attn_implementation == "sdpa" and os.environ.get("LORAPLEX_DECODE_GQA", "1") != "0":
            # SDPA's, with the token steps over the cache's own key/value heads (no repeat_kv copy)
            model.set_attn_implementation(register_decode_attention())
            regrouped = True
        with torch.no_grad(), repeatable(engine.device, algorithms=not static):
            grouped = _decode(engine, [prompts[r] for r in order], states, counts,
                              max_new_tokens=max_new_tokens, pick=pick, eos=eos, pad_id=pad_id, static=static,
                              parts=parts)
    finally:
        if regrouped:
            model.set_attn_implementation("sdpa")
        _unpoint(engine)
        engine.slots.clear_layout()
        engine.set_attention(attention)
        for module, training in modes:
            module.training = training
    result: list[list[int]] = [[] for _ in prompts]
    for tokens, r in zip(grouped, order, strict=True):
        result[r] = tokens
    return result
