"""Integration: the adapter a tenant downloads is portable whatever the worker uploaded: its
adapter_config.json names the registered base model (not the worker's path to it) and holds only
the fields PEFT, vLLM and LoRAX accept; an adapter no server could load is a 422, nothing stored."""

from __future__ import annotations

import io
import json
import tarfile

from tests.integration.factories import safetensors_bytes


def _upload(client, factory, task_id: str, pid: str, job_id: str, cfg: dict):  # noqa: ANN001, ANN202
    return client.post(
        f"/internal/v1/tasks/{task_id}/artifacts", headers=factory.worker,
        data={"meta": json.dumps({"kind": "adapter", "job_id": job_id, "placement_id": pid})},
        files=[("files", ("adapter_config.json", io.BytesIO(json.dumps(cfg).encode()), "x/y")),
               ("files", ("adapter_model.safetensors", io.BytesIO(safetensors_bytes()), "x/y"))])


def test_downloaded_config_names_the_registered_model_only(client, factory):  # noqa: ANN001
    t = factory.tenant()
    task = factory.task(t)
    jobs = client.get(f"/v1/tasks/{task['id']}/jobs", headers=t.headers).json()["data"]
    node = factory.node("n-adapters")
    pid = factory.placement(task["id"], node)
    assert client.post(f"/internal/v1/placements/{pid}/claim", headers=factory.worker,
                       json={"node_id": node}).status_code == 200
    # refused: DoRA / modules_to_save / LoRA on lm_head; nothing is stored
    base = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    for bad in ({"use_dora": True}, {"modules_to_save": ["lm_head", "embed_tokens"]},
                {"target_modules": ["q_proj", "lm_head"]}, {"r": "8"}):
        r = _upload(client, factory, task["id"], pid, jobs[0]["id"], base | bad)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "invalid_adapter" and r.json()["error"]["param"] \
            == "files"
    assert client.get(f"/v1/jobs/{jobs[0]['id']}/adapter", headers=t.headers).status_code == 404
    # accepted: a worker's config with its model path and fields only newer PEFT knows
    worker_cfg = base | {"base_model_name_or_path": "/var/lib/loraplex/models/tiny-llama",
                         "lora_alpha": 16.0, "use_dora": False, "megatron_config": None,
                         "layer_replication": None, "task_type": "CAUSAL_LM"}
    r = _upload(client, factory, task["id"], pid, jobs[0]["id"], worker_cfg)
    assert r.status_code == 201, r.text
    got = client.get(f"/v1/jobs/{jobs[0]['id']}/adapter", headers=t.headers)
    assert got.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(got.content), mode="r:gz") as tf:
        cfg = json.loads(tf.extractfile("adapter_config.json").read())
    assert cfg == {"peft_type": "LORA", "task_type": "CAUSAL_LM",
                   "base_model_name_or_path": task["base_model"], "r": 8, "lora_alpha": 16,
                   "lora_dropout": 0.0, "target_modules": ["q_proj"], "bias": "none",
                   "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": None,
                   "inference_mode": True}
