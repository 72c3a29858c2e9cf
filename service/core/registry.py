"""The operator's registry of base models (local directories), loaded from a YAML file:
a list (or ``{models: [...]}``) of {name, path, parameters, gpus, max_seq_len, family}."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, Field, ValidationError


class BaseModelEntry(BaseModel):
    name: str = Field(min_length=1)
    path: str = Field(min_length=1, description="Local directory from_pretrained loads.")
    parameters: int | None = Field(default=None, ge=0)
    gpus: int = Field(default=1, ge=1)
    max_seq_len: int = Field(default=2048, ge=16)
    family: str | None = None


class ModelRegistry:
    """Read-only view of the models file; reloads when the file's mtime changes."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._mtime: float | None = None
        self._models: dict[str, BaseModelEntry] = {}

    def _load(self) -> None:
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            self._models, self._mtime = {}, None
            return
        if mtime == self._mtime:
            return
        raw = yaml.safe_load(self.path.read_text()) or []
        if isinstance(raw, dict):
            raw = raw.get("models", [])
        try:
            entries = [BaseModelEntry.model_validate(item) for item in raw]
        except ValidationError as exc:
            raise RuntimeError(f"invalid models file {self.path}: {exc}") from exc
        self._models = {e.name: e for e in entries}
        self._mtime = mtime

    def all(self) -> list[BaseModelEntry]:
        self._load()
        return sorted(self._models.values(), key=lambda e: e.name)

    def get(self, name: str) -> BaseModelEntry | None:
        self._load()
        return self._models.get(name)
