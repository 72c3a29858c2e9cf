"""Integration: every bound of a task's settings (early exit, eval, each search-space knob, the
other create fields) and `target_modules` against the base model's family is a 422 at create
that names the offending field and changes nothing: no task, job, event or Idempotency-Key."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.models import Event, IdempotencyKey, Job, Task

# (case, body overrides, the param the error names). JSON has no NaN or Infinity, but Python's
# json (the API's parser) reads the bare words: those cases are sent as raw text (RAW below).
NAN, INF, NEG_INF = float("nan"), float("inf"), float("-inf")
EARLY_EXIT = [
    ("window 1", {"window": 1}, "early_exit.window"),
    ("window too large", {"window": 1001}, "early_exit.window"),
    ("window not an integer", {"window": 2.5}, "early_exit.window"),
    ("patience 0", {"patience": 0}, "early_exit.patience"),
    ("patience too large", {"patience": 1001}, "early_exit.patience"),
    ("tau_gap negative", {"tau_gap": -0.1}, "early_exit.tau_gap"),
    ("tau_gap too large", {"tau_gap": 1000.5}, "early_exit.tau_gap"),
    ("tau_gap NaN", {"tau_gap": NAN}, "early_exit.tau_gap"),
    ("tau_gap Infinity", {"tau_gap": INF}, "early_exit.tau_gap"),
    ("tau_slope negative", {"tau_slope": -0.001}, "early_exit.tau_slope"),
    ("tau_slope too large", {"tau_slope": 1e9}, "early_exit.tau_slope"),
    ("tau_slope -Infinity", {"tau_slope": NEG_INF}, "early_exit.tau_slope"),
    ("warmup_fraction 1.0", {"warmup_fraction": 1.0}, "early_exit.warmup_fraction"),
    ("warmup_fraction negative", {"warmup_fraction": -0.1}, "early_exit.warmup_fraction"),
    ("warmup_fraction NaN", {"warmup_fraction": NAN}, "early_exit.warmup_fraction"),
    ("keep_fraction 0", {"keep_fraction": 0}, "early_exit.keep_fraction"),
    ("keep_fraction 1.5", {"keep_fraction": 1.5}, "early_exit.keep_fraction"),
    ("ema_alpha 0", {"ema_alpha": 0}, "early_exit.ema_alpha"),
    ("ema_alpha 1.5", {"ema_alpha": 1.5}, "early_exit.ema_alpha"),
    ("enabled not a bool", {"enabled": "maybe"}, "early_exit.enabled"),
    ("unknown field", {"window_size": 3}, "early_exit.window_size"),
]
EVAL = [
    ("eval_every_steps 0", {"eval_every_steps": 0}, "eval.eval_every_steps"),
    ("eval_every_steps too large", {"eval_every_steps": 1_000_001}, "eval.eval_every_steps"),
    ("eval_every_steps not an integer", {"eval_every_steps": 1.5}, "eval.eval_every_steps"),
    ("eval_max_samples 0", {"eval_max_samples": 0}, "eval.eval_max_samples"),
    ("eval_max_samples negative", {"eval_max_samples": -1}, "eval.eval_max_samples"),
    ("eval_max_samples too large", {"eval_max_samples": 1_000_001}, "eval.eval_max_samples"),
    ("unknown field", {"eval_batch_size": 8}, "eval.eval_batch_size"),
]
SEARCH_SPACE = [
    ("learning_rate 0", {"learning_rate": [0]}, "search_space.learning_rate"),
    ("learning_rate 1", {"learning_rate": [1e-4, 1]}, "search_space.learning_rate"),
    ("learning_rate negative", {"learning_rate": [-1e-4]}, "search_space.learning_rate"),
    ("learning_rate NaN", {"learning_rate": [NAN]}, "search_space.learning_rate"),
    ("lora_rank 0", {"lora_rank": [0]}, "search_space.lora_rank"),
    ("lora_rank 1025", {"lora_rank": [8, 1025]}, "search_space.lora_rank"),
    ("lora_rank not an integer", {"lora_rank": [2.5]}, "search_space.lora_rank"),
    ("lora_alpha 0", {"lora_alpha": [0]}, "search_space.lora_alpha"),
    ("lora_alpha negative", {"lora_alpha": [-16]}, "search_space.lora_alpha"),
    ("lora_alpha too large", {"lora_alpha": [1e6 + 1]}, "search_space.lora_alpha"),
    ("lora_alpha Infinity", {"lora_alpha": [INF]}, "search_space.lora_alpha"),
    ("batch_size 0", {"batch_size": [0]}, "search_space.batch_size"),
    ("batch_size 4097", {"batch_size": [4097]}, "search_space.batch_size"),
    ("beta 0", {"beta": [0]}, "search_space.beta"),
    ("beta 11", {"beta": [0.1, 11]}, "search_space.beta"),
    ("beta NaN", {"beta": [NAN]}, "search_space.beta"),
    *[(f"{knob} duplicates", {knob: [v, v]}, f"search_space.{knob}")
      for knob, v in (("learning_rate", 1e-4), ("lora_rank", 8), ("lora_alpha", 16.0),
                      ("batch_size", 4), ("beta", 0.1))],
    *[(f"{knob} empty", {knob: []}, f"search_space.{knob}")
      for knob in ("learning_rate", "lora_rank", "lora_alpha", "batch_size", "beta")],
    ("65 values", {"lora_rank": list(range(1, 66))}, "search_space.lora_rank"),
    ("unknown knob", {"dropout": [0.1]}, "search_space.dropout"),
]
TOP_LEVEL = [
    ("epochs 0", {"epochs": 0}, "epochs"),
    ("epochs 101", {"epochs": 101}, "epochs"),
    ("max_seq_len 15", {"max_seq_len": 15}, "max_seq_len"),
    ("max_seq_len above the model's", {"max_seq_len": 513}, "max_seq_len"),
    ("seed negative", {"seed": -1}, "seed"),
    ("seed 2**31", {"seed": 2**31}, "seed"),
    ("validation_split 0", {"validation_split": 0}, "validation_split"),
    ("validation_split 0.5", {"validation_split": 0.5}, "validation_split"),
    ("validation_split NaN", {"validation_split": NAN}, "validation_split"),
    ("priority 11", {"priority": 11}, "priority"),
    ("method ppo", {"method": "ppo"}, "method"),
    ("early_exit null", {"early_exit": None}, "early_exit"),
    ("target_modules unknown", {"target_modules": ["nope_proj"]}, "target_modules"),
    ("target_modules one unknown", {"target_modules": ["q_proj", "nope_proj"]}, "target_modules"),
    ("target_modules fused on llama", {"target_modules": ["qkv_proj"]}, "target_modules"),
    ("target_modules empty name", {"target_modules": [""]}, "target_modules"),
    ("target_modules name too long", {"target_modules": ["q" * 129]}, "target_modules"),
    ("target_modules 33 names", {"target_modules": ["q_proj"] * 33}, "target_modules"),
    ("target_modules duplicates", {"target_modules": ["q_proj", "q_proj"]}, "target_modules"),
    ("unknown field", {"learning_rate": 1e-4}, "learning_rate"),
]
CASES = ([(f"early_exit {c}", {"early_exit": v}, p) for c, v, p in EARLY_EXIT]
         + [(f"eval {c}", {"eval": v}, p) for c, v, p in EVAL]
         + [(f"search_space {c}", {"search_space": v}, p) for c, v, p in SEARCH_SPACE]
         + TOP_LEVEL)


def counts(session: Session, tenant_id: str) -> dict[str, int]:
    """What a create could have written for the tenant."""
    of_tenant = select(Task.id).where(Task.tenant_id == tenant_id)
    return {
        "tasks": session.scalar(select(func.count()).select_from(Task)
                                .where(Task.tenant_id == tenant_id)),
        "jobs": session.scalar(select(func.count()).select_from(Job)
                               .where(Job.task_id.in_(of_tenant))),
        "events": session.scalar(select(func.count()).select_from(Event)
                                 .where(Event.task_id.in_(of_tenant))),
        "keys": session.scalar(select(func.count()).select_from(IdempotencyKey)
                               .where(IdempotencyKey.tenant_id == tenant_id)),
    }


def register_model(settings: Any, root: Path, name: str, config: dict | None,
                   family: str | None = None) -> Path:
    """Add a base model to the operator's registry: a directory with this config.json (none
    when config is None) and an entry in the models file (the registry reloads on its mtime)."""
    model_dir = root / name
    model_dir.mkdir(parents=True)
    if config is not None:
        (model_dir / "config.json").write_text(json.dumps(config))
    models = Path(settings.models_file)
    before = models.stat().st_mtime_ns
    entry = f"  - name: {name}\n    path: {model_dir}\n    gpus: 1\n    max_seq_len: 512\n"
    models.write_text(models.read_text() + entry + (f"    family: {family}\n" if family else ""))
    os.utime(models, ns=(before + 10**9, before + 10**9))  # a new mtime even on coarse clocks
    return model_dir


@pytest.fixture
def tenant_with_task(factory):  # noqa: ANN001, ANN201
    """A tenant that already has one task, so 'nothing changed' compares non-empty counts."""
    t = factory.tenant()
    f = factory.file(t)["id"]
    factory.task(t, f)
    return t, f


def post_task(client, tenant, body: dict, key: str | None = None):  # noqa: ANN001, ANN201
    headers = tenant.headers | {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    # json.dumps writes NaN / Infinity as the bare words; the API's parser reads them.
    return client.post("/v1/tasks", headers=headers, content=json.dumps(body))


def test_every_bound_is_a_422_that_names_the_field_and_changes_nothing(
        client, factory, session, tenant_with_task):  # noqa: ANN001
    t, f = tenant_with_task
    base = {"base_model": "tiny-llama", "training_file": f, "max_seq_len": 128}
    before = counts(session, t.id)
    problems = []
    for case, overrides, param in CASES:
        r = post_task(client, t, base | overrides, key="one-key")
        err = r.json().get("error", {}) if r.headers["content-type"].startswith(
            "application/json") else {}
        if r.status_code != 422 or err.get("param") != param or param not in err.get("message", ""):
            problems.append((case, r.status_code, r.text[:300]))
        if counts(session, t.id) != before:
            problems.append((case, "changed", counts(session, t.id), before))
            before = counts(session, t.id)
    assert not problems, "\n".join(map(str, problems))
    # A rejected create claimed no Idempotency-Key: the same key still creates.
    r = post_task(client, t, base, key="one-key")
    assert r.status_code == 201, r.text


def test_bounds_themselves_are_accepted(client, factory):  # noqa: ANN001
    t = factory.tenant()
    chat = factory.file(t)["id"]
    pref = factory.file(t, [{"prompt": f"p{i}", "chosen": "good", "rejected": "bad"}
                            for i in range(10)])["id"]
    highest = {
        "base_model": "tiny-llama", "training_file": pref, "method": "dpo", "max_seq_len": 512,
        "validation_split": 0.49, "epochs": 100, "seed": 2**31 - 1, "priority": 10,
        "early_exit": {"window": 1000, "patience": 1000, "tau_gap": 1000, "tau_slope": 1000,
                       "warmup_fraction": 0.999, "keep_fraction": 1, "ema_alpha": 1},
        "eval": {"eval_every_steps": 1_000_000, "eval_max_samples": 1_000_000},
        "search_space": {"learning_rate": [0.999], "lora_rank": [1024], "lora_alpha": [1e6],
                         "batch_size": [4096], "beta": [10]},
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"],
    }
    lowest = {
        "base_model": "tiny-llama", "training_file": chat, "max_seq_len": 16, "seed": 0,
        "validation_split": 0.01, "epochs": 1, "priority": 0,
        "early_exit": {"enabled": False, "window": 2, "patience": 1, "tau_gap": 0,
                       "tau_slope": 0, "warmup_fraction": 0, "keep_fraction": 1e-9,
                       "ema_alpha": 1e-9},
        "eval": {"eval_every_steps": 1, "eval_max_samples": None},
        "search_space": {"learning_rate": [1e-12], "lora_rank": [1], "lora_alpha": [1e-9],
                         "batch_size": [1], "beta": [1e-9]},
        "target_modules": ["down_proj"],
    }
    for body in (highest, lowest):
        r = post_task(client, t, body)
        assert r.status_code == 201, r.text
        got = r.json()
        for name, value in body["early_exit"].items():
            assert got["early_exit"][name] == value, name
        assert {k: got["eval"][k] for k in body["eval"]} == body["eval"]
    assert got["target_modules"] == body["target_modules"]


def test_target_modules_follow_the_models_own_config(client, factory, session, settings,
                                                     tmp_path):  # noqa: ANN001
    t = factory.tenant()
    f = factory.file(t)["id"]
    root = tmp_path / "registered"
    # config.json wins over the registry's `family`: this one is a Phi-3 (fused projections)
    phi = register_model(settings, root, "tiny-phi3", {"model_type": "phi3"}, family="llama")
    bert = register_model(settings, root, "tiny-bert", {"model_type": "bert"})
    register_model(settings, root, "no-config", None)
    base = {"training_file": f, "max_seq_len": 128}
    before = counts(session, t.id)

    r = post_task(client, t, base | {"base_model": "tiny-llama",
                                     "target_modules": ["q_proj", "nope_proj", "qkv_proj"]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "target_modules"
    message = r.json()["error"]["message"]
    assert "'nope_proj'" in message and "'qkv_proj'" in message and "'q_proj'" not in message
    assert all(name in message for name in ("q_proj", "v_proj", "down_proj"))  # the valid ones

    r = post_task(client, t, base | {"base_model": "tiny-phi3", "target_modules": ["q_proj"]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "target_modules"
    assert "qkv_proj" in r.json()["error"]["message"] and "phi3" in r.json()["error"]["message"]
    assert str(phi) not in r.text

    for model in ("tiny-bert", "no-config"):
        for targets in (None, ["q_proj"]):
            r = post_task(client, t, base | {"base_model": model, "target_modules": targets})
            assert r.status_code == 422, (model, r.text)
            assert r.json()["error"] == {"code": "unsupported_model", "param": "base_model",
                                         "type": "invalid_request_error",
                                         "message": r.json()["error"]["message"]}
            assert model in r.json()["error"]["message"] and str(root) not in r.text
    assert "'bert'" in post_task(client, t, base | {"base_model": "tiny-bert"}).text
    assert str(bert) not in post_task(client, t, base | {"base_model": "tiny-bert"}).text
    assert counts(session, t.id) == before

    ok = post_task(client, t, base | {"base_model": "tiny-phi3",
                                      "target_modules": ["qkv_proj", "gate_up_proj"]})
    assert ok.status_code == 201, ok.text
    assert ok.json()["target_modules"] == ["qkv_proj", "gate_up_proj"]
    default = post_task(client, t, base | {"base_model": "tiny-phi3"})
    assert default.status_code == 201 and default.json()["target_modules"] is None
