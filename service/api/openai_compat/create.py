"""A fine-tuning job create (OpenAI's body) as a native task create, and errors named by the
OpenAI param the client sent.

Hyperparameters (per method, `method.supervised.hyperparameters` or `method.dpo.hyperparameters`;
the legacy top-level `hyperparameters` means supervised): each is a number, a list (loraplex's
extension: a search space, every value trained at once as one job each) or "auto". A knob left
out counts as "auto", as at OpenAI. "auto" means:

- learning_rate_multiplier (or learning_rate): search the model's centre LoRA learning rate /3, x1
  and x3 (the native search space's learning_rate "auto", service.learning_rates: the centre
  per model family and size from public LoRA calibrations, e.g. 1e-3 for a 1B model, 3e-4 for
  Llama-3.1-8B);
- lora_rank (extension): search [8, 16];
- lora_alpha (extension): 16, batch_size: 8, n_epochs: 1, a method's own knob (beta, dpo) its
  default in contract.methods, 0.1 (one value each: not searched).

So a job with no hyperparameters trains the default space of 3 learning rates x 2 ranks = 6
configurations at once (AUTO_SPACE) and returns the adapter with the best validation loss. A
multiplier given as a number is of BASE_LEARNING_RATE = 1e-4 (the multipliers shown for an auto
grid are its rates / 1e-4). `learning_rate` (absolute, extension) may be given instead of
learning_rate_multiplier. n_epochs is one number for the whole job (not a search space).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from contract.methods import DEFAULT_METHOD, METHOD_KNOBS, METHODS, method_spec, openai_methods
from service.api.openai_compat.schemas import FineTuningJobCreate, Hyperparameters
from service.core.errors import ApiError, invalid, loc_to_param
from service.schemas import TaskCreate

BASE_LEARNING_RATE = 1e-4
AUTO_SPACE: dict[str, list] = {  # learning rates: service.learning_rates, per model
    "lora_rank": [8, 16],
    "lora_alpha": [16.0],
    "batch_size": [8],
    **{k.name: [k.default] for k in METHOD_KNOBS.values()},  # a method's own: its default
}
AUTO_EPOCHS = 1
NATIVE_METHOD = {name: m.name for name, m in openai_methods().items()}
OPENAI_METHOD = {m.name: m.openai or m.name for m in METHODS.values()}  # shown as its own name


def _values(value: Any, auto: list) -> list:
    if value == "auto":
        return list(auto)
    return list(value) if isinstance(value, list) else [value]


def method_params(body: FineTuningJobCreate) -> tuple[str, Hyperparameters, str]:
    """(native method, its hyperparameters, the param path they came from)."""
    if body.method is None:
        return DEFAULT_METHOD, body.hyperparameters or Hyperparameters(), "hyperparameters"
    if body.hyperparameters is not None:
        raise invalid("give hyperparameters in method.<type>.hyperparameters, not both there "
                      "and at the top level", param="hyperparameters")
    kind = body.method.type
    params = getattr(body.method, kind)
    for other in NATIVE_METHOD:
        if other != kind and getattr(body.method, other) is not None:
            raise invalid(f"method.type is {kind!r} but method.{other} is given",
                          param=f"method.{other}")
    hp = params.hyperparameters if params is not None else Hyperparameters()
    return NATIVE_METHOD[kind], hp, f"method.{kind}.hyperparameters"


def search_space(method: str, hp: Hyperparameters, where: str) -> dict[str, list | str]:
    """The native search space of these hyperparameters ("auto" expanded, lists kept; the
    learning rate's "auto" stays "auto": the create centres it on the model, tasks.resolve_auto)."""
    if hp.learning_rate is not None and hp.learning_rate_multiplier is not None:
        raise invalid("give learning_rate or learning_rate_multiplier, not both",
                      param=f"{where}.learning_rate")
    if hp.learning_rate not in (None, "auto"):
        rates: list | str = [float(f"{r:.6g}") for r in _values(hp.learning_rate, [])]
    elif hp.learning_rate is None and hp.learning_rate_multiplier not in (None, "auto"):
        rates = [float(f"{m * BASE_LEARNING_RATE:.6g}")
                 for m in _values(hp.learning_rate_multiplier, [])]
    else:
        rates = "auto"
    space: dict[str, list | str] = {
        "learning_rate": rates, "lora_rank": _values(hp.lora_rank, AUTO_SPACE["lora_rank"]),
        "lora_alpha": _values(hp.lora_alpha, AUTO_SPACE["lora_alpha"]),
        "batch_size": _values(hp.batch_size, AUTO_SPACE["batch_size"])}
    own = method_spec(method).knob_names()
    for name in sorted(Hyperparameters.model_fields.keys() & METHOD_KNOBS.keys()):
        value = getattr(hp, name)
        if name in own:
            space[name] = _values(value, AUTO_SPACE[name])
        elif value != "auto":
            owners = " or ".join(m.openai or m.name for m in METHODS.values() if name in m.knob_names())
            raise invalid(f"{name} is a {owners} hyperparameter", param=f"{where}.{name}")
    return space


NATIVE_PARAM = {"base_model": "model", "search_space.learning_rate": "learning_rate_multiplier",
                "search_space.lora_rank": "lora_rank", "search_space.lora_alpha": "lora_alpha",
                "search_space.batch_size": "batch_size", "search_space": "", "epochs": "n_epochs",
                **{f"search_space.{k}": k for k in METHOD_KNOBS}}


def openai_param(param: str | None, where: str) -> str | None:
    """The OpenAI-side name of a native task parameter (an error names what the client sent)."""
    if param is None or param not in NATIVE_PARAM:
        return param
    name = NATIVE_PARAM[param]
    if param == "base_model":
        return name
    return f"{where}.{name}" if name else where


def to_task_create(body: FineTuningJobCreate) -> tuple[TaskCreate, str]:
    """The native task of a fine-tuning job create, and where its hyperparameters were given.
    4xx naming the OpenAI param for anything wrong."""
    method, hp, where = method_params(body)
    space = search_space(method, hp, where)
    native: dict[str, Any] = {
        "base_model": body.model, "training_file": body.training_file,
        "validation_file": body.validation_file, "method": method, "search_space": space,
        "epochs": AUTO_EPOCHS if hp.n_epochs == "auto" else hp.n_epochs,
        "suffix": body.suffix, "metadata": body.metadata, "integrations": body.integrations}
    if body.seed is not None:
        native["seed"] = body.seed
    for name in ("validation_split", "max_seq_len", "early_exit", "eval", "target_modules",
                 "priority"):
        value = getattr(body, name)
        if value is not None:
            native[name] = value
    try:
        return TaskCreate.model_validate(native), where
    except ValidationError as exc:
        first = exc.errors()[0]
        param = openai_param(loc_to_param(first.get("loc", ())), where)
        raise invalid(f"{param or 'request'}: {first.get('msg', 'invalid value')}",
                      param=param) from exc


def remap_error(exc: ApiError, where: str) -> ApiError:
    exc.param = openai_param(exc.param, where)
    return exc
