"""Blob storage for uploaded files and artifacts behind one small interface.
LocalStorage keeps blobs in a directory; an object store only has to implement Storage."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

CHUNK = 1024 * 1024


class Storage(Protocol):
    """Keys are relative slash-separated paths such as ``files/<tenant>/<file id>``."""

    def put(self, key: str, src: BinaryIO) -> int:
        """Store the stream under key (atomically replacing it); return its size in bytes."""
        ...

    def open(self, key: str) -> BinaryIO:
        ...

    def iter_bytes(self, key: str, chunk: int = CHUNK) -> Iterator[bytes]:
        ...

    def size(self, key: str) -> int:
        ...

    def exists(self, key: str) -> bool:
        ...

    def delete(self, key: str) -> None:
        """Remove key; a missing key is not an error."""
        ...


class LocalStorage:
    """Blobs as files under root; writes go to a temp file then rename, so readers never see
    half a blob."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root not in path.parents:
            raise ValueError(f"storage key escapes the root: {key!r}")
        return path

    def put(self, key: str, src: BinaryIO) -> int:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(src, out, CHUNK)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path.stat().st_size

    def open(self, key: str) -> BinaryIO:
        return self._path(key).open("rb")

    def iter_bytes(self, key: str, chunk: int = CHUNK) -> Iterator[bytes]:
        with self.open(key) as f:
            while block := f.read(chunk):
                yield block

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
