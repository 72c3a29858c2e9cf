"""Integration: the task contract end to end on the service side. Every field a tenant can set
on POST /v1/tasks reaches the trainer unchanged: the task is created, its placement claimed
through the internal API, and worker.runner.executor_config() builds the trainer's config from
the claimed PlacementSpec, as the executor does. A new TaskCreate field fails the table test
until it is listed. Also: a DPO task claims with beta in every job, and what a tenant reads of a
failure is short and safe (no traceback, no server path)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import select

from contract.protocol import PlacementSpec, TaskSettings
from service.models import Placement
from service.schemas import PlacementOut, TaskCreate
from tests.integration.test_api_task_validation import register_model

pytest.importorskip("torch")
from worker.runner import executor_config  # noqa: E402

PREFERENCES = [{"prompt": f"p{i}", "chosen": "good", "rejected": "bad"} for i in range(10)]


@dataclass(frozen=True)
class Ctx:
    """What a row's expectation may refer to: the placement's directory, files, models."""

    directory: Path
    files: dict[str, str]  # name in a row ('@val') -> uploaded file id
    model_dir: Path


@dataclass(frozen=True)
class Row:
    body: dict[str, Any]  # the task's fields besides the base body ('@name' = uploaded file)
    got: Callable[[Any, PlacementSpec], Any]  # (ExecutorConfig, spec) -> what arrived
    want: Any  # a value, or a function of Ctx

    def expected(self, ctx: Ctx) -> Any:
        return self.want(ctx) if callable(self.want) else self.want


def _knob(attr: str) -> Callable[[Any, PlacementSpec], list]:
    return lambda cfg, _: [getattr(job, attr) for job in cfg.jobs]


def _early(name: str, value: Any) -> tuple[str, Row]:
    return f"early_exit.{name}", Row({"early_exit": {name: value}},
                                     lambda cfg, _: getattr(cfg.settings.early_exit, name), value)


def _eval(name: str, value: Any) -> tuple[str, Row]:
    return f"eval.{name}", Row({"eval": {name: value}}, lambda cfg, _: getattr(cfg.settings.eval, name),
                               value)


DPO = {"method": "dpo", "training_file": "@pref"}
# One row per way a field reaches the executor (a field may have several rows). Each row's value
# differs from the field's default, so an ignored value fails the comparison.
TABLE: list[tuple[str, Row]] = [
    ("base_model", Row({"base_model": "contract-phi3", "target_modules": ["qkv_proj"]},
                       lambda cfg, spec: (spec.base_model, cfg.model_dir, cfg.targets),
                       lambda ctx: ("contract-phi3", str(ctx.model_dir), ("qkv_proj",)))),
    ("training_file", Row({"training_file": "@other"},
                          lambda cfg, spec: (spec.training_file_id, spec.training_file_url,
                                             spec.training_file_format, cfg.train_file),
                          lambda ctx: (ctx.files["@other"],
                                       f"/internal/v1/files/{ctx.files['@other']}/content",
                                       "completion", str(ctx.directory / "data/train.jsonl")))),
    ("validation_file", Row({"validation_file": "@val"},
                            lambda cfg, spec: (spec.validation_file_id, spec.validation_file_url,
                                               cfg.val_file),
                            lambda ctx: (ctx.files["@val"],
                                         f"/internal/v1/files/{ctx.files['@val']}/content",
                                         str(ctx.directory / "data/validation.jsonl")))),
    ("validation_split", Row({"validation_split": 0.25}, lambda cfg, _: cfg.settings.validation_split, 0.25)),
    ("method", Row(DPO, lambda cfg, _: (cfg.method, [j.beta for j in cfg.jobs]), ("dpo", [0.1]))),
    ("search_space.learning_rate", Row({"search_space": {"learning_rate": [3e-4, 1e-3]}},
                                       _knob("learning_rate"), [3e-4, 1e-3])),
    ("search_space.lora_rank", Row({"search_space": {"lora_rank": [2, 16]}}, _knob("lora_rank"),
                                   [2, 16])),
    ("search_space.lora_alpha", Row({"search_space": {"lora_alpha": [4.0, 32.5]}},
                                    _knob("lora_alpha"), [4.0, 32.5])),
    ("search_space.batch_size", Row({"search_space": {"batch_size": [1, 3]}},
                                    _knob("batch_size"), [1, 3])),
    ("search_space.beta", Row(DPO | {"search_space": {"beta": [0.05, 2.5]}}, _knob("beta"),
                              [0.05, 2.5])),
    ("search_space.orpo_lambda", Row({"method": "orpo", "training_file": "@pref",
                                      "search_space": {"orpo_lambda": [0.05, 2.5]}},
                                     lambda cfg, _: (cfg.method, [j.knob("orpo_lambda") for j in cfg.jobs]),
                                     ("orpo", [0.05, 2.5]))),
    ("epochs", Row({"epochs": 3}, _knob("epochs"), [3.0])),
    ("max_seq_len", Row({"max_seq_len": 96}, lambda cfg, _: cfg.max_seq_len, 96)),
    ("max_seq_len", Row({"max_seq_len": None}, lambda cfg, _: cfg.max_seq_len, 512)),
    ("seed", Row({"seed": 7, "search_space": {"lora_rank": [4, 8]}},
                 lambda cfg, _: (cfg.settings.seed, [j.seed for j in cfg.jobs]), (7, [7, 8]))),
    _early("enabled", False),
    _early("window", 5),
    _early("patience", 4),
    _early("tau_gap", 0.35),
    _early("tau_slope", 0.02),
    _early("warmup_fraction", 0.2),
    _early("keep_fraction", 0.5),
    _early("ema_alpha", 0.3),
    _eval("eval_every_steps", 7),
    _eval("eval_max_samples", 33),
    _eval("eval_max_samples", None),
    _eval("eval_every_samples", 64),
    _eval("eval_samples_per_trained", 0.5),
    _eval("eval_samples_per_trained", None),
    _eval("eval_min_samples", 16),
    ("target_modules", Row({"target_modules": ["v_proj", "q_proj"]},
                           lambda cfg, _: cfg.targets, ("v_proj", "q_proj"))),
]
# Fields that stay in the service (the scheduler's business), never sent to the trainer.
SERVICE_ONLY = {"priority", "suffix", "metadata",  # suffix, metadata: the tenant's labels
                "integrations"}  # synced by the service's leader from PostgreSQL, never a node
# Fields that reach the trainer through a file the daemon fetches: proved by the tests named
# (the runner unpacks what the placement names; a real daemon's first loss is the adapter's).
CHECKED_ELSEWHERE = {"init_adapter_file": ("tests/unit/test_runner_init_adapter.py",
                                           "tests/e2e/test_init_adapter_e2e.py")}
BASE = {"base_model": "tiny-llama", "training_file": "@chat", "max_seq_len": 128}


def leaf_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Dotted names of every settable field of a request model, nested settings expanded."""
    out: set[str] = set()
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out |= leaf_fields(field.annotation, f"{prefix}{name}.")
        else:
            out.add(prefix + name)
    return out


def value_at(body: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        body = body[part]
    return body


def test_table_lists_every_task_field() -> None:
    """A new field of TaskCreate must get a row, be declared service-only, or be a task setting
    (contract.protocol.TaskSettings, which the executor holds as sent:
    test_the_executor_holds_the_task_settings_as_sent): otherwise nobody checked that it
    reaches the trainer."""
    keys = {key for key, _ in TABLE}
    assert keys.isdisjoint(SERVICE_ONLY) and keys.isdisjoint(CHECKED_ELSEWHERE)
    assert leaf_fields(TaskCreate) - leaf_fields(TaskSettings) <= keys | SERVICE_ONLY | set(CHECKED_ELSEWHERE)
    assert keys | SERVICE_ONLY | set(CHECKED_ELSEWHERE) <= leaf_fields(TaskCreate)
    repo = Path(__file__).resolve().parents[2]
    for field_name, tests in CHECKED_ELSEWHERE.items():
        for test in tests:
            assert field_name in (repo / test).read_text(), (field_name, test)
    defaults = TaskCreate.model_validate(BASE).model_dump(mode="json")
    for key, row in TABLE:
        assert value_at(row.body, key) != value_at(defaults, key), key


def _claimed_spec(client, factory, tenant, body: dict, node: str,  # noqa: ANN001
                  gpus: tuple[int, ...] = (0,)) -> PlacementSpec:
    r = client.post("/v1/tasks", headers=tenant.headers, json=body)
    assert r.status_code == 201, r.text
    pid = factory.placement(r.json()["id"], node, gpus=gpus)
    r = client.post(f"/internal/v1/placements/{pid}/claim", headers=factory.worker,
                    json={"node_id": node})
    assert r.status_code == 200, r.text
    return PlacementSpec.model_validate(r.json())


def _placement_dir(root: Path, name: str) -> Path:
    """A placement directory as the daemon leaves it before the executor starts."""
    directory = root / name
    (directory / "data").mkdir(parents=True)
    for part in ("train", "validation"):
        (directory / "data" / f"{part}.jsonl").write_text("{}\n")
    return directory


def test_every_task_field_reaches_the_executor_unchanged(client, factory, settings,
                                                         tmp_path):  # noqa: ANN001
    t = factory.tenant()
    files = {"@chat": factory.file(t)["id"],
             "@other": factory.file(t, [{"prompt": f"q{i}", "completion": "a"}
                                        for i in range(12)])["id"],
             "@val": factory.file(t, filename="val.jsonl")["id"],
             "@pref": factory.file(t, PREFERENCES)["id"]}
    model_dir = register_model(settings, tmp_path / "models", "contract-phi3",
                               {"model_type": "phi3"})
    node = factory.node(gpus=1)
    problems = []
    for i, (key, row) in enumerate(TABLE):
        body = BASE | row.body
        body = {k: files.get(v, v) if isinstance(v, str) else v for k, v in body.items()}
        spec = _claimed_spec(client, factory, t, body, node)
        ctx = Ctx(_placement_dir(tmp_path, f"p{i}"), files, model_dir)
        cfg = executor_config(spec, ctx.directory)
        got, want = row.got(cfg, spec), row.expected(ctx)
        if got != want:
            problems.append(f"{key}: sent {row.body}, the executor got {got!r}, want {want!r}")
        assert cfg.world_size == 1 and len(cfg.jobs) == len(spec.jobs) >= 1
    assert not problems, "\n".join(problems)


def test_world_size_is_the_placements_gpus(client, factory, tmp_path):  # noqa: ANN001
    t = factory.tenant()
    body = BASE | {"training_file": factory.file(t)["id"]}
    node = factory.node(gpus=4)
    for gpus in ((2,), (0, 1), (1, 2, 3)):
        spec = _claimed_spec(client, factory, t, body, node, gpus=gpus)
        assert spec.gpu_indices == list(gpus)
        cfg = executor_config(spec, _placement_dir(tmp_path, f"g{len(gpus)}"))
        assert cfg.world_size == len(gpus)


def test_the_executor_holds_the_task_settings_as_sent(client, factory, tmp_path):  # noqa: ANN001
    """Every task setting, any added later included, reaches the executor as the document the
    tenant sent (max_seq_len resolved): the placement carries it and the executor holds it."""
    t = factory.tenant()
    node = factory.node(gpus=1)
    body = BASE | {"training_file": factory.file(t)["id"], "validation_split": 0.25, "seed": 7,
                   "epochs": 2, "target_modules": ["v_proj", "q_proj"],
                   "early_exit": {"patience": 4, "min_steps": 30, "tau_gap": 0.35},
                   "eval": {"eval_every_steps": 7, "eval_min_samples": 16}}
    sent = TaskCreate.model_validate(body).task_settings().model_dump(mode="json")
    cfg = executor_config(_claimed_spec(client, factory, t, body, node), _placement_dir(tmp_path, "doc"))
    assert isinstance(cfg.settings, TaskSettings)
    assert cfg.settings.model_dump(mode="json") == sent
    assert cfg.settings.early_exit.min_steps == 30 and cfg.max_seq_len == 128


def test_dpo_task_is_claimable_with_beta_in_every_job(client, factory, tmp_path):  # noqa: ANN001
    t = factory.tenant()
    pref = factory.file(t, PREFERENCES)["id"]
    space = {"learning_rate": [1e-4, 2e-4], "beta": [0.05, 0.5]}
    node = factory.node(gpus=1)
    spec = _claimed_spec(client, factory, t, BASE | {"training_file": pref, "method": "dpo",
                                                     "search_space": space}, node)
    assert spec.method == "dpo" and spec.training_file_format == "preference"
    got = [(j.hyperparameters.learning_rate, j.hyperparameters.beta) for j in spec.jobs]
    assert got == [(1e-4, 0.05), (1e-4, 0.5), (2e-4, 0.05), (2e-4, 0.5)]
    cfg = executor_config(spec, _placement_dir(tmp_path, "dpo"))
    assert [(j.learning_rate, j.beta) for j in cfg.jobs] == got and cfg.method == "dpo"
    # the default beta is a job hyperparameter too; an sft job carries none
    default = _claimed_spec(client, factory, t, BASE | {"training_file": pref,
                                                        "method": "dpo"}, node)
    assert [j.hyperparameters.beta for j in default.jobs] == [0.1]
    sft = _claimed_spec(client, factory, t, BASE | {"training_file": factory.file(t)["id"]}, node)
    assert [j.hyperparameters.beta for j in sft.jobs] == [None]


TRACEBACK = """Traceback (most recent call last):
  File "/srv/loraplex/trainer/executor.py", line 212, in run
    batch = self.data.next()
  File "/home/ops/.venv/lib/python3.12/site-packages/torch/cuda/memory.py", line 9, in x
    raise torch.OutOfMemoryError(msg)
torch.OutOfMemoryError: CUDA out of memory at /var/lib/loraplex/placements/pl_1/executor"""
LEAKS = ("Traceback", "File \"", "/srv/", "/home/", "/var/lib", "site-packages", "line 212",
         "/opt/")


def test_tenants_read_failures_without_tracebacks_or_paths(client, factory, session):  # noqa: ANN001
    t = factory.tenant()
    tid = factory.task(t)["id"]
    w = factory.worker
    node = factory.node()
    pid = factory.placement(tid, node)
    client.post(f"/internal/v1/placements/{pid}/claim", headers=w, json={"node_id": node})
    job = client.get(f"/v1/tasks/{tid}/jobs", headers=t.headers).json()["data"][0]["id"]
    r = client.post(f"/internal/v1/jobs/{job}/state", headers=w,
                    json={"placement_id": pid, "state": "failed", "error": TRACEBACK})
    assert r.status_code == 200
    # attempt 1: an old worker sends the raw traceback as the error (retryable: requeued)
    r = client.post(f"/internal/v1/tasks/{tid}/failed", headers=w, json={
        "placement_id": pid, "error": TRACEBACK, "retryable": True})
    assert r.status_code == 200 and r.json()["state"] == "queued"
    # attempt 2: the node leaves with a reason naming a path (requeued again)
    pid2 = factory.placement(tid, node, attempt=2)
    client.post(f"/internal/v1/placements/{pid2}/claim", headers=w, json={"node_id": node})
    r = client.post(f"/internal/v1/nodes/{node}/deregister", headers=w,
                    json={"reason": "stopped by /opt/loraplex/bin/drain.sh"})
    assert r.status_code == 200 and r.json()["requeued_task_ids"] == [tid]
    # attempt 3: a short error with a path, the traceback as operator-only detail (final)
    node = factory.node()
    pid3 = factory.placement(tid, node, attempt=3)
    client.post(f"/internal/v1/placements/{pid3}/claim", headers=w, json={"node_id": node})
    r = client.post(f"/internal/v1/tasks/{tid}/failed", headers=w, json={
        "placement_id": pid3, "error": "ValueError: no record of /data/train.jsonl tokenizes",
        "detail": TRACEBACK, "retryable": False})
    assert r.status_code == 200 and r.json()["state"] == "failed"

    task = client.get(f"/v1/tasks/{tid}", headers=t.headers)
    assert task.json()["error"]["message"] == "ValueError: no record of <path> tokenizes"
    events = client.get(f"/v1/tasks/{tid}/events", headers=t.headers)
    requeued = [e["message"] for e in events.json()["data"] if e["type"] == "task_requeued"]
    assert requeued[0] == ("attempt 1 failed: torch.OutOfMemoryError: CUDA out of memory at "
                           "<path>")
    # the node's reason stays the operator's (it names the node): the tenant reads the cause
    assert requeued[1] == "attempt 2 failed: its node left the cluster", requeued
    jobs = client.get(f"/v1/tasks/{tid}/jobs", headers=t.headers)
    assert jobs.json()["data"][0]["error"].startswith("torch.OutOfMemoryError")
    listing = client.get("/v1/tasks", headers=t.headers)
    for r in (task, events, jobs, listing):
        assert r.status_code == 200
        leaked = [s for s in LEAKS if s in r.text]
        assert not leaked, (r.url, leaked, r.text)
    # the operator keeps everything, in the placement rows no tenant schema exposes
    rows = dict(session.execute(select(Placement.id, Placement.error).where(
        Placement.task_id == tid)).all())
    assert rows[pid] == TRACEBACK and TRACEBACK in rows[pid3]
    assert rows[pid3].startswith("ValueError: no record of /data/train.jsonl")
    assert "/opt/loraplex/bin/drain.sh" in rows[pid2]
    assert "error" not in PlacementOut.model_fields  # the operator's /v1/cluster shows none
