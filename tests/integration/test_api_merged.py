"""Integration: merged model downloads through the API. A task's best adapter (or a job's) is
merged off the request path: POST queues it (once: asking again answers the same merge), the
leader's merger runs it, GET shows queued/running/succeeded, and the tar archive downloads whole
or by Range and loads with transformers as a plain model in the base's dtype. A merge that fails
shows a clear message and changes nothing else; bad input is a 4xx naming the field."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trainer.tiny import make_tiny_model  # noqa: E402


@pytest.fixture
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("merged-models")
    base = make_tiny_model("llama", root / "tiny-llama")
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).save_pretrained(base)
    wide = make_tiny_model("llama", root / "wide", hidden=96)
    return {"base": base, "good": _adapter(base, root / "good"),
            "bad": _adapter(wide, root / "bad")}


def _adapter(model_dir: Path, out: Path) -> Path:
    torch.manual_seed(3)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                      init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(out)
    return out


@pytest.fixture
def settings(settings, models):  # noqa: ANN001, ANN201 - the conftest's, with a real tiny model
    text = settings.models_file.read_text().replace("/models/tiny-llama", str(models["base"]))
    settings.models_file.write_text(text)
    os.utime(settings.models_file, (time.time() + 5, time.time() + 5))
    settings.merge_poll_s = 0.2
    return settings


def _upload(client, factory, tid: str, pid: str, job: str, adapter: Path) -> None:  # noqa: ANN001
    r = client.post(
        f"/internal/v1/tasks/{tid}/artifacts", headers=factory.worker,
        data={"meta": json.dumps({"kind": "adapter", "job_id": job, "placement_id": pid})},
        files=[("files", (name, io.BytesIO((adapter / name).read_bytes()), "x/y"))
               for name in ("adapter_config.json", "adapter_model.safetensors")])
    assert r.status_code == 201, r.text


def _succeeded_task(client, factory, tenant, models) -> tuple[str, str, str]:  # noqa: ANN001
    """A task whose best job j0 holds the good adapter and whose j1 holds one of another model."""
    task = factory.task(tenant, search_space={"learning_rate": [1e-4, 3e-4], "lora_rank": [4]})
    tid, w = task["id"], factory.worker
    node = factory.node("n-merged")
    pid = factory.placement(tid, node)
    assert client.post(f"/internal/v1/placements/{pid}/claim", headers=w,
                       json={"node_id": node}).status_code == 200
    j0, j1 = (j["id"] for j in client.get(f"/v1/tasks/{tid}/jobs",
                                            headers=tenant.headers).json()["data"])
    for job, loss in ((j0, 1.0), (j1, 2.0)):
        for body in ({"state": "running"},
                     {"state": "completed", "best_val_loss": loss, "best_step": 3}):
            r = client.post(f"/internal/v1/jobs/{job}/state", headers=w,
                            json={"placement_id": pid} | body)
            assert r.status_code == 200, r.text
    _upload(client, factory, tid, pid, j0, models["good"])
    _upload(client, factory, tid, pid, j1, models["bad"])
    # before the task succeeded there is no best adapter to merge
    r = client.post(f"/v1/tasks/{tid}/merged", headers=tenant.headers)
    assert r.status_code == 409 and r.json()["error"]["code"] == "task_not_succeeded"
    fin = client.post(f"/internal/v1/tasks/{tid}/finished", headers=w, json={"placement_id": pid})
    assert fin.json()["best_job_id"] == j0, fin.text
    return tid, j0, j1


def _wait(client, url: str, headers: dict) -> dict:  # noqa: ANN001
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        got = client.get(url, headers=headers).json()
        assert got["state"] in ("queued", "running", "succeeded", "failed"), got
        if got["state"] in ("succeeded", "failed"):
            return got
        time.sleep(0.2)
    raise AssertionError(f"merge still {got['state']}")


def test_merged_model_download(client, factory, models, tmp_path):  # noqa: ANN001
    t, other = factory.tenant(), factory.tenant()
    tid, j0, j1 = _succeeded_task(client, factory, t, models)
    url, h = f"/v1/tasks/{tid}/merged", t.headers

    # bad input: 4xx naming the field, nothing created
    for q, status in (({"job_id": ""}, 422), ({"job_id": "x" * 41}, 422),
                      ({"job_id": "job_nope"}, 404)):
        r = client.post(url, headers=h, params=q)
        assert r.status_code == status and r.json()["error"]["param"] == "job_id", r.text
    assert client.get(url, headers=h).status_code == 404
    assert client.get(f"{url}/content", headers=h).status_code == 404
    assert client.post("/v1/tasks/task_nope/merged", headers=h).status_code == 404

    first = client.post(url, headers=h)
    assert first.status_code == 202, first.text
    assert first.json()["job_id"] == j0 and first.json()["state"] in ("queued", "running")
    again = client.post(url, headers=h, params={"job_id": j0})
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    # another tenant sees nothing of it
    assert client.get(url, headers=other.headers).status_code == 404
    assert client.post(url, headers=other.headers).status_code == 404
    assert client.get(f"{url}/content", headers=other.headers).status_code == 404

    done = _wait(client, url, h)
    assert done["state"] == "succeeded" and done["dtype"] == "bfloat16", done
    assert done["error"] is None and done["bytes"] > 0 and done["base_model"] == "tiny-llama"
    assert client.post(url, headers=h).json()["id"] == first.json()["id"]  # stored once

    whole = client.get(f"{url}/content", headers=h)
    assert whole.status_code == 200 and whole.headers["accept-ranges"] == "bytes"
    assert len(whole.content) == done["bytes"] == int(whole.headers["content-length"])
    etag = whole.headers["etag"]
    head = client.get(f"{url}/content", headers=h | {"Range": "bytes=0-999"})
    assert head.status_code == 206 and len(head.content) == 1000
    assert head.headers["content-range"] == f"bytes 0-999/{done['bytes']}"
    rest = client.get(f"{url}/content", headers=h | {"Range": "bytes=1000-", "If-Range": etag})
    assert rest.status_code == 206 and head.content + rest.content == whole.content
    stale = client.get(f"{url}/content", headers=h | {"Range": "bytes=1000-",
                                                      "If-Range": '"other"'})
    assert stale.status_code == 200 and stale.content == whole.content
    past = client.get(f"{url}/content", headers=h | {"Range": f"bytes={done['bytes']}-"})
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{done['bytes']}"

    out = tmp_path / "merged"
    with tarfile.open(fileobj=io.BytesIO(whole.content)) as tf:
        names = tf.getnames()
        tf.extractall(out, filter="data")
    assert "config.json" in names and "tokenizer.json" in names
    assert not any(n.startswith("adapter") for n in names)
    ids = torch.randint(8, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out)
        assert merged.dtype == torch.bfloat16 and not hasattr(merged, "peft_config")
        ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
            models["base"], dtype="auto"), models["good"])(input_ids=ids).logits.float()
        got = merged(input_ids=ids).logits.float()
    assert ((got - ref).norm() / ref.norm()).item() < 4e-2

    # the shared download path: an adapter archive resumes by Range too
    full = client.get(f"/v1/jobs/{j0}/adapter", headers=h)
    part = client.get(f"/v1/jobs/{j0}/adapter", headers=h | {"Range": "bytes=10-"})
    assert part.status_code == 206 and part.content == full.content[10:]

    # a merge that cannot be done fails with a clear message and changes nothing else
    r = client.post(url, headers=h, params={"job_id": j1})
    assert r.status_code == 202 and r.json()["id"] != first.json()["id"]
    failed = _wait(client, url + f"?job_id={j1}", h)
    assert failed["state"] == "failed" and "does not fit the base model" in failed["error"]
    assert "/" not in failed["error"] and "Traceback" not in failed["error"], failed["error"]
    r = client.get(f"{url}/content", headers=h, params={"job_id": j1})
    assert r.status_code == 409 and r.json()["error"]["code"] == "merge_failed"
    task = client.get(f"/v1/tasks/{tid}", headers=h).json()
    assert task["state"] == "succeeded" and task["best_job_id"] == j0
    assert client.get(url, headers=h).json() == done
    assert client.get(f"{url}/content", headers=h).content == whole.content
