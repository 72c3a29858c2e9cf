"""The backbone's RMSNorms, SiLU-gated MLPs and rotary embeddings on fused kernels
(kernels.norm_act, kernels.rope), on the GPU.

transformers' modules run a norm as ~8 kernels each way (float32 upcast, pow, mean, rsqrt, two
muls, casts) and keep a float32 copy of its input for the backward; the MLP's gate as silu and mul,
keeping silu's output too. The fused forms run one kernel each way, keep the input and one float32
per row (the norm) or gate and up (the MLP), and round where the modules round.

Which modules: any whose class is an RMSNorm with a frozen 1-d weight and an epsilon, and any MLP
with gate_proj, up_proj, down_proj and a SiLU act_fn; each class is admitted only once a probe
agrees with its own forward on random rows (through the module's real weights, before the LoRA
layers go in): a family whose norm differs (Gemma's 1 + weight, LayerNorms, norms of a different
order) keeps its own forward. The rotary embedding is a function of the attention class's module
(`apply_rotary_pos_emb`, which its forward calls by that global name): where a probe finds that
function equal to kernels.rope on random q, k, cos and sin, the module's global becomes a
dispatcher that runs the kernel on the calls of that form and the function itself on any other
(partial rotary, other layouts). That swap is the process's (every model of the family, as
transformers' kernel hub would do it); `use_fused_rope(False)` puts the functions back, and
LORAPLEX_FUSED_ROPE=0 leaves them alone (it does not undo a swap made earlier in the process).
Off on the CPU (unless TRITON_INTERPRET=1 and `force`), under LORAPLEX_FUSED_BLOCKS=0, and under
adapter parallelism (its engine is built on an unsharded model on the CPU or the meta device, then
sharded; a backbone already sharded, DTensor parameters, is left alone too).
"""
from __future__ import annotations

import inspect
import logging
import os
import sys
import time
import types
from typing import Any

import torch
from torch import nn

from kernels.norm_act import available, rms_norm, silu_mul
from kernels.rope import rope, rope_applies

log = logging.getLogger(__name__)
PROBE_RTOL = 2.0 ** -6  # two bfloat16 ulps: the kernels sum in another order than torch's reductions


def _eps(module: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if isinstance(value, float):
            return value
    return None


def norm_like(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return ("rmsnorm" in type(module).__name__.lower() and isinstance(weight, nn.Parameter)
            and weight.dim() == 1 and not weight.requires_grad and _eps(module) is not None
            and getattr(module, "bias", None) is None)


def mlp_like(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return (all(isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
            and act is not None and (isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")))


def _fused_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self._loraplex_eps)


# $LORAPLEX_MLP_REBUILD=1: a step without recompute keeps no copy of down_proj's input, silu(gate) * up
# (the intermediate width: 3.5 of the 17 hidden widths a layer keeps a token at 8B); down_proj's backward rebuilds it
# from gate and up, which the SiLU's backward keeps anyway (one elementwise kernel a layer). Off by default: on an
# H100 (session 37) search (a) trained in 43.0 s with it against 41.8-42.0 s without. The memory it frees let the
# warmup's 34-job step run as 4 passes without recompute (2.96 s) where it ran as one recomputed pass (1.60 s),
# and the 24-job steps as 2 passes (0.78-1.0 s, against 0.80-0.85 s recomputed as graphs).
MLP_REBUILD = os.environ.get("LORAPLEX_MLP_REBUILD", "0") == "1"


class _Rebuilt:
    """What down_proj's backward keeps of its input under the MLP rebuild: how to compute it again."""

    __slots__ = ("gate", "up", "shape")

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, shape: torch.Size) -> None:
        self.gate, self.up, self.shape = gate, up, shape


def _fused_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    h = silu_mul(gate, up)
    if not (getattr(self, "_loraplex_rebuild", False) and h.requires_grad):
        return self.down_proj(h)
    ptr, numel, dtype = h.data_ptr(), h.numel(), h.dtype

    def pack(t: torch.Tensor) -> torch.Tensor | _Rebuilt:
        # h itself or a reshape of it (the LoRA layer's 2-d view): a recipe instead of its bytes
        if t.data_ptr() == ptr and t.numel() == numel and t.dtype == dtype and t.is_contiguous():
            return _Rebuilt(gate, up, t.shape)
        return t

    def unpack(saved: torch.Tensor | _Rebuilt) -> torch.Tensor:
        if not isinstance(saved, _Rebuilt):
            return saved
        with torch.no_grad():
            return silu_mul(saved.gate, saved.up).view(saved.shape)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return self.down_proj(h)


def set_mlp_rebuild(model: nn.Module, on: bool) -> None:
    """Whether the fused MLPs' down projections rebuild their input in the backward (only where
    MLP_REBUILD and `on`: the engine's steps without recompute; a checkpointed layer must save as
    torch.utils.checkpoint expects)."""
    on = bool(on) and MLP_REBUILD
    for m in model.modules():
        if getattr(m.forward, "__func__", None) is _fused_mlp_forward:
            m._loraplex_rebuild = on


def mlp_rebuilds(model: nn.Module) -> bool:
    """Whether a step without recompute rebuilds the MLPs' down inputs (what the memory model reads)."""
    return MLP_REBUILD and fused(model)


def _agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype or not torch.isfinite(want).all():
        return False
    g, w = got.float(), want.float()
    return bool(((g - w).abs() <= PROBE_RTOL * w.abs() + 1e-6 * w.abs().max()).all())


def _probe_rows(width: int, like: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=like.device).manual_seed(seed)
    rows = torch.randn(5, width, generator=gen, device=like.device, dtype=torch.float32)
    return (rows * 2 + 0.5).to(like.dtype)  # an offset mean: a LayerNorm cannot pass for an RMSNorm


@torch.no_grad()
def probe_norm(module: nn.Module) -> bool:
    """Whether rms_norm computes what this module's forward does (on random rows)."""
    x = _probe_rows(module.weight.shape[0], module.weight, 0)
    try:
        want = module.forward(x)
        return isinstance(want, torch.Tensor) and _agrees(rms_norm(x, module.weight, _eps(module)), want)
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the module's own forward
        log.debug("norm probe of %s failed: %s", type(module).__name__, exc)
        return False


@torch.no_grad()
def probe_mlp(module: nn.Module) -> bool:
    """Whether the fused gate computes what this MLP's forward does (on random rows)."""
    weight = next(module.gate_proj.parameters())
    x = _probe_rows(int(getattr(module.gate_proj, "in_features", weight.shape[-1])), weight, 1)
    try:
        want = module.forward(x)
        return isinstance(want, torch.Tensor) and _agrees(_fused_mlp_forward(module, x), want)
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the module's own forward
        log.debug("mlp probe of %s failed: %s", type(module).__name__, exc)
        return False


ROPE_NAME = "apply_rotary_pos_emb"
# the probe's tolerance per dtype, relative to a rotated element's terms: four unit roundoffs (the
# ops round two products and a sum, the kernel once: at most three apart)
PROBE_ROPE_RTOL = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 2.0 ** -22}
# the modules whose rotary function was swapped: name -> (module, its own function, the dispatcher)
ROPE_SWAPS: dict[str, tuple[types.ModuleType, Any, Any]] = {}


def _rope_dispatcher(own: Any) -> Any:  # noqa: ANN401
    """`own` where a call is not of the Llama form (q, k, cos, sin[, unsqueeze_dim=1]) by its own
    signature (an older one with position_ids, keywords of other names: bound, not guessed)."""
    try:
        sig: inspect.Signature | None = inspect.signature(own)
    except (TypeError, ValueError):  # no signature to bind calls by: only the plain call is taken
        sig = None
    names = list(sig.parameters)[:4] if sig is not None else []

    def apply_rotary_pos_emb(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if len(args) == 4 and not kwargs:  # the families' own call
            q, k, cos, sin = args
            return rope(q, k, cos, sin) if rope_applies(q, k, cos, sin) else own(*args)
        try:
            bound = sig.bind(*args, **kwargs).arguments if sig is not None else {}
        except TypeError:
            return own(*args, **kwargs)  # raises as the function itself does
        # any other argument given at its default (an older form's position_ids=None) changes nothing
        extra = [n for n, v in bound.items() if n not in names and n != "unsqueeze_dim"
                 and v is not sig.parameters[n].default]
        unsqueeze = bound.get("unsqueeze_dim", 1)
        if len(names) == 4 and not extra and type(unsqueeze) is int and all(n in bound for n in names):
            q, k, cos, sin = (bound[n] for n in names)
            if rope_applies(q, k, cos, sin, unsqueeze):
                return rope(q, k, cos, sin)
        return own(*args, **kwargs)

    apply_rotary_pos_emb.loraplex_own = own
    return apply_rotary_pos_emb


def attention_like(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Module) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))


@torch.no_grad()
def probe_rope(module: nn.Module, own: Any) -> bool:  # noqa: ANN401
    """Whether kernels.rope computes what `own` (the module's rotary function) does on random q
    [1, 3, 5, D] and k [1, 2, 5, D] (transposed views, as the projections give them) and cos, sin."""
    weight = next(module.q_proj.parameters(), None)
    dim = getattr(module, "head_dim", None)
    if weight is None or weight.dtype not in PROBE_ROPE_RTOL or not isinstance(dim, int) or dim % 2:
        return False
    gen = torch.Generator(device=weight.device).manual_seed(2)
    q, k = (torch.randn(1, 5, h * dim, generator=gen, device=weight.device).to(weight.dtype)
            .view(1, 5, h, dim).transpose(1, 2) for h in (3, 2))
    cos, sin = (torch.randn(1, 5, dim, generator=gen, device=weight.device).to(weight.dtype) for _ in range(2))
    if not rope_applies(q, k, cos, sin):
        return False
    try:
        want = own(q, k, cos, sin)
        got = rope(q, k, cos, sin)
        # the kernel rounds once where the function may round each product: near a cancellation
        # that is many of the result's last places, but few of the products' (`scale`)
        tol = PROBE_ROPE_RTOL[weight.dtype]
        return all(
            isinstance(w, torch.Tensor) and g.shape == w.shape and g.dtype == w.dtype
            and bool(((g.float() - w.float()).abs() <= tol * _rope_scale(x, cos, sin)).all())
            for g, w, x in zip(got, want, (q, k), strict=True))
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the module's own function
        log.debug("rope probe of %s failed: %s", type(module).__name__, exc)
        return False


def _rope_scale(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """|x| * |cos| + |rotate_half(x)| * |sin| in float32: the size of a rotated element's terms."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1).float().abs()
    return x.float().abs() * cos.float().abs().unsqueeze(1) + swapped * sin.float().abs().unsqueeze(1) + 1e-30


def _fuse_ropes(model: nn.Module) -> tuple[int, list[str]]:
    """Swap the rotary functions of the model's attention classes' modules the probe admits
    (once per module for the process); the attention layers that now run the kernel, and the
    classes kept."""
    layers, kept, seen = 0, [], set()
    for module in model.modules():
        if not attention_like(module):
            continue
        name = type(module).__module__
        mod = sys.modules.get(name)
        fn = getattr(mod, ROPE_NAME, None)
        fn = getattr(fn, "loraplex_own", fn)  # a dispatcher that came in by import: its function
        if name not in seen and name not in ROPE_SWAPS and callable(fn):
            if probe_rope(module, fn):
                ROPE_SWAPS[name] = (mod, fn, _rope_dispatcher(fn))
                setattr(mod, ROPE_NAME, ROPE_SWAPS[name][2])
            else:
                kept.append(type(module).__name__)
        seen.add(name)
        # the layers whose calls reach the kernel now (none while use_fused_rope(False) holds)
        layers += name in ROPE_SWAPS and getattr(mod, ROPE_NAME, None) is ROPE_SWAPS[name][2]
    return layers, kept


def use_fused_rope(on: bool) -> None:
    """Put the swapped rotary functions back (False) or the dispatchers again (True), process-wide
    (bench/fused_blocks.py's arms)."""
    for mod, own, dispatcher in ROPE_SWAPS.values():
        setattr(mod, ROPE_NAME, dispatcher if on else own)


def _sharded(model: nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def fuse_blocks(model: nn.Module, force: bool = False) -> dict[str, Any]:
    """Swap the forwards of the model's norms and MLPs the probes admit for the fused kernels, in
    place, the backbone frozen first (as the engine freezes it), and its attention's rotary
    function (process-wide, see the module docstring; not under LORAPLEX_FUSED_ROPE=0); returns
    how many of each and the classes kept as they were. Call before the LoRA layers go in (the
    MLP probe runs the plain projections)."""
    done: dict[str, Any] = {"norms": 0, "mlps": 0, "ropes": 0, "kept": []}
    param = next(model.parameters(), None)
    if (param is None or os.environ.get("LORAPLEX_FUSED_BLOCKS", "1") == "0" or _sharded(model)
            or not available(param) or (param.device.type != "cuda" and not force)):
        return done
    model.requires_grad_(False)  # the backbone is frozen (the LoRA layers train; the norms' weights never)
    t0 = time.perf_counter()
    verdict: dict[tuple[type, str], bool] = {}
    for module in model.modules():
        kind = "norms" if norm_like(module) else "mlps" if mlp_like(module) else None
        if kind is None:
            continue
        key = (type(module), kind)
        if key not in verdict:
            verdict[key] = probe_norm(module) if kind == "norms" else probe_mlp(module)
            if not verdict[key]:
                done["kept"].append(type(module).__name__)
        if verdict[key]:
            if kind == "norms":
                module._loraplex_eps = _eps(module)
                module.forward = types.MethodType(_fused_norm_forward, module)
            else:
                module.forward = types.MethodType(_fused_mlp_forward, module)
            done[kind] += 1
    if os.environ.get("LORAPLEX_FUSED_ROPE", "1") != "0":
        done["ropes"], kept = _fuse_ropes(model)
        done["kept"] += kept
    log.info("fused blocks: %d norms, %d MLPs, %d rotary embeddings; kept their own forward: %s (probes and swaps "
             "%.2f s)", done["norms"], done["mlps"], done["ropes"], done["kept"] or "none", time.perf_counter() - t0)
    return done


def fused(model: nn.Module) -> bool:
    """Whether fuse_blocks swapped any of the model's MLPs (what the memory model reads)."""
    return any(getattr(m.forward, "__func__", None) is _fused_mlp_forward for m in model.modules())
