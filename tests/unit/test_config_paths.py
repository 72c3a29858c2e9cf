"""Unit: the settings' directories are absolute from the moment they load (issue 43: the quick
start's relative LORAPLEX_WANDB_DIR named another folder inside the W&B writer's scratch dir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.core.config import Settings


def test_relative_directories_resolve_against_the_start_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LORAPLEX_WANDB_DIR", "runs/wandb")
    monkeypatch.delenv("LORAPLEX_STORAGE_DIR", raising=False)
    monkeypatch.delenv("LORAPLEX_MODELS_FILE", raising=False)
    settings = Settings(_env_file=None)
    assert settings.wandb_dir == tmp_path / "runs" / "wandb"
    assert settings.storage_dir == tmp_path / "var" / "storage"
    assert settings.models_file == tmp_path / "var" / "models.yaml"
    monkeypatch.chdir("/")  # a later change of directory moves nothing
    assert settings.wandb_dir == tmp_path / "runs" / "wandb"
