"""Integration: a task that starts from an uploaded PEFT adapter (init_adapter_file). Each way an
adapter cannot start the task is a 422 naming the field at fault that stores nothing (no task,
job, event or Idempotency-Key); a good one fixes the task's rank, alpha and target modules,
searches the rest, and the placement a worker claims carries the archive's URL."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

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


def _adapter(client, tenant, *, base: str = "adapter-llama", **weights) -> str:  # noqa: ANN001
    r = weights.pop("r", 4)
    targets = weights.pop("targets", ("q_proj", "v_proj"))
    extra = weights.pop("config", {})
    body = _tar({"adapter_config.json": _config(r=r, targets=targets,
                                                base_model_name_or_path=base, **extra),
                 "adapter_model.safetensors": _weights(r=r, targets=targets, **weights)})
    res = client.post("/v1/files", headers=tenant.headers, data={"purpose": "adapter"},
                      files={"file": ("a.tar.gz", io.BytesIO(body), "application/gzip")})
    assert res.status_code == 201, res.text
    return res.json()["id"]


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
        ("target not in the family",
         {"init_adapter_file": _adapter(client, t, targets=("c_attn",))}, "init_adapter_file"),
        ("hidden size differs", {"init_adapter_file": _adapter(client, t, dim=32)},
         "init_adapter_file"),
        ("more layers than the model", {"init_adapter_file": _adapter(client, t, layers=3)},
         "init_adapter_file"),
        ("config-only model, hidden size differs",
         {"base_model": "config-llama",
          "init_adapter_file": _adapter(client, t, base="config-llama", dim=32)},
         "init_adapter_file"),
        ("config-only model, more layers",
         {"base_model": "config-llama",
          "init_adapter_file": _adapter(client, t, base="config-llama", layers=3)},
         "init_adapter_file"),
        ("rank above 1024", {"init_adapter_file": _adapter(client, t, r=1025, dim=2)},
         "init_adapter_file"),
        ("rsLoRA", {"init_adapter_file": _adapter(client, t, config={"use_rslora": True})},
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
