"""Reading tracking runs back in tests: a real MLflow tracking server (SQLite store) started for
the test and read through its REST API, and W&B offline run files read record by record. Used by
tests/integration/test_tracking.py and the e2e tracking test."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from service.core.localstack import free_port


class MlflowServer:
    """A real MLflow tracking server (SQLite store under root) started in the background:
    `url` at once, `wait_ready()` when the test needs it answering (it takes a while to start),
    `stop()` the server and the workers it started."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"http://127.0.0.1:{free_port()}"
        self._log = open(root / "server.log", "wb")  # noqa: SIM115 - closed by stop()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
             f"sqlite:///{root / 'mlflow.db'}", "--default-artifact-root",
             str(root / "artifacts"), "--host", "127.0.0.1", "--port",
             self.url.rsplit(":", 1)[1], "--workers", "1"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root)

    def wait_ready(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("mlflow server did not start: "
                                   + (self.root / "server.log").read_text()[-2000:])
            time.sleep(0.5)

    def stop(self) -> None:
        os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._log.close()


@contextmanager
def mlflow_server(root: Path) -> Iterator[str]:
    """A real MLflow tracking server, answering; its URL. Stopped on exit."""
    server = MlflowServer(root)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


class Mlflow:
    """A test's reads of the tracking server, through its REST API."""

    def __init__(self, url: str) -> None:
        self.api = f"{url}/api/2.0/mlflow/"

    def get(self, endpoint: str, **params: object) -> dict:
        r = httpx.get(self.api + endpoint, params=params, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def runs(self, experiment_id: str, task_id: str) -> list[dict]:
        r = httpx.post(self.api + "runs/search", timeout=10, json={
            "experiment_ids": [experiment_id], "max_results": 100,
            "filter": f"tags.`loraplex.task_id` = '{task_id}'"})
        assert r.status_code == 200, r.text
        return r.json().get("runs", [])

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        found = self.get("metrics/get-history", run_id=run_id, metric_key=key)
        return sorted((m["step"], m["value"]) for m in found.get("metrics", []))


def tags(run: dict) -> dict[str, str]:
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}


def params(run: dict) -> dict[str, str]:
    return {p["key"]: p["value"] for p in run["data"].get("params", [])}


def wandb_records(path: Path) -> Iterator[object]:
    """The protobuf records of a .wandb run file: a 7-byte header (":W&B", magic, version), then
    32 KiB blocks of records, each with a 7-byte header (CRC-32C, length, type: full, first,
    middle, last), as W&B's leveldb-style log writes them."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        else:
            pending += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def item_key(item) -> str:  # noqa: ANN001 - a history or summary item: key, or nested_key
    return item.key or "/".join(item.nested_key)


def read_run(path: Path) -> dict:
    """A run file's run (id, project, entity, name, group, tags, config), history and summary."""
    out: dict = {"history": [], "summary": {}}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            out.update(id=run.run_id, project=run.project, entity=run.entity,
                       name=run.display_name, group=run.run_group, tags=list(run.tags),
                       config={i.key: json.loads(i.value_json) for i in run.config.update
                               if not i.key.startswith("_")})
        elif kind == "history":
            out["history"].append({item_key(i): json.loads(i.value_json)
                                   for i in record.history.item})
        elif kind == "summary":
            out["summary"].update({item_key(i): json.loads(i.value_json)
                                   for i in record.summary.update})
    return out
