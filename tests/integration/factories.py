"""Factories for integration tests: tenants (with keys), files, tasks, nodes and placements,
built through the service's own functions and API so they stay valid as the code evolves."""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from service.core.config import Settings
from service.models import Node, Placement, Task, utcnow
from service.queue import publish_placement
from service.tenants import create_tenant

CHAT_LINES = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
    for i in range(12)
]


def jsonl(records: list[Any]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def safetensors_bytes(tensors: dict[str, tuple[list[int], bytes]] | None = None) -> bytes:
    """A valid safetensors blob (F32 tensors) written by hand, so tests need no torch."""
    tensors = tensors or {"base_model.model.lora_A.weight": ([2, 2], struct.pack("<4f", 1, 2, 3, 4))}
    header: dict[str, Any] = {}
    offset = 0
    for name, (shape, data) in tensors.items():
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(d for _, d in tensors.values())


@dataclass
class Tenant:
    id: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@dataclass
class Factory:
    session: Session
    client: TestClient
    settings: Settings
    _n: int = field(default=0)

    @property
    def worker(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.settings.worker_token}"}

    def tenant(self, name: str | None = None) -> Tenant:
        self._n += 1
        row, key = create_tenant(self.session, name or f"tenant-{self._n}")
        self.session.commit()
        return Tenant(id=row.id, key=key)

    def file(self, tenant: Tenant, records: list[Any] | None = None,
             filename: str = "train.jsonl") -> dict:
        body = jsonl(records if records is not None else CHAT_LINES)
        r = self.client.post("/v1/files", headers=tenant.headers,
                             files={"file": (filename, io.BytesIO(body), "application/jsonl")})
        assert r.status_code in (200, 201), r.text  # 200: the tenant's file of the same bytes
        return r.json()

    def task(self, tenant: Tenant, file_id: str | None = None, **overrides: Any) -> dict:
        body: dict[str, Any] = {
            "base_model": "tiny-llama",
            "training_file": file_id or self.file(tenant)["id"],
            "search_space": {"learning_rate": [1e-4, 3e-4], "lora_rank": [4, 8]},
            "max_seq_len": 128,
        }
        body.update(overrides)
        r = self.client.post("/v1/tasks", headers=tenant.headers, json=body)
        assert r.status_code == 201, r.text
        return r.json()

    def node(self, name: str | None = None, gpus: int = 2) -> str:
        self._n += 1
        r = self.client.post("/internal/v1/nodes", headers=self.worker, json={
            "name": name or f"node-{self._n}", "gpu_type": "H100-80GB", "gpu_count": gpus,
            "gpu_memory_bytes": 80 * 2**30})
        assert r.status_code == 200, r.text
        return r.json()["node_id"]

    def placement(self, task_id: str, node_id: str, gpus: tuple[int, ...] = (0,),
                  publish: bool = True, attempt: int = 1) -> str:
        """A placement as the scheduler would write it; published (queued in Redis) by default."""
        now = utcnow()
        assert self.session.get(Task, task_id) is not None
        assert self.session.get(Node, node_id) is not None
        p = Placement(task_id=task_id, node_id=node_id, gpu_indices=list(gpus),
                      planned_start=now, planned_end=now + timedelta(hours=1), attempt=attempt)
        self.session.add(p)
        self.session.flush()
        if publish:
            publish_placement(self.session, p, self.settings)
        self.session.commit()
        return p.id
