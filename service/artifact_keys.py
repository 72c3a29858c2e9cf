"""Where an artifact's files lie in storage, declared once for every module that writes, reads or
deletes them (service.artifact_store, the adapter downloads of service.adapters, the merger of
service.merged, the internal file route): a file uploaded to an artifact under
``artifacts/<artifact id>/<name>``; a checkpoint's file carried unchanged from an earlier one
under the key its listing's ``blob`` names (the blob stored then). A module of its own so that
service.adapters, which service.artifact_store imports, can use it too."""

from __future__ import annotations

from collections.abc import Mapping

from service.models import Artifact


def file_key(artifact_id: str, name: str) -> str:
    """The key a file uploaded to an artifact is stored under."""
    return f"artifacts/{artifact_id}/{name}"


def blob_key(artifact: Artifact, entry: Mapping) -> str:
    """Where a listed file's bytes are stored: its own blob, or the one it was carried from."""
    return entry.get("blob") or file_key(artifact.id, entry["name"])


def blob_owner(key: str) -> tuple[str, str]:
    """The artifact a blob was uploaded to and the file's name there (file_key's inverse)."""
    _, artifact_id, name = key.split("/", 2)
    return artifact_id, name
