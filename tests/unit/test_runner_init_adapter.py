"""Unit: the worker's half of starting from an uploaded adapter. The client fetches the archive
the placement names (once per file id), the runner unpacks its two PEFT files (nothing else of
it) into the placement's folder and hands that folder to every job as JobSpec.init_adapter."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.unit.test_daemon_runner import spec
from worker import runner
from worker.runner import INIT_ADAPTER_ARCHIVE
from worker.service_client import ServiceClient

FILES = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"weights"}


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()


@pytest.mark.parametrize("make,folder", [(_tar, ""), (_tar, "./ad/"), (_zip, ""), (_zip, "ad/")])
def test_unpack_keeps_only_the_two_files(tmp_path: Path, make, folder: str) -> None:  # noqa: ANN001
    files = {folder + k: v for k, v in FILES.items()}
    files |= {"../evil.json": b"x", "a/b/adapter_config.json": b"deep", folder + "README": b"r"}
    archive = tmp_path / "a.archive"
    archive.write_bytes(make(files))
    out = runner.unpack_adapter(archive, tmp_path / "out")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == FILES
    assert not (tmp_path / "evil.json").exists()


def test_unpack_refuses_an_archive_without_the_files(tmp_path: Path) -> None:
    archive = tmp_path / "a.archive"
    archive.write_bytes(_tar({"adapter_config.json": b"{}"}))
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        runner.unpack_adapter(archive, tmp_path / "out")
    archive.write_bytes(b"not an archive")
    with pytest.raises(ValueError, match="unreadable"):
        runner.unpack_adapter(archive, tmp_path / "out")


def test_every_job_starts_from_the_fetched_adapter(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    url = "/internal/v1/files/file_ad/content"
    s = spec(init_adapter_file_id="file_ad", init_adapter_url=url)
    fresh = runner.executor_config(spec(), tmp_path)
    assert [j.init_adapter for j in fresh.jobs] == [None]
    with pytest.raises(FileNotFoundError):  # the daemon did not fetch it: not retryable
        runner.executor_config(s, tmp_path)

    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(200, content=_tar(FILES))

    client = ServiceClient("http://svc", "tok", transport=httpx.MockTransport(handler))
    (tmp_path / "data").mkdir()
    for _ in range(2):  # cached per file id: one download
        got = client.fetch_init_adapter(s, tmp_path / "data" / INIT_ADAPTER_ARCHIVE, tmp_path / "cache")
        assert got == tmp_path / "data" / INIT_ADAPTER_ARCHIVE
    assert calls == [url]
    assert client.fetch_init_adapter(spec(), tmp_path / "data" / INIT_ADAPTER_ARCHIVE, tmp_path / "cache") is None
    cfg = runner.executor_config(s, tmp_path)
    start = tmp_path / "init_adapter"
    assert [j.init_adapter for j in cfg.jobs] == [str(start)]
    assert (start / "adapter_model.safetensors").read_bytes() == b"weights"
