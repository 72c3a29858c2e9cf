"""Model surgery for multi-LoRA training: target linears become MultiLoraLinear layers that add
every co-resident job's LoRA path to one shared frozen base matmul (kernels.multilora_linear).

Each job owns a JobAdapter: exact-rank nn.Parameters per target layer in PEFT's layout
(lora_A [r, d_in], lora_B [d_out, r]) initialised as PEFT does. Per step the engine stacks the
active jobs' adapters into [N, d_in, r_max] / [N, r_max, d_out] (padding in the weights only).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from kernels import multilora_linear

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class StepLayout:
    """What every MultiLoraLinear needs for the current forward: token offsets per slot and the
    per-slot scaling/rank vectors (shared by all layers)."""

    offsets: torch.Tensor  # [N+1] int64, token rows per active job
    scales: torch.Tensor   # [N] float32
    ranks: torch.Tensor    # [N] int32
    backend: str = "auto"


class MultiLoraLinear(nn.Module):
    """A frozen nn.Linear plus the stacked LoRA adapters of the active jobs for this step."""

    def __init__(self, base: nn.Linear, name: str) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.layout: StepLayout | None = None
        self.stack_a: torch.Tensor | None = None
        self.stack_b: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout is None or self.stack_a is None:
            return self.base(x)
        shape = x.shape
        lay = self.layout
        y = multilora_linear(
            x.reshape(-1, shape[-1]), self.base.weight, self.base.bias, self.stack_a, self.stack_b,
            lay.scales, lay.ranks, lay.offsets, backend=lay.backend,
        )
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"name={self.name}, in={self.in_features}, out={self.out_features}"


def inject_multilora(model: nn.Module, targets: Iterable[str] = DEFAULT_TARGETS) -> dict[str, MultiLoraLinear]:
    """Freeze `model` and replace its target linears (by last name component, lm_head excluded)
    in place; returns {full module name: layer} in module order."""
    targets = set(targets)
    for p in model.parameters():
        p.requires_grad_(False)
    found: list[tuple[str, nn.Module, str, nn.Linear]] = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and child_name in targets and child_name != "lm_head":
                found.append((full, module, child_name, child))
    if not found:
        raise ValueError(f"no target linears {sorted(targets)} found in the model")
    layers = {}
    for full, parent, child_name, child in found:
        layer = MultiLoraLinear(child, full)
        setattr(parent, child_name, layer)
        layers[full] = layer
    return layers


class JobAdapter(nn.Module):
    """One job's LoRA weights for every target layer, in PEFT's layout and init.

    Init (PEFT's default): A ~ kaiming_uniform(a=sqrt(5)) drawn from a generator seeded with the
    job's seed, layer by layer in module order; B = 0. Scaling alpha/r (or alpha/sqrt(r) rsLoRA).
    """

    def __init__(
        self, shapes: dict[str, tuple[int, int]], rank: int, alpha: float, seed: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", use_rslora: bool = False,
    ) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.rank = rank
        self.alpha = float(alpha)
        self.scaling = self.alpha / (math.sqrt(rank) if use_rslora else rank)
        self.use_rslora = use_rslora
        self.names = list(shapes)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.lora_a = nn.ParameterList()
        self.lora_b = nn.ParameterList()
        for name in self.names:
            d_in, d_out = shapes[name]
            a = torch.empty(rank, d_in, dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            self.lora_a.append(nn.Parameter(a.to(device=device, dtype=dtype)))
            self.lora_b.append(nn.Parameter(torch.zeros(d_out, rank, dtype=dtype, device=device)))

    def pairs(self) -> Iterable[tuple[str, nn.Parameter, nn.Parameter]]:
        return zip(self.names, self.lora_a, self.lora_b, strict=True)

    def peft_state_dict(self, prefix: str = "base_model.model.") -> dict[str, torch.Tensor]:
        """Weights under PEFT's saved key names (adapter name stripped)."""
        out = {}
        for name, a, b in self.pairs():
            out[f"{prefix}{name}.lora_A.weight"] = a.detach()
            out[f"{prefix}{name}.lora_B.weight"] = b.detach()
        return out

    def load_peft_state_dict(self, state: dict[str, torch.Tensor], prefix: str = "base_model.model.") -> None:
        with torch.no_grad():
            for name, a, b in self.pairs():
                a.copy_(state[f"{prefix}{name}.lora_A.weight"])
                b.copy_(state[f"{prefix}{name}.lora_B.weight"])


def stack_adapters(
    adapters: list[JobAdapter], index: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack layer `index` of the given adapters into [N, d_in, r_max] and [N, r_max, d_out],
    zero-padding ranks (differentiable back to each job's own parameters)."""
    r_max = max(ad.rank for ad in adapters)
    a_list, b_list = [], []
    for ad in adapters:
        a = ad.lora_a[index].to(dtype).t()
        b = ad.lora_b[index].to(dtype).t()
        pad = r_max - ad.rank
        if pad:
            a = nn.functional.pad(a, (0, pad))
            b = nn.functional.pad(b, (0, 0, 0, pad))
        a_list.append(a)
        b_list.append(b)
    return torch.stack(a_list), torch.stack(b_list)
