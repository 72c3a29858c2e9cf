"""The "auto" learning rates of a task: a centre LoRA learning rate per model family and size from
public LoRA calibrations, and the grid that brackets it, for the model a task names.

The centre interpolates geometrically on log(parameters) between calibration points (flat beyond
the first and the last). The calibrations (README, "Learning rates of auto"):

- Thinking Machines, "LoRA Without Regret" (Schulman et al., 2025): the best LoRA learning rate
  is about 10x the best full fine-tuning rate and nearly independent of the rank; about 1e-3 for
  1-4B models (Llama-3.2-1B/3B, Qwen3) and for Qwen3-8B, about 3e-4 for Llama-3.1-8B.
- Unsloth's and Axolotl's LoRA defaults for 7-8B models: 2e-4.
- 70B: 1e-4 is our assumption (the trend of the points above, and what practitioners use); no
  cited source measured it.

The grid is the centre times AUTO_LR_FACTORS (1/3, 1, 3): it spans 9x around the centre (the
earlier fixed grid 5e-5..4e-4 spanned 8x), so the best rate of a model whose calibration is off
by up to 3x either way is still in it. Parameters are counted from the model directory's
config.json (no weights loaded); pure stdlib.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from contract.families import FAMILIES

# (parameters, centre learning rate), by size; any family without an entry in FAMILY_POINTS
GENERIC_POINTS: tuple[tuple[float, float], ...] = (
    (1e9, 1e-3),  # LoRA Without Regret: 1-4B models
    (4e9, 1e-3),
    (8e9, 5e-4),  # between Qwen3-8B (1e-3) and Llama-3.1-8B (3e-4); the grid reaches 2e-4
    (70e9, 1e-4),  # assumption (module docstring)
)
# a family's own calibrations: each replaces the generic points within 1.5x of its size
FAMILY_POINTS: dict[str, tuple[tuple[float, float], ...]] = {
    "llama": ((8e9, 3e-4),),  # LoRA Without Regret: Llama-3.1-8B
    "qwen3": ((8e9, 1e-3),),  # LoRA Without Regret: Qwen3-8B
}
DEFAULT_PARAMETERS = 8e9  # the size assumed when the model's config cannot be read
AUTO_LR_FACTORS = (1 / 3, 1.0, 3.0)


def calibration(family: str | None) -> tuple[tuple[float, float], ...]:
    """The calibration points of a family, sorted by size: its own, and the generic ones not
    within 1.5x of any of them."""
    own = FAMILY_POINTS.get(family or "", ())
    kept = [p for p in GENERIC_POINTS
            if all(abs(math.log(p[0] / q[0])) >= math.log(1.5) for q in own)]
    return tuple(sorted((*own, *kept)))


def centre_learning_rate(family: str | None, parameters: float | None) -> float:
    """The centre LoRA learning rate of a model of this family and parameter count (None: the
    default size): geometric interpolation between calibration points, flat outside them."""
    points = calibration(family)
    n = float(parameters) if parameters and parameters > 0 else DEFAULT_PARAMETERS
    if n <= points[0][0]:
        return points[0][1]
    for (n0, lr0), (n1, lr1) in zip(points, points[1:], strict=False):
        if n <= n1:
            t = math.log(n / n0) / math.log(n1 / n0)
            return lr0 * (lr1 / lr0) ** t
    return points[-1][1]


def auto_learning_rates(centre: float) -> list[float]:
    """The auto grid around a centre (AUTO_LR_FACTORS), at two significant digits."""
    return [float(f"{centre * f:.2g}") for f in AUTO_LR_FACTORS]


def _first(config: Mapping, *keys: str, default: int | None = None) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int | float) and value > 0:
            return int(value)
    return default


def parameter_count(config: Mapping) -> int | None:
    """Parameters of a dense decoder from its config.json: embeddings (and an untied output
    head) plus per layer the attention (q, k, v, o with grouped K/V heads) and the MLP (three
    matrices when the family's MLP is gated, two otherwise). Norms and biases are left out
    (well under 1%). None when the config lacks the shape."""
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    vocab = _first(config, "vocab_size")
    if hidden is None or layers is None or vocab is None:
        return None
    inter = _first(config, "intermediate_size", "n_inner", "ffn_hidden_size", default=4 * hidden)
    heads = _first(config, "num_attention_heads", "n_head", default=1)
    head_dim = _first(config, "head_dim", default=hidden // heads)
    kv_heads = _first(config, "num_key_value_heads", "multi_query_group_num", default=heads)
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    family = FAMILIES.get(str(config.get("model_type")))
    gated = family is None or any(n in family.linears for n in ("gate_proj", "gate_up_proj"))
    mlp = (3 if gated else 2) * hidden * inter
    tied = bool(config.get("tie_word_embeddings", False))
    return layers * (attention + mlp) + (1 if tied else 2) * vocab * hidden


def model_centre(model_dir: str | Path | None, family: str | None = None,
                 parameters: int | None = None) -> float:
    """The centre learning rate of a local model directory: its family and size from its
    config.json; `family` and `parameters` (the registry's) when the config cannot be read."""
    config: Mapping = {}
    if model_dir is not None:
        try:
            loaded = json.loads((Path(model_dir) / "config.json").read_text())
            config = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            config = {}
    counted = parameter_count(config) if config else None
    return centre_learning_rate(config.get("model_type") or family, counted or parameters)
