"""What contract.protocol needs of pydantic, for a machine that has torch and transformers alone
(a bare GPU image running the trainer, its tests or benchmarks): plain objects with the same
fields and defaults, built from keyword arguments, WITHOUT validation. Bounds are enforced where
settings enter the system (the API, with pydantic, 422 on bad values) and where a placement is
parsed (the runner, which needs pydantic like the rest of the node agent); here they are only
carried. Never imported where pydantic exists.
"""

from __future__ import annotations

import copy
from typing import Any

_MISSING = object()


class FieldInfo:
    def __init__(self, default: Any = _MISSING, default_factory: Any = None) -> None:
        self.default, self.default_factory = default, default_factory


def Field(default: Any = _MISSING, *, default_factory: Any = None, **_: Any) -> Any:  # noqa: N802
    return FieldInfo(default, default_factory)


def ConfigDict(**kw: Any) -> dict[str, Any]:  # noqa: N802
    return kw


def model_validator(*, mode: str) -> Any:
    """pydantic's decorator for mode="before" only: the class method rewrites the keyword
    arguments before the fields are set."""
    if mode != "before":
        raise NotImplementedError("only model_validator(mode='before') is mirrored")

    def mark(fn: Any) -> classmethod:
        func = fn.__func__ if isinstance(fn, classmethod) else fn
        func._plain_before = True
        return classmethod(func)

    return mark


class BaseModel:
    """Fields are the annotated names of the class and its bases, in order."""

    model_config: dict[str, Any] = {}
    _fields: tuple[str, ...] = ()
    _defaults: dict[str, FieldInfo] = {}
    _before: tuple[str, ...] = ()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        names: list[str] = []
        defaults: dict[str, FieldInfo] = {}
        for klass in reversed(cls.__mro__):
            for name in vars(klass).get("__annotations__", {}):
                if name.startswith("_") or name == "model_config":
                    continue
                if name not in names:
                    names.append(name)
                value = vars(klass).get(name, _MISSING)
                if value is not _MISSING:
                    defaults[name] = value if isinstance(value, FieldInfo) else FieldInfo(value)
        # every field is set on the instance, so these class attributes are never read as values
        cls._fields, cls._defaults = tuple(names), defaults
        cls.model_fields = {n: defaults.get(n, FieldInfo()) for n in names}  # pydantic's name for them
        cls._before = tuple(name for klass in cls.__mro__ for name, v in vars(klass).items()
                            if isinstance(v, classmethod) and getattr(v.__func__, "_plain_before", False))

    def __init__(self, **data: Any) -> None:
        for name in self._before:
            data = getattr(type(self), name)(data)
        unknown = set(data) - set(self._fields)
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown fields {sorted(unknown)}")
        for name in self._fields:
            if name in data:
                value = data[name]
            else:
                info = self._defaults.get(name)
                if info is None or (info.default is _MISSING and info.default_factory is None):
                    raise TypeError(f"{type(self).__name__}: field {name!r} is required")
                value = info.default_factory() if info.default_factory else copy.copy(info.default)
            object.__setattr__(self, name, value)

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._fields}

    def model_copy(self, update: dict[str, Any] | None = None, **_: Any) -> Any:
        return type(self)(**{**self.model_dump(), **(update or {})})

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.model_dump() == other.model_dump()

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.model_dump().items())
        return f"{type(self).__name__}({body})"
