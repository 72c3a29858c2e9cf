"""Adapter parallelism, the engine half: the frozen backbone of any engine (any objective)
sharded with FSDP2 layer by layer, and the engine put in lockstep with the other ranks.

Sharding (`shard_backbone`): every decoder layer is its own FSDP2 unit (all-gathered before its
forward, resharded after it, all-gathered again in backward); the base model (embeddings + final
norm) is the root unit, which is what `MultiLoraEngine.hidden` calls, so the root hooks run. The
LM head is left out and kept whole on every rank: the engine calls it once per job and again in
each job's recomputed backward, and as its own FSDP unit it would be all-gathered 2 x jobs times a
step (Qwen2.5-32B: a 1.56 GB head, ~4.4 ms per all-gather on 2 H200s scaled from the 2.78 ms
measured per 0.98 GB layer, ~70 ms per 8-job step, against 0.78 GB more memory per rank kept
whole). A tied head shares the embedding, which is then kept whole too. Adapters live outside the
model (JobAdapter), so FSDP never sees them; base weights are frozen, so no gradient exists for
FSDP to reduce-scatter: the only collectives of a step are the parameter all-gathers.

Lockstep (`shard_engine`): the engine's `agree` becomes an all-reduce (max) over the ranks, so an
extra backbone pass one rank needs (DPO's reference log-probs) is joined by the others with an
idle pass; the step's backward always runs; `MultiLoraEngine.idle_step` / `idle_forward` and the
`forwards` of `evaluate_metrics` pad a rank with fewer passes to the others' count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from contract.families import family_of
from trainer.engine import MultiLoraEngine

try:  # torch >= 2.6 public path; 2.11 and 2.13 both have it
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - older torch
    fully_shard = None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM, at its family's layers_path (contract.families)."""
    node: object = model
    for attr in family_of(getattr(model.config, "model_type", None)).layers_path.split("."):
        node = getattr(node, attr, None)
    if not isinstance(node, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder-layer ModuleList to shard")
    return node


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


def shard_engine(engine: MultiLoraEngine, mesh, device: torch.device, prefetch: int = 1) -> MultiLoraEngine:  # noqa: ANN001
    """Shard the engine's backbone over the mesh onto `device` (it came in unsharded, on CPU or
    on the meta device for benchmarks that initialise the shards in place; the multi-LoRA layers
    are already injected) and put the engine in lockstep with the mesh's other ranks. Call it
    before any job is attached: the adapters' arena moves to `device`."""
    group = mesh.get_group()

    def agree(local: int) -> int:
        value = torch.tensor([local], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return int(value.item())

    shard_backbone(engine.model, mesh, device, prefetch)
    # the adapters' arena on this rank's device, not the unsharded model's
    engine.move_to(torch.device(device))
    engine.agree = agree
    return engine
