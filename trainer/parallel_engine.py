"""Adapter parallelism, the engine half: the frozen backbone sharded with FSDP2 layer by layer, and
the multi-LoRA engine of one rank's jobs on it, with idle passes that keep every rank in lockstep.

Sharding (`shard_backbone`): every decoder layer is its own FSDP2 unit (all-gathered before its
forward, resharded after it, all-gathered again in backward); the base model (embeddings + final
norm) is the root unit, which is what `MultiLoraEngine._hidden` calls, so the root hooks run. The
LM head is left out and kept whole on every rank: the engine calls it once per job and again in
each job's recomputed backward, and as its own FSDP unit it would be all-gathered 2 x jobs times a
step (Qwen2.5-32B: a 1.56 GB head, ~4.4 ms per all-gather on 2 H200s scaled from the 2.78 ms
measured per 0.98 GB layer, ~70 ms per 8-job step, against 0.78 GB more memory per rank kept
whole). A tied head shares the embedding, which is then kept whole too. Adapters live outside the
model (JobAdapter), so FSDP never sees them; base weights are frozen, so no gradient exists for
FSDP to reduce-scatter: the only collectives of a step are the parameter all-gathers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from trainer.data import Example
from trainer.engine import MultiLoraEngine, StepReport

try:  # torch >= 2.6 public path; 2.11 and 2.13 both have it
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - older torch
    fully_shard = None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM of the Llama/Qwen2/Mistral families."""
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no base_model.layers ModuleList to shard")
    return layers


def _move_unsharded(model: nn.Module, device: torch.device) -> None:
    # what FSDP does not manage (the LM head, ignored/tied weights, buffers) goes to the device by
    # hand; a memo keeps a tied weight one object
    from torch.distributed.tensor import DTensor

    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, DTensor) or p.device == device:
                continue
            if id(p) not in moved:
                moved[id(p)] = nn.Parameter(p.data.to(device), requires_grad=p.requires_grad)
            module._parameters[name] = moved[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and not isinstance(b, DTensor) and b.device != device and b.device.type != "meta":
                module._buffers[name] = b.to(device)


def shard_backbone(model: nn.Module, mesh, device: torch.device, prefetch: int = 1) -> None:  # noqa: ANN001
    """fully_shard each decoder layer, then the base model as the root unit (see the module
    docstring); the LM head stays replicated. `prefetch` layers ahead are all-gathered in forward."""
    if fully_shard is None:
        raise RuntimeError("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    fully_shard(model.base_model, mesh=mesh, ignored_params={emb.weight} if tied else None)
    if prefetch > 0:
        for i, layer in enumerate(layers):
            nxt = list(layers[i + 1 : i + 1 + prefetch])
            if nxt:
                layer.set_modules_to_forward_prefetch(nxt)
    if next(model.parameters()).device.type != "meta":
        _move_unsharded(model, device)


def eval_forwards(n_jobs: int, n_examples: int, batch_size: int, max_sequences: int) -> int:
    """Backbone forwards of `ParallelEngine.evaluate_groups` for these sizes (every rank computes
    it for every rank, to pad the ranks with fewer to the same count)."""
    if n_jobs == 0 or n_examples == 0:
        return 0
    group = max(1, max_sequences // batch_size)
    return math.ceil(n_jobs / group) * math.ceil(n_examples / batch_size)


class ParallelEngine(MultiLoraEngine):
    """MultiLoraEngine over an FSDP2-sharded backbone; holds only this rank's jobs.

    The model comes in unsharded (on CPU, or on the meta device for benchmarks that initialise
    the shards in place); the multi-LoRA layers are injected first, then the backbone is sharded
    onto `device`. Every public pass (step, idle_step, evaluate_groups) runs the same number of
    backbone forwards/backwards as on every other rank if the caller asks for the same counts.
    """

    def __init__(self, model: nn.Module, train_examples: Sequence[Example], pad_id: int, *,
                 mesh, device: torch.device, prefetch: int = 1, **engine_kw) -> None:  # noqa: ANN001
        super().__init__(model, train_examples, pad_id, **engine_kw)
        shard_backbone(model, mesh, device, prefetch)
        self.device = torch.device(device)
        self._init_arena()  # the adapters' arena on this rank's device, not the unsharded model's

    def step(self) -> StepReport:
        """MultiLoraEngine.step, except that the backward always runs: when every job's loss is
        non-finite, over zero times the losses (non-finite grads, so every update is skipped, as
        on one GPU), because the other ranks' backward all-gathers wait for this rank's."""
        states = [s for s in self.jobs.values() if not s.done]
        if not states:
            raise RuntimeError("no attached job has steps left")
        per_job = [
            [self.train_examples[i] for i in s.stream.next_indices(s.spec.batch_size)] for s in states
        ]
        try:
            batch, sums, counts = self._forward_losses(states, per_job)
            losses = [s / max(n, 1) for s, n in zip(sums, counts, strict=True)]
            values = torch.stack([loss.detach() for loss in losses]).tolist()
            live = [loss for loss, v in zip(losses, values, strict=True) if math.isfinite(v)]
            torch.stack(live or [loss * 0.0 for loss in losses]).sum().backward()
        finally:
            self._clear_layout()
        return self._update(states, values, batch)

    def idle_step(self) -> None:
        """A backbone forward + backward over one pad token with no job: joins every layer's
        all-gathers (forward and backward) of a step; loss 0, nothing is updated."""
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        emb = self.model.get_input_embeddings()
        # the embedding is frozen: let its output require grad so that backward reaches (and
        # all-gathers) every layer, as a real step's LoRA paths make it do
        hook = emb.register_forward_hook(lambda _m, _a, out: out.detach().requires_grad_(True))
        try:
            out = self.model.base_model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False)
        finally:
            hook.remove()
        (out.last_hidden_state.float().sum() * 0.0).backward()

    @torch.no_grad()
    def idle_forward(self) -> None:
        """One backbone forward over one pad token (an evaluation forward with no job)."""
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        self.model.base_model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False)

    def evaluate_groups(self, examples: Sequence[Example], batch_size: int, job_ids: Sequence[str],
                        max_sequences: int, forwards: int) -> dict[str, float]:
        """`evaluate` of these jobs in groups of at most max_sequences // batch_size jobs, then
        idle forwards up to `forwards` backbone forwards in all (the max over ranks)."""
        group = max(1, max_sequences // batch_size)
        out: dict[str, float] = {}
        ids = list(job_ids)
        for lo in range(0, len(ids), group):
            out.update(self.evaluate(examples, batch_size, ids[lo : lo + group]))
        own = eval_forwards(len(ids), len(examples), batch_size, max_sequences)
        if own > forwards:
            raise RuntimeError(f"rank needs {own} eval forwards, more than the planned {forwards}")
        for _ in range(forwards - own):
            self.idle_forward()
        return out
