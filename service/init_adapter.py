"""A task that starts every job from an uploaded PEFT adapter (TaskCreate.init_adapter_file): the
checks at create and what the adapter fixes in the task (its rank, alpha and target modules).

Every problem is a 422 naming the field at fault (init_adapter_file, search_space.lora_rank,
search_space.lora_alpha or target_modules), raised before anything is written. The adapter is
checked against the registered base model:
- its name: the adapter's `base_model_name_or_path` must name the task's base model. Lenient
  where a hub name and a local path differ: the last path component, case-folded, of the
  recorded name must equal that of the registry entry's name or of its path
  (`meta-llama/Llama-3.1-8B` matches an entry `/models/llama-3.1-8b`); an adapter that records
  no base model passes (the shapes below still must fit).
- its target modules must exist in the model's family (contract.families);
- every adapted module must exist in the model with the adapter's (in, out) features: read from
  the model's safetensors headers (exact, any family), else computed from its config.json for the
  attention and MLP linears of the Llama layout (hidden, heads, kv heads, head_dim, intermediate
  size; layer index below num_hidden_layers). Where the API cannot read the model (only the
  workers mount it) this check is left to the trainer, which fails the task without a retry.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from sqlalchemy.orm import Session

from contract.families import UnsupportedModel, family_of, model_type_of, resolve_targets
from service.adapter_archive import ADAPTER_PURPOSE, AdapterError, AdapterInfo, inspect_adapter
from service.core.errors import ApiError, invalid
from service.core.registry import BaseModelEntry, ModelRegistry
from service.core.storage import Storage
from service.models import File, Tenant
from service.schemas import TaskCreate

PARAM = "init_adapter_file"
PEFT_PREFIX = "base_model.model."
MAX_HEADER = 100 << 20
_LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")


def resolve_init_adapter(session: Session, storage: Storage, tenant: Tenant, body: TaskCreate,
                         registry: ModelRegistry) -> TaskCreate:
    """The task with what its starting adapter fixes filled in (lora_rank, lora_alpha and
    target_modules: absent in the request, or equal to the adapter's); the body itself without
    one. 422 (naming the field) for an adapter that cannot start this task."""
    if body.init_adapter_file is None:
        return body
    info = _adapter_of(session, storage, tenant, body.init_adapter_file)
    fixed = {"lora_rank": [info.rank], "lora_alpha": [info.alpha]}
    given = body.search_space.model_fields_set
    for knob, value in fixed.items():
        if knob in given and sorted(getattr(body.search_space, knob)) != value:
            raise invalid(f"search_space.{knob} {getattr(body.search_space, knob)} conflicts "
                          f"with init_adapter_file {body.init_adapter_file!r}, whose {knob} is "
                          f"{value[0]:g}: leave it out or set it to [{value[0]:g}]",
                          param=f"search_space.{knob}")
    targets = list(info.target_modules)
    if body.target_modules is not None and sorted(body.target_modules) != targets:
        raise invalid(f"target_modules {body.target_modules} conflict with init_adapter_file "
                      f"{body.init_adapter_file!r}, which adapts {targets}: leave them out or "
                      "name exactly those", param="target_modules")
    model = registry.get(body.base_model)
    if model is not None:  # else the create's own check names base_model
        check_against_model(info, model)
    space = body.search_space.model_copy(update=fixed)
    return body.model_copy(update={"search_space": space, "target_modules": targets})


def _adapter_of(session: Session, storage: Storage, tenant: Tenant, file_id: str) -> AdapterInfo:
    row = session.get(File, file_id)
    if row is None or row.tenant_id != tenant.id or row.deleted_at is not None:
        raise invalid(f"file {file_id!r} not found", param=PARAM, code="file_not_found")
    if row.purpose != ADAPTER_PURPOSE or row.format != "adapter":
        raise invalid(f"file {file_id!r} has purpose {row.purpose!r}: a task starts from a file "
                      "uploaded with purpose 'adapter'", param=PARAM)
    try:
        with storage.open(row.storage_key) as src:
            info = inspect_adapter(src)
    except (AdapterError, OSError) as exc:
        raise invalid(f"init_adapter_file {file_id!r}: {exc}", param=PARAM) from exc
    check_startable(info, f"init_adapter_file {file_id!r}", PARAM)
    return info


def check_startable(info: AdapterInfo, what: str, param: str) -> None:
    """422 (param) for an adapter no task can start from: a rank outside the search space's
    bounds (contract.protocol.LoraRank), rsLoRA, an alpha out of bounds. Checked at upload and
    again at create (for files uploaded before the upload checked it)."""
    if not 1 <= info.rank <= 1024:
        raise invalid(f"{what} has rank {info.rank}; ranks are 1-1024", param=param)
    if info.use_rslora:  # the job's contract carries no rsLoRA scaling: it would start elsewhere
        raise invalid(f"{what} uses rsLoRA (use_rslora), which a task cannot start from",
                      param=param)
    if not 0 < info.alpha <= 1e6:
        raise invalid(f"{what} has lora_alpha {info.alpha:g}; it must be in (0, 1e6]",
                      param=param)


def check_upload(info: AdapterInfo, registry: ModelRegistry | None,
                 base_model: str | None) -> None:
    """What an adapter upload can know before any task (422, param `file`, or `base_model` for an
    unknown model): check_startable, and the fit to a registered base model: the one the upload
    names (`base_model`), else those the adapter's `base_model_name_or_path` names (the lenient
    match of check_against_model; it must fit one of them: no other model would pass its name
    check at create). An adapter recording a model that is not registered passes: the registry
    may gain it later, and the create checks it again."""
    check_startable(info, "adapter", "file")
    if base_model is not None:
        model = registry.get(base_model) if registry is not None else None
        if model is None:
            raise invalid(f"base model {base_model!r} is not registered (GET /v1/models lists "
                          "them)", param="base_model", code="model_not_found")
        check_against_model(info, model, param="file", what="adapter")
        return
    if not info.base_model or registry is None:
        return
    named = [m for m in registry.all() if _norm(info.base_model) in (_norm(m.name), _norm(m.path))]
    problems = []
    for model in named:
        try:
            check_against_model(info, model, param="file", what="adapter")
            return
        except ApiError as exc:
            problems.append(exc)
    if problems:
        raise problems[0]


def _norm(name: str) -> str:
    return name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].casefold()


def check_against_model(info: AdapterInfo, model: BaseModelEntry, param: str = PARAM,
                        what: str = PARAM) -> None:
    """422 (param) unless the adapter was made for this base model: its recorded name, its
    target modules in the family, every module's features (module docstring)."""
    if info.base_model and _norm(info.base_model) not in (_norm(model.name), _norm(model.path)):
        raise invalid(f"{what} was made for base model {_norm(info.base_model)!r}, "
                      f"not {model.name!r}", param=param, code="adapter_model_mismatch")
    try:
        family = family_of(model_type_of(model.path) or model.family)
    except UnsupportedModel:
        return  # the create's own check names base_model
    try:
        resolve_targets(family, info.target_modules)
    except UnsupportedModel as exc:
        raise invalid(f"{what}: {exc}", param=param) from exc
    linears = base_linears(model.path)
    if linears is not None:
        _check_features(info, model, linears, param, what)


def _check_features(info: AdapterInfo, model: BaseModelEntry, linears: ModelLinears,
                    param: str, what: str) -> None:
    for module in info.modules:
        path = module.removeprefix(PEFT_PREFIX)
        short = path.rsplit(".", 1)[-1]
        try:
            want = linears.features(path)
        except KeyError:
            raise invalid(f"{what} adapts {path!r}, which {model.name!r} does not have",
                          param=param, code="adapter_model_mismatch") from None
        if want is not None and want != info.shapes[short]:
            raise invalid(f"{what}'s {short} has (in, out) features {info.shapes[short]}; "
                          f"{model.name!r}'s are {want}", param=param,
                          code="adapter_model_mismatch")


@dataclass(frozen=True)
class ModelLinears:
    """A base model's linears: exact (module path -> (in, out), from its weights), or by name
    (the Llama layout from its config: any layer below `layers`)."""

    exact: dict[str, tuple[int, int]] | None = None
    by_name: dict[str, tuple[int, int]] | None = None
    layers: int = 0

    def features(self, path: str) -> tuple[int, int] | None:
        """(in, out) of the module at `path`, None when unknown; KeyError when it is not there."""
        if self.exact is not None:
            # a checkpoint of the bare decoder (LlamaModel) names its weights without "model."
            for name in (path, path.split(".", 1)[-1]):
                if name in self.exact:
                    return self.exact[name]
            raise KeyError(path)
        m = _LAYER.search(path + ".")
        if m is None or int(m.group(1)) >= self.layers:
            raise KeyError(path)
        return (self.by_name or {}).get(path.rsplit(".", 1)[-1])


def base_linears(model_dir: str) -> ModelLinears | None:
    """The linears of a local model directory (ModelLinears); None when it cannot be read here."""
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors"))
    if files:
        try:
            stamp = tuple((str(f), f.stat().st_mtime_ns) for f in files)
            return ModelLinears(exact=dict(_weights_linears(stamp)))
        except (OSError, ValueError, AttributeError):
            pass
    try:
        cfg = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return _config_linears(cfg) if isinstance(cfg, dict) else None


@lru_cache(maxsize=32)
def _weights_linears(stamp: tuple[tuple[str, int], ...]) -> tuple[tuple[str, tuple[int, int]], ...]:
    """The 2-D weights' features from safetensors headers (no tensor read); `stamp`: the files
    with their mtimes, so a changed model is read again."""
    out = []
    for name, _ in stamp:
        with open(name, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > MAX_HEADER:
                raise ValueError(f"{name}: safetensors header too large")
            table = json.loads(fh.read(n))
        for key, t in table.items():
            shape = t.get("shape") if isinstance(t, dict) else None
            if key.endswith(".weight") and isinstance(shape, list) and len(shape) == 2:
                out.append((key.removesuffix(".weight"), (int(shape[1]), int(shape[0]))))
    return tuple(out)


def _config_linears(cfg: dict) -> ModelLinears | None:
    cfg = cfg.get("text_config") or cfg
    try:
        h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        hd = int(cfg.get("head_dim") or h // heads)
        inter, layers = int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    q, k = heads * hd, kv * hd
    return ModelLinears(by_name={
        "q_proj": (h, q), "k_proj": (h, k), "v_proj": (h, k), "o_proj": (q, h),
        "qkv_proj": (h, q + 2 * k), "gate_proj": (h, inter), "up_proj": (h, inter),
        "gate_up_proj": (h, 2 * inter), "down_proj": (inter, h)}, layers=layers)
