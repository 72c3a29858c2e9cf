"""Integration: a checkpoint's unchanged job files are not uploaded again. The daemon's forwarder
carries them from the last checkpoint the service stored (ArtifactMeta.carry_from, carried); the
service lists them in the new artifact pointing at the blob stored then (downloadable there), keeps
a blob while any artifact lists it (the older artifact replaced or gone) and deletes it after; a
carry it cannot honour is answered by uploading everything; a resume downloads every file."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx
from sqlalchemy import select

from service.models import Artifact
from worker.forwarder import Forwarder
from worker.service_client import ServiceClient
from worker.spool import SpoolWriter

SPACE = {"learning_rate": [1e-4, 3e-4], "lora_rank": [4]}


class Recording(httpx.BaseTransport):
    """The TestClient's transport, each response read whole; the file names of each upload."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner, self.uploads = inner, []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/artifacts"):
            body = request.read()
            self.uploads.append(sorted(part.split(b'"')[0].decode()
                                       for part in body.split(b'filename="')[1:]))
        r = self.inner.handle_request(request)
        return httpx.Response(r.status_code, headers=r.headers, content=r.read())


def checkpoint(spool: SpoolWriter, root: Path, step: int, files: dict[str, bytes]) -> None:
    d = root / "artifacts" / f"checkpoint-{step}"
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    spool.artifact(f"artifacts/checkpoint-{step}", kind="checkpoint", step=step)


def started(client, factory, node: str | None = None, attempt: int = 1, tid: str | None = None):  # noqa: ANN001, ANN201
    if tid is None:
        tid = factory.task(factory.tenant(), search_space=SPACE)["id"]
    node = node or factory.node()
    pid = factory.placement(tid, node, attempt=attempt)
    r = client.post(f"/internal/v1/placements/{pid}/claim", headers=factory.worker, json={"node_id": node})
    assert r.status_code == 200, r.text
    return tid, node, pid, r.json()


def artifact(session, tid: str, step: int) -> Artifact:  # noqa: ANN001
    session.expire_all()
    return session.scalar(select(Artifact).where(Artifact.task_id == tid, Artifact.key == f"checkpoint:{step}"))


def test_unchanged_job_files_are_carried_listed_and_kept(client, factory, session, settings, tmp_path) -> None:  # noqa: ANN001
    tid, node, pid, _ = started(client, factory)
    transport = Recording(client._transport)
    service = ServiceClient("http://testserver", factory.worker["Authorization"].split()[1], transport=transport)
    work = tmp_path / "pl"
    work.mkdir()
    spool = SpoolWriter(work / "spool.jsonl")
    parked = b"B" * 5000
    checkpoint(spool, work, 1, {"state.pt": b"S1", "job-a-1-t.pt": b"A1", "job-b-1-t.pt": parked})
    checkpoint(spool, work, 2, {"state.pt": b"S2", "job-a-2-t.pt": b"A2", "job-b-1-t.pt": parked})
    spool.close()
    fwd = Forwarder(service, work, tid, pid)
    assert fwd.pump() == 2
    assert transport.uploads == [["job-a-1-t.pt", "job-b-1-t.pt", "state.pt"],
                                 ["job-a-2-t.pt", "state.pt"]]  # the parked job's file once
    first, second = artifact(session, tid, 1), artifact(session, tid, 2)
    listed = {f["name"]: f for f in second.files}
    assert sorted(listed) == ["job-a-2-t.pt", "job-b-1-t.pt", "state.pt"]
    assert listed["job-b-1-t.pt"]["blob"] == f"artifacts/{first.id}/job-b-1-t.pt"
    assert listed["job-b-1-t.pt"]["bytes"] == len(parked)
    url = f"/internal/v1/artifacts/{second.id}/files/job-b-1-t.pt"
    assert client.get(url, headers=factory.worker).content == parked
    assert not (work / "artifacts" / "checkpoint-1").exists()  # superseded: its links go
    assert (work / "artifacts" / "checkpoint-2" / "job-b-1-t.pt").is_file()  # the last one stays
    assert fwd.state.checkpoint["artifact_id"] == second.id
    assert sorted(fwd.state.checkpoint["files"]) == sorted(listed)

    # the older artifact replaced (same key) without the file: the blob stays, the newer lists it
    r = client.post(f"/internal/v1/tasks/{tid}/artifacts", headers=factory.worker,
                    data={"meta": json.dumps({"kind": "checkpoint", "step": 1, "placement_id": pid})},
                    files=[("files", ("state.pt", io.BytesIO(b"S1'"), "x/y"))])
    assert r.status_code == 201 and [f["name"] for f in r.json()["files"]] == ["state.pt"]
    blobs = Path(settings.storage_dir) / "artifacts"
    assert not (blobs / first.id / "job-a-1-t.pt").exists()  # listed by nobody now: deleted
    assert (blobs / first.id / "job-b-1-t.pt").read_bytes() == parked
    assert client.get(url, headers=factory.worker).content == parked
    # and a later checkpoint carries it on (from the newer one's listing)
    spool = SpoolWriter(work / "spool.jsonl")
    checkpoint(spool, work, 3, {"state.pt": b"S3", "job-a-3-t.pt": b"A3", "job-b-1-t.pt": parked})
    spool.close()
    assert fwd.pump() == 1 and transport.uploads[-1] == ["job-a-3-t.pt", "state.pt"]
    third = artifact(session, tid, 3)
    assert {f["name"]: f.get("blob") for f in third.files}["job-b-1-t.pt"] == listed["job-b-1-t.pt"]["blob"]

    # the older artifact gone altogether: its blob still serves the newer ones
    session.delete(artifact(session, tid, 1))
    session.commit()
    assert client.get(f"/internal/v1/artifacts/{third.id}/files/job-b-1-t.pt",
                      headers=factory.worker).content == parked

    # a resume downloads every file of the newest checkpoint, the carried one included
    r = client.post(f"/internal/v1/tasks/{tid}/failed", headers=factory.worker,
                    json={"placement_id": pid, "error": "CUDA error", "retryable": True})
    assert r.json()["state"] == "queued"
    _, _, pid2, spec = started(client, factory, node, attempt=2, tid=tid)
    assert spec["resume_checkpoint_artifact_id"] == third.id
    got = {}
    for u in spec["resume_checkpoint_files"]:
        target = service.download(u, tmp_path / "resume" / u.rsplit("/", 1)[-1])
        got[target.name] = target.read_bytes()
    assert got == {"state.pt": b"S3", "job-a-3-t.pt": b"A3", "job-b-1-t.pt": parked}

    # the resumed placement's first checkpoint carries from the one it resumed from
    work2 = tmp_path / "pl2"
    work2.mkdir()
    (work2 / "spec.json").write_text(json.dumps(spec))
    spool = SpoolWriter(work2 / "spool.jsonl")
    checkpoint(spool, work2, 4, {"state.pt": b"S4", "job-a-4-u.pt": b"A4", "job-b-1-t.pt": parked})
    spool.close()
    assert Forwarder(service, work2, tid, pid2).pump() == 1
    assert transport.uploads[-1] == ["job-a-4-u.pt", "state.pt"]
    fourth = artifact(session, tid, 4)
    assert client.get(f"/internal/v1/artifacts/{fourth.id}/files/job-b-1-t.pt",
                      headers=factory.worker).content == parked


def test_a_carry_refused_uploads_everything(client, factory, session, tmp_path) -> None:  # noqa: ANN001
    tid, _, pid, _ = started(client, factory)
    transport = Recording(client._transport)
    service = ServiceClient("http://testserver", factory.worker["Authorization"].split()[1], transport=transport)
    work = tmp_path / "pl"
    work.mkdir()
    spool = SpoolWriter(work / "spool.jsonl")
    checkpoint(spool, work, 5, {"state.pt": b"S5", "job-b-1-t.pt": b"B"})
    spool.close()
    fwd = Forwarder(service, work, tid, pid)
    fwd.state.checkpoint = {"artifact_id": "art_gone", "files": ["state.pt", "job-b-1-t.pt"]}
    assert fwd.pump() == 1 and fwd.state.dropped == 0
    assert transport.uploads == [["state.pt"], ["job-b-1-t.pt", "state.pt"]]  # refused, then all
    stored = artifact(session, tid, 5)
    assert sorted(f["name"] for f in stored.files) == ["job-b-1-t.pt", "state.pt"]
    assert all("blob" not in f for f in stored.files)
    # another task's checkpoint cannot be carried from
    other, _, pid_o, _ = started(client, factory)
    r = client.post(f"/internal/v1/tasks/{other}/artifacts", headers=factory.worker,
                    data={"meta": json.dumps({"kind": "checkpoint", "step": 1, "placement_id": pid_o,
                                              "carry_from": stored.id, "carried": ["job-b-1-t.pt"]})},
                    files=[("files", ("state.pt", io.BytesIO(b"S"), "x/y"))])
    assert r.status_code == 409 and r.json()["error"]["code"] == "carry_unavailable"
