"""The base of every shape the contract declares: pydantic's BaseModel with unknown fields refused,
or its plain stand-in (contract._plain_models) where only torch and transformers are installed."""

from __future__ import annotations

try:
    from pydantic import BaseModel, ConfigDict, Field, model_validator
except ImportError:  # torch + transformers alone (a bare GPU image): same shapes, no validation
    from contract._plain_models import (  # type: ignore[assignment]
        BaseModel,
        ConfigDict,
        Field,
        model_validator,
    )


__all__ = ["BaseModel", "ConfigDict", "Field", "Message", "model_validator"]  # the others' one import


class Message(BaseModel):
    """A contract shape: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")
