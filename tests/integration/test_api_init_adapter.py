"""Integration: a task that starts from an uploaded PEFT adapter (init_adapter_file). Each way an
adapter cannot start the task is a 422 naming the field at fault that stores nothing (no task,
job, event or Idempotency-Key); a good one fixes the task's rank, alpha and target modules,
searches the rest, and the placement a worker claims carries the archive's URL."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest

from service.models import File, new_id
from tests.integration.test_api_task_validation import counts, post_task, register_model

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from tests.unit.test_adapter_archive import _config, _tar, _weights  # noqa: E402

# a Llama of hidden 16, 2 heads (head_dim 8), intermediate 32, 2 layers
CONFIG = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 2,
          "num_key_value_heads": 2, "intermediate_size": 32, "num_hidden_layers": 2,
          "vocab_size": 64}
LINEARS = {"self_attn.q_proj": (16, 16), "self_attn.k_proj": (16, 16),
           "self_attn.v_proj": (16, 16), "self_attn.o_proj": (16, 16),
           "mlp.gate_proj": (32, 16), "mlp.up_proj": (32, 16), "mlp.down_proj": (16, 32)}


def _model(settings, root: Path, name: str, weights: bool = True) -> Path:  # noqa: ANN001
    """A registered base model: config.json, and its weights unless weights=False (then the
    shapes come from the config)."""
    model_dir = register_model(settings, root, name, CONFIG)
    if weights:
        tensors = {f"model.layers.{i}.{m}.weight": torch.zeros(shape)
                   for i in range(2) for m, shape in LINEARS.items()}
        tensors["model.embed_tokens.weight"] = torch.zeros(64, 16)
        (model_dir / "model.safetensors").write_bytes(safetensors_torch.save(tensors))
    return model_dir


def _archive(base: str | None = "adapter-llama", **weights) -> bytes:  # noqa: ANN003
    r = weights.pop("r", 4)
    targets = weights.pop("targets", ("q_proj", "v_proj"))
    extra = weights.pop("config", {})
    return _tar({"adapter_config.json": _config(r=r, targets=targets,
                                                base_model_name_or_path=base, **extra),
                 "adapter_model.safetensors": _weights(r=r, targets=targets, **weights)})


def _upload(client, tenant, body: bytes, **form: str):  # noqa: ANN001, ANN202
    return client.post("/v1/files", headers=tenant.headers, data={"purpose": "adapter"} | form,
                       files={"file": ("a.tar.gz", io.BytesIO(body), "application/gzip")})


def _adapter(client, tenant, *, base: str | None = "adapter-llama", **weights) -> str:  # noqa: ANN001
    res = _upload(client, tenant, _archive(base, **weights))
    assert res.status_code in (200, 201), res.text  # 200: the same bytes uploaded before
    return res.json()["id"]


def _stored_adapter(client, session, tenant, body: bytes) -> str:  # noqa: ANN001
    """An adapter stored as an upload before the upload checked what it can know (rank
    bounds, rsLoRA): the create's own checks must still refuse it."""
    file_id = new_id("file")
    key = f"files/{tenant.id}/{file_id}.adapter"
    client.app.state.storage.put(key, io.BytesIO(body))
    session.add(File(id=file_id, tenant_id=tenant.id, filename="old.tar.gz", purpose="adapter",
                     format="adapter", bytes=len(body), line_count=4,
                     sha256=hashlib.sha256(body).hexdigest(), storage_key=key))
    session.commit()
    return file_id


@pytest.fixture
def models(settings, tmp_path: Path) -> None:  # noqa: ANN001
    _model(settings, tmp_path / "models", "adapter-llama")
    _model(settings, tmp_path / "models", "config-llama", weights=False)


def test_every_bad_adapter_is_a_422_naming_the_field_and_storing_nothing(
        client, factory, session, models) -> None:  # noqa: ANN001
    t = factory.tenant()
    other = factory.tenant()
    train = factory.file(t)["id"]
    factory.task(t, train)  # so 'nothing stored' compares non-empty counts
    good = _adapter(client, t)
    base = {"base_model": "adapter-llama", "training_file": train, "max_seq_len": 128,
            "init_adapter_file": good}
    cases = [
        ("unknown file", {"init_adapter_file": "file_nope"}, "init_adapter_file"),
        ("another tenant's adapter", {"init_adapter_file": _adapter(client, other)},
         "init_adapter_file"),
        ("a training file", {"init_adapter_file": train}, "init_adapter_file"),
        ("rank conflicts", {"search_space": {"lora_rank": [8]}}, "search_space.lora_rank"),
        ("rank searched", {"search_space": {"lora_rank": [4, 8]}}, "search_space.lora_rank"),
        ("alpha conflicts", {"search_space": {"lora_alpha": [16]}}, "search_space.lora_alpha"),
        ("targets conflict", {"target_modules": ["q_proj"]}, "target_modules"),
        ("targets wider", {"target_modules": ["q_proj", "v_proj", "k_proj"]}, "target_modules"),
        ("another base model", {"init_adapter_file": _adapter(client, t, base="org/other-7b")},
         "init_adapter_file"),
        # adapters that record no base model: the upload cannot know the model they are for
        ("target not in the family",
         {"init_adapter_file": _adapter(client, t, base=None, targets=("c_attn",))},
         "init_adapter_file"),
        ("hidden size differs", {"init_adapter_file": _adapter(client, t, base=None, dim=32)},
         "init_adapter_file"),
        ("more layers than the model",
         {"init_adapter_file": _adapter(client, t, base=None, layers=3)}, "init_adapter_file"),
        ("config-only model, hidden size differs",
         {"base_model": "config-llama",
          "init_adapter_file": _adapter(client, t, base=None, dim=32)},
         "init_adapter_file"),
        ("config-only model, more layers",
         {"base_model": "config-llama",
          "init_adapter_file": _adapter(client, t, base=None, layers=3)},
         "init_adapter_file"),
        # stored before the upload refused them
        ("rank above 1024",
         {"init_adapter_file": _stored_adapter(client, session, t, _archive(r=1025, dim=2))},
         "init_adapter_file"),
        ("rsLoRA", {"init_adapter_file": _stored_adapter(
            client, session, t, _archive(config={"use_rslora": True}))}, "init_adapter_file"),
        ("shapes of a registered model the adapter names",
         {"init_adapter_file": _stored_adapter(client, session, t, _archive(dim=32))},
         "init_adapter_file"),
        ("empty id", {"init_adapter_file": ""}, "init_adapter_file"),
    ]
    before = counts(session, t.id)
    problems = []
    for case, overrides, param in cases:
        for dry in (False, True):
            path = "/v1/tasks?dry_run=true" if dry else "/v1/tasks"
            r = client.post(path, headers=t.headers | {"Idempotency-Key": "k1",
                                                       "Content-Type": "application/json"},
                            content=json.dumps(base | overrides))
            err = r.json().get("error") or {}
            if r.status_code != 422 or err.get("param") != param:
                problems.append((case, dry, r.status_code, r.text[:300]))
            session.expire_all()
            if counts(session, t.id) != before:
                problems.append((case, "stored", counts(session, t.id), before))
                before = counts(session, t.id)
    assert not problems, "\n".join(map(str, problems))
    r = post_task(client, t, base, key="k1")  # no rejected create claimed the key
    assert r.status_code == 201, r.text


def test_adapter_fixes_rank_alpha_targets_and_reaches_the_worker(
        client, factory, session, models) -> None:  # noqa: ANN001
    t = factory.tenant()
    train = factory.file(t)["id"]
    # the recorded base is a path to the same model elsewhere, in other case: accepted
    adapter = _adapter(client, t, base="/checkpoints/Adapter-LLAMA/")
    r = post_task(client, t, {"base_model": "adapter-llama", "training_file": train,
                              "max_seq_len": 128, "init_adapter_file": adapter,
                              "search_space": {"learning_rate": [1e-3, 1e-2],
                                               "batch_size": [2, 4]}})
    assert r.status_code == 201, r.text
    task = r.json()
    assert task["init_adapter_file"] == adapter
    assert task["search_space"]["lora_rank"] == [4]
    assert task["search_space"]["lora_alpha"] == [8.0]
    assert task["target_modules"] == ["q_proj", "v_proj"]
    jobs = client.get(f"/v1/tasks/{task['id']}/jobs", headers=t.headers).json()["data"]
    assert len(jobs) == 4 and {j["hyperparameters"]["lora_rank"] for j in jobs} == {4}
    listed = client.get("/v1/tasks", headers=t.headers).json()["data"]
    assert listed[0]["init_adapter_file"] == adapter  # the read path shows it too
    # naming exactly the adapter's values is accepted too (and on a config-only model)
    same = {"search_space": {"lora_rank": [4], "lora_alpha": [8]},
            "target_modules": ["v_proj", "q_proj"]}
    for model, file_id in (("adapter-llama", adapter),
                           ("config-llama", _adapter(client, t, base="config-llama"))):
        r = post_task(client, t, {"base_model": model, "training_file": train,
                                  "max_seq_len": 128, "init_adapter_file": file_id} | same)
        assert r.status_code == 201, r.text
    # the file a running task starts from cannot be deleted
    r = client.delete(f"/v1/files/{adapter}", headers=t.headers)
    assert r.status_code == 409, r.text
    # the worker's placement carries the archive, downloadable with the worker token
    node = factory.node()
    pid = factory.placement(task["id"], node)
    spec = client.post(f"/internal/v1/placements/{pid}/claim", headers=factory.worker,
                       json={"node_id": node}).json()
    assert spec["init_adapter_file_id"] == adapter
    blob = client.get(spec["init_adapter_url"], headers=factory.worker)
    assert blob.status_code == 200
    assert blob.content == client.get(f"/v1/files/{adapter}/content", headers=t.headers).content


def test_an_upload_refuses_what_it_can_know(client, factory, session, models) -> None:  # noqa: ANN001
    """Rank bounds, rsLoRA, and the fit to a registered base model (the one the upload names in
    `base_model`, else the one the adapter's base_model_name_or_path names) are a 422 at
    upload that stores nothing; an adapter for a model the registry lacks still uploads."""
    t = factory.tenant()
    cases = [
        ("rank above 1024", _archive(r=1025, dim=2), {}, "file"),
        ("rsLoRA", _archive(config={"use_rslora": True}), {}, "file"),
        ("alpha 0", _archive(config={"lora_alpha": 0}), {}, "file"),
        ("hidden size differs from the named model", _archive(dim=32), {}, "file"),
        ("more layers than the named model", _archive(layers=3), {}, "file"),
        ("config-only model, hidden size differs", _archive(base="config-llama", dim=32), {},
         "file"),
        ("target not in the named model's family", _archive(targets=("c_attn",)), {}, "file"),
        ("upload names another model", _archive(base="org/other-7b"),
         {"base_model": "adapter-llama"}, "file"),
        ("upload names a model, shapes differ", _archive(base=None, dim=32),
         {"base_model": "config-llama"}, "file"),
        ("upload names an unknown model", _archive(), {"base_model": "nope"}, "base_model"),
        ("base_model on a training file", None, {"base_model": "adapter-llama"}, "base_model"),
    ]
    problems = []
    for case, body, form, param in cases:
        if body is None:
            r = client.post("/v1/files", headers=t.headers, data=form, files={
                "file": ("t.jsonl", io.BytesIO(b'{"text": "a"}\n'), "application/jsonl")})
        else:
            r = _upload(client, t, body, **form)
        err = r.json().get("error") or {}
        if r.status_code != 422 or err.get("param") != param:
            problems.append((case, r.status_code, r.text[:300]))
    assert not problems, "\n".join(map(str, problems))
    assert client.get("/v1/files", headers=t.headers).json()["data"] == []
    # what fits, or names a model the registry lacks, uploads (the create checks it again)
    for body, form in ((_archive(), {}), (_archive(base=None), {"base_model": "adapter-llama"}),
                       (_archive(base="org/other-7b", dim=32), {}),
                       (_archive(base="config-llama"), {"base_model": "config-llama"})):
        r = _upload(client, t, body, **form)
        assert r.status_code == 201, r.text


def test_adapter_line_count_is_its_modules(client, factory, models) -> None:  # noqa: ANN001
    """2 layers x 7 target modules (attention and MLP) is 14 LoRA modules, as the README says."""
    t = factory.tenant()
    tensors = {}
    for i in range(2):
        for module, (fout, fin) in LINEARS.items():
            name = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.zeros(4, fin)
            tensors[f"{name}.lora_B.weight"] = torch.zeros(fout, 4)
    targets = [m.rsplit(".", 1)[-1] for m in LINEARS]
    body = _tar({"adapter_config.json": _config(r=4, targets=targets,
                                                base_model_name_or_path="adapter-llama"),
                 "adapter_model.safetensors": safetensors_torch.save(tensors)})
    r = _upload(client, t, body, base_model="adapter-llama")
    assert r.status_code == 201, r.text
    assert r.json()["line_count"] == 14
