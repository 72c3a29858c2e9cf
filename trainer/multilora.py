"""Model surgery for multi-LoRA training: target linears become MultiLoraLinear layers that add
every co-resident job's LoRA path to one shared frozen base matmul (kernels.multilora_linear).

Each job owns a JobAdapter: one flat exact-rank nn.Parameter holding every target layer's
lora_A and lora_B^T, initialised as PEFT does. While a job is attached, that parameter is a view
of the engine's arena (one buffer for all attached jobs), and each layer reads its adapters at
per-job offsets: nothing is stacked, padded or copied per step, and backward adds the weight
gradients straight into the engine's gradient arena (kernels.multilora_linear_arena). The
backbone's own dropout is turned off (`without_backbone_dropout`: one pass serves every job).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from kernels import multilora_linear_arena


@dataclass
class StepLayout:
    """What every MultiLoraLinear needs for the current forward (shared by all layers): token
    offsets per slot, per-slot scaling and rank, and the engine's adapter arenas."""

    offsets: torch.Tensor      # [N+1] int64, token rows per active job
    scales: torch.Tensor       # [N] float32
    ranks: torch.Tensor        # [N] int32
    arena: torch.Tensor        # [P] every attached job's weights, in the compute dtype
    grad_arena: torch.Tensor   # [P] float32 (float64 for float64): backward adds gradients here
    r_max: int
    token: torch.Tensor        # scalar that requires grad: makes backward reach every layer
    backend: str = "auto"
    # Triton operator form: "compose" (cuBLAS + LoRA passes), "fused" (LoRA in the GEMM epilogues),
    # "auto" (per shape, from measured timings); None = the process default (kernels.set_default_form)
    form: str | None = None
    # every a/b offset of this step is a multiple of 16 elements (the engine checks its host ints):
    # the fused kernels may then load the adapters' rows as 16-byte vectors
    aligned: bool = False


class MultiLoraLinear(nn.Module):
    """A frozen nn.Linear plus the LoRA paths of the active jobs for this step, read from the
    engine's arena at this layer's per-job offsets (`a_off`, `b_off`, set per step)."""

    def __init__(self, base: nn.Linear, name: str) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.layout: StepLayout | None = None
        self.a_off: torch.Tensor | None = None
        self.b_off: torch.Tensor | None = None
        # decoding (trainer.sampling), plain matmuls with few launches: groups of equal rows as
        # stacked (A^T [G, d_in, r], scaled B^T [G, r, d_out]) for two batched matmuls, or per
        # group of batch rows [lo, hi) its A^T and scaled B^T (None for the base model's rows)
        self.dense: tuple[torch.Tensor, torch.Tensor] | list[tuple[int, int, torch.Tensor, torch.Tensor] | None] \
            | None = None

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:  # the LoRA term added by the second matmul itself (beta = 1)
            y = self.base(x)
            if isinstance(self.dense, tuple):  # every group the same rows: two batched matmuls
                a_t, b_t = self.dense
                groups = a_t.shape[0]
                s = torch.bmm(x.reshape(groups, -1, x.shape[-1]), a_t)
                y.view(groups, -1, y.shape[-1]).baddbmm_(s, b_t)
                return y
            for group in self.dense:  # batch rows [lo, hi) (a prefill's rows hold many tokens each)
                if group is not None:
                    lo, hi, a_t, b_t = group
                    y[lo:hi].view(-1, y.shape[-1]).addmm_(x[lo:hi].reshape(-1, x.shape[-1]) @ a_t, b_t)
            return y
        lay = self.layout
        if lay is None or self.a_off is None:
            return self.base(x)
        shape = x.shape
        y = multilora_linear_arena(
            x.reshape(-1, shape[-1]), self.base.weight, self.base.bias, lay.arena, lay.grad_arena,
            self.a_off, self.b_off, lay.scales, lay.ranks, lay.offsets, lay.r_max, lay.token,
            backend=lay.backend, form=lay.form, aligned=lay.aligned,
        )
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"name={self.name}, in={self.in_features}, out={self.out_features}"


def without_backbone_dropout(model: nn.Module) -> None:
    """Turn off the backbone's own dropout (nn.Dropout modules and the dropout rates that layers
    keep as plain floats, e.g. StarCoder2's residual and attention dropout). A deliberate choice:
    the backbone serves every job of a batch in one pass, so its dropout would make a job's
    updates depend on its batch-mates, and the varlen attention has none. LoRA's own dropout
    is 0 too (trainer.export writes lora_dropout 0)."""
    config = getattr(model, "config", None)
    for holder in [*model.modules(), *([config] if config is not None else [])]:
        if isinstance(holder, nn.Dropout):
            holder.p = 0.0
        for name, value in list(vars(holder).items()):
            if ("dropout" in name or "pdrop" in name) and type(value) is float:
                setattr(holder, name, 0.0)


def inject_multilora(model: nn.Module, targets: Iterable[str]) -> dict[str, MultiLoraLinear]:
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
    missing = targets - {child_name for _, _, child_name, _ in found}
    if missing:  # e.g. q_proj in a model that fuses q/k/v: never adapt a subset silently
        raise ValueError(f"target linears {sorted(missing)} not found in the model")
    layers = {}
    for full, parent, child_name, child in found:
        layer = MultiLoraLinear(child, full)
        setattr(parent, child_name, layer)
        layers[full] = layer
    return layers


class JobAdapter(nn.Module):
    """One job's LoRA weights for every target layer in ONE flat parameter, PEFT's init.

    Layout of `flat`, layer by layer in module order: A [r, d_in] (PEFT's lora_A) then
    B^T [r, d_out] (PEFT's lora_B, transposed), row-major. One tensor per job keeps the
    optimizer, the gradient norm and the clipping at one kernel each, and lets the engine keep
    every attached job's weights in one arena that the kernels address by offsets (no per-step
    stacking). `lora_a[k]` / `lora_b[k]` are views in PEFT's shapes.
    Init (PEFT's default): A ~ kaiming_uniform(a=sqrt(5)) drawn from a generator seeded with the
    job's seed, layer by layer in module order; B = 0. Scaling alpha/r (or alpha/sqrt(r) rsLoRA).
    The generator lives on the adapter's device (on a GPU: Philox, no host RNG and no host-to-device
    copy of the 20-170M values of an 8B model's adapter), so the same seed gives the same init
    on every device of one type; a CPU adapter and a GPU adapter of one seed differ.
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
        self.shapes = [shapes[n] for n in self.names]
        self.a_offsets: list[int] = []
        self.b_offsets: list[int] = []
        pos = 0
        for d_in, d_out in self.shapes:
            self.a_offsets.append(pos)
            pos += rank * d_in
            self.b_offsets.append(pos)
            pos += rank * d_out
        device = torch.device(device)
        flat = torch.zeros(pos, dtype=torch.float32, device=device)
        gen = torch.Generator(device=device).manual_seed(seed)
        for (d_in, _), lo in zip(self.shapes, self.a_offsets, strict=True):
            a = flat[lo : lo + rank * d_in].view(rank, d_in)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
        self.flat = nn.Parameter(flat.to(dtype=dtype))

    def _a_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        r = self.rank
        return [flat[lo : lo + r * d_in].view(r, d_in) for (d_in, _), lo in zip(self.shapes, self.a_offsets, strict=True)]

    def _b_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        r = self.rank
        return [flat[lo : lo + r * d_out].view(r, d_out).t()
                for (_, d_out), lo in zip(self.shapes, self.b_offsets, strict=True)]

    @property
    def lora_a(self) -> list[torch.Tensor]:
        """Per layer, A [r, d_in] (a view of `flat`)."""
        return self._a_views(self.flat)

    @property
    def lora_b(self) -> list[torch.Tensor]:
        """Per layer, B [d_out, r] (a transposed view of `flat`)."""
        return self._b_views(self.flat)

    def pairs(self) -> Iterable[tuple[str, torch.Tensor, torch.Tensor]]:
        return zip(self.names, self.lora_a, self.lora_b, strict=True)

    def peft_state_dict(self, prefix: str = "base_model.model.", flat: torch.Tensor | None = None
                        ) -> dict[str, torch.Tensor]:
        """Weights under PEFT's saved key names (adapter name stripped), as views of `flat`; pass
        another tensor of its layout (e.g. `self.flat.grad`) to name that one's parts."""
        src = (self.flat if flat is None else flat).detach()
        out = {}
        for name, a, b in zip(self.names, self._a_views(src), self._b_views(src), strict=True):
            out[f"{prefix}{name}.lora_A.weight"] = a
            out[f"{prefix}{name}.lora_B.weight"] = b
        return out

    def load_peft_state_dict(self, state: dict[str, torch.Tensor], prefix: str = "base_model.model.") -> None:
        with torch.no_grad():
            for name, a, b in self.pairs():
                a.copy_(state[f"{prefix}{name}.lora_A.weight"])
                b.copy_(state[f"{prefix}{name}.lora_B.weight"])
