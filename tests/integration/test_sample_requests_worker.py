"""Integration: a node daemon answers a sample request (issue 44) on the tiny model. The daemon's
part (worker.sample_requests) claims it through the real internal API, fetches the stored adapter
and runs a fresh `python -m worker.sampler` process; the tenant then reads the completions, which
equal transformers' greedy generate (the plain model for the base row, PEFT with the adapter for
the job's row). A lingering shared executor answers on its own engine (worker.host's "sample"
request), and refuses while it hosts a task."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from contract.sample_requests import SampleAdapter, SampleWork  # noqa: E402
from trainer.task_samples import inline_prompt_ids  # noqa: E402
from trainer.tiny import make_tiny_model  # noqa: E402
from worker import sampler  # noqa: E402
from worker.config import DaemonConfig  # noqa: E402
from worker.host import Host  # noqa: E402
from worker.registration import Registration, detect_node  # noqa: E402
from worker.sample_requests import SampleRequests  # noqa: E402
from worker.service_client import ServiceClient  # noqa: E402
from worker.shared_hosts import SharedHosts  # noqa: E402

PROMPTS = ["Hello there", "The cat sat"]
NEW = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sample-models")
    base = make_tiny_model("llama", root / "tiny-llama")
    torch.manual_seed(3)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                      init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(root / "adapter")
    return {"base": base, "adapter": root / "adapter"}


@pytest.fixture
def settings(settings, models):  # noqa: ANN001, ANN201 - the conftest's, with the real tiny model
    text = settings.models_file.read_text().replace("/models/tiny-llama", str(models["base"]))
    settings.models_file.write_text(text)
    os.utime(settings.models_file, (time.time() + 5, time.time() + 5))
    return settings


class _Buffered(httpx.BaseTransport):
    """The TestClient's transport, each response read whole (the client streams downloads)."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = self.inner.handle_request(request)
        return httpx.Response(r.status_code, headers=r.headers, content=r.read())


def _succeeded_task(client, factory, tenant, adapter: Path) -> tuple[str, str, str]:  # noqa: ANN001
    task = factory.task(tenant, search_space={"learning_rate": [1e-4], "lora_rank": [4]})
    tid, w = task["id"], factory.worker
    node = factory.node("n-sampler", gpus=1)
    pid = factory.placement(tid, node)
    assert client.post(f"/internal/v1/placements/{pid}/claim", headers=w,
                       json={"node_id": node}).status_code == 200
    job = client.get(f"/v1/tasks/{tid}/jobs", headers=tenant.headers).json()["data"][0]["id"]
    for body in ({"state": "running"}, {"state": "completed", "best_val_loss": 1.0}):
        assert client.post(f"/internal/v1/jobs/{job}/state", headers=w,
                           json={"placement_id": pid} | body).status_code == 200
    r = client.post(
        f"/internal/v1/tasks/{tid}/artifacts", headers=w,
        data={"meta": json.dumps({"kind": "adapter", "job_id": job, "placement_id": pid})},
        files=[("files", (name, io.BytesIO((adapter / name).read_bytes()), "x/y"))
               for name in ("adapter_config.json", "adapter_model.safetensors")])
    assert r.status_code == 201, r.text
    assert client.post(f"/internal/v1/tasks/{tid}/finished", headers=w,
                       json={"placement_id": pid}).json()["state"] == "succeeded"
    return tid, job, node


def _expected(models: dict[str, Path], job: str) -> list[dict]:
    """transformers' own greedy completions: per prompt the plain model's, then PEFT's."""
    tok = AutoTokenizer.from_pretrained(models["base"])
    plain = AutoModelForCausalLM.from_pretrained(models["base"], dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(models["base"], dtype=torch.float32),
        str(models["adapter"])).eval()
    rows = []
    for text in PROMPTS:
        ids = torch.tensor([inline_prompt_ids(tok, text)])
        for job_id, model in ((None, plain), (job, peft)):
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=NEW, do_sample=False,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
            new = out[0, ids.shape[1]:].tolist()
            rows.append({"prompt": text, "job_id": job_id, "tokens": len(new),
                         "completion": tok.decode(new, skip_special_tokens=True)})
    return rows


def test_a_claimed_request_is_answered_by_a_fresh_sampler_process(client, factory, models, tmp_path) -> None:  # noqa: ANN001
    t = factory.tenant()
    tid, job, node = _succeeded_task(client, factory, t, models["adapter"])
    r = client.post(f"/v1/tasks/{tid}/samples", headers=t.headers,
                    json={"prompts": PROMPTS, "max_new_tokens": NEW})
    assert r.status_code == 202 and r.json()["job_ids"] == [job], r.text
    url = f"/v1/tasks/{tid}/samples/{r.json()['id']}"

    cfg = DaemonConfig(service_url="http://testserver", worker_token="", redis_url="",
                       node_name="n-sampler", work_dir=tmp_path / "work", sample_poll_s=0)
    service = ServiceClient("http://testserver", factory.worker["Authorization"].split()[1],
                            transport=_Buffered(client._transport))
    registration = Registration(cfg, service)
    registration.node_id, registration.node = node, detect_node(cfg)
    part = SampleRequests(cfg, service, registration, {}, SharedHosts(cfg, registration, {}))
    part.tend(accepting=True)
    assert part.busy and part.run.proc is not None  # no shared executor here: its own process
    deadline = time.monotonic() + 180
    while part.busy and time.monotonic() < deadline:
        time.sleep(0.2)
        part.tend(accepting=True)
    assert not part.busy, (part.run.directory / "sampler.log").read_text()
    got = client.get(url, headers=t.headers).json()
    assert got["state"] == "succeeded" and got["attempts"] == 1, got
    assert got["data"] == _expected(models, job)
    assert not (tmp_path / "work" / "samples" / got["id"]).exists()


def test_a_lingering_shared_executor_answers_on_its_engine(models, tmp_path) -> None:  # noqa: ANN001
    directory = tmp_path / "req"
    adapter = directory / sampler.ADAPTERS_NAME / "job_a"
    adapter.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (adapter / name).write_bytes((models["adapter"] / name).read_bytes())
    work = SampleWork(request_id="smpl_x", lease_token="t", lease_s=60, task_id="task_x", attempt=1,
                      base_model="tiny-llama", base_model_path=str(models["base"]), prompts=PROMPTS,
                      adapters=[SampleAdapter(job_id="job_a", files=[])], max_new_tokens=NEW,
                      temperature=0.0, top_p=1.0, seed=0)
    (directory / sampler.WORK_NAME).write_text(work.model_dump_json())
    engine, tok = sampler.load_engine(str(models["base"]), ["q_proj", "v_proj", "o_proj"])
    host = Host(tmp_path / "host", lease_timeout_s=60, linger_s=60)
    host.executor = SimpleNamespace(engine=engine, tokenizer=tok, tasks={"task_busy": object()})
    host.sample(directory)
    assert sampler.read_result(directory) == {"refused": "the warm executor was busy"}
    host.executor.tasks = {}
    host.sample(directory)
    assert sampler.read_result(directory)["samples"] == _expected(models, "job_a")
    assert not engine.jobs  # the adapters left the engine
