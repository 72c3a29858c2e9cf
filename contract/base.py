"""The base of every shape the contract declares: pydantic's BaseModel with unknown fields refused,
or its plain stand-in (contract._plain_models) where only torch and transformers are installed."""

from __future__ import annotations

from typing import Annotated, Any

try:
    from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
except ImportError:  # torch + transformers alone (a bare GPU image): same shapes, no validation
    from contract._plain_models import (  # type: ignore[assignment]
        BaseModel,
        ConfigDict,
        Field,
        model_validator,
    )

    BeforeValidator = None  # type: ignore[assignment,misc]


__all__ = ["BaseModel", "ConfigDict", "Count", "Field", "Message",  # the others' one import
           "count", "model_validator"]


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def count(**bounds: Any) -> Any:
    """The type of a count a node reports, within `bounds` (ge, lt, ...): JSON Schema's `integer`
    holds 8.0 too, so that is 8; 8.5, "8" and true are not counts (strict). The validator comes
    after the bounds, so that the schema states them."""
    if BeforeValidator is None:
        return int
    return Annotated[int, Field(strict=True, **bounds), BeforeValidator(_whole)]


Count = count()


class Message(BaseModel):
    """A contract shape: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")
