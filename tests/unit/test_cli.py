"""Unit: the `loraplex` CLI against a fake HTTP transport: argument parsing and the task body
(init adapter, tracking integrations), file upload before create, follow until the end (table with exit reasons), adapter download."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from service.cli import CliError, build_parser, jobs_table, main, search_space, task_body


def parse(*argv: str):  # noqa: ANN201
    return build_parser().parse_args(["tasks", "create", "--model", "m", "--train", "f", *argv])


def test_search_space_from_json_and_flags() -> None:
    args = parse("--search", '{"learning_rate": [1e-4, 3e-4], "lora_rank": 8}',
                 "--rank", "4", "--rank", "16", "--batch-size", "2")
    assert search_space(args) == {"learning_rate": [1e-4, 3e-4], "lora_rank": [4, 16],
                                  "batch_size": [2]}
    # "auto" learning rates: the service's grid around the model's centre
    assert search_space(parse("--lr", "auto")) == {"learning_rate": "auto"}
    assert search_space(parse("--search", '{"learning_rate": "auto", "lora_rank": 8}')) == {
        "learning_rate": "auto", "lora_rank": [8]}
    with pytest.raises(CliError):
        search_space(parse("--search", "{not json"))
    with pytest.raises(CliError):
        search_space(parse("--search", "[1, 2]"))


def test_task_body_fields_and_set() -> None:
    args = parse("--lr", "0.001", "--epochs", "2", "--max-seq-len", "64",
                 "--set", 'eval={"eval_every_steps": 5}', "--set", "priority=3")
    body = task_body(args, "file_1", "file_2")
    assert body == {"base_model": "m", "training_file": "file_1", "validation_file": "file_2",
                    "search_space": {"learning_rate": [0.001]}, "epochs": 2, "max_seq_len": 64,
                    "eval": {"eval_every_steps": 5}, "priority": 3}
    with pytest.raises(CliError):
        task_body(parse("--set", "novalue"), "f", None)


def test_task_body_init_adapter_and_integrations() -> None:
    args = parse("--wandb-project", "lora", "--mlflow-uri", "https://mlflow.example.com",
                 "--mlflow-experiment", "search")
    assert task_body(args, "file_1", None, "file_adapter") == {
        "base_model": "m", "training_file": "file_1", "init_adapter_file": "file_adapter",
        "integrations": [
            {"type": "wandb", "wandb": {"project": "lora"}},
            {"type": "mlflow", "mlflow": {"tracking_uri": "https://mlflow.example.com",
                                          "experiment_name": "search"}}]}
    # one of them, the experiment left to the service's default
    assert task_body(parse("--mlflow-uri", "http://m:5000"), "f", None)["integrations"] == [
        {"type": "mlflow", "mlflow": {"tracking_uri": "http://m:5000"}}]
    assert "integrations" not in task_body(parse(), "f", None)
    with pytest.raises(CliError, match="--mlflow-uri"):
        task_body(parse("--mlflow-experiment", "search"), "f", None)
    # --set wins over the flags, as for every other field
    body = task_body(parse("--wandb-project", "lora", "--set", "integrations=[]"), "f", None)
    assert body["integrations"] == []


def test_every_method_and_its_own_knob_are_flags() -> None:
    """contract.methods: --method offers every method, and each method's own knob is a flag."""
    body = task_body(parse("--method", "orpo", "--orpo-lambda", "0.1", "--orpo-lambda", "0.5"), "f", None)
    assert body["method"] == "orpo" and body["search_space"] == {"orpo_lambda": [0.1, 0.5]}
    body = task_body(parse("--method", "dpo", "--beta", "0.2"), "f", None)
    assert body["method"] == "dpo" and body["search_space"] == {"beta": [0.2]}
    with pytest.raises(SystemExit):
        parse("--method", "kto")


def test_env_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_API_URL", "http://example:9")
    monkeypatch.setenv("LORAPLEX_API_KEY", "sk-1")
    args = build_parser().parse_args(["tasks", "list"])
    assert (args.api_url, args.api_key) == ("http://example:9", "sk-1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tasks", "create", "--train", "x"])  # --model is required


JOBS = [
    {"id": "j0", "index": 0, "state": "completed", "exit_reason": None, "best_val_loss": 1.25,
     "last_step": 6, "hyperparameters": {"learning_rate": 1e-4, "lora_rank": 8,
                                         "lora_alpha": 16, "batch_size": 4}},
    {"id": "j1", "index": 1, "state": "exited", "exit_reason": "diverging",
     "best_val_loss": None, "last_step": 3,
     "hyperparameters": {"learning_rate": 1e-2, "lora_rank": 8, "lora_alpha": 16,
                         "batch_size": 4}},
]
CURVES = [{"job_id": "j0", "index": 0, "state": "completed",
           "train": [{"step": 5, "loss": 1.5}, {"step": 6, "loss": 1.4}],
           "val": [{"step": 6, "loss": 1.25}]},
          {"job_id": "j1", "index": 1, "state": "exited", "train": [{"step": 3, "loss": None}],
           "val": []}]


def test_jobs_table_shows_losses_and_exit_reasons() -> None:
    console = Console(record=True, width=160)
    console.print(jobs_table(JOBS, CURVES, best_job_id="j0"))
    text = console.export_text()
    assert "completed *best*" in text and "exited (diverging)" in text
    assert "1.4000" in text and "1.2500" in text
    row1 = next(line for line in text.splitlines() if "diverging" in line)
    assert "0.01" in row1 and row1.count("-") >= 2  # NaN train loss and no val loss shown as -


class FakeApi:
    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.polls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path == "/v1/files":
            return httpx.Response(201, json={"id": "file_up"})
        if path == "/v1/tasks" and request.method == "POST":
            return httpx.Response(201, json={"id": "task_1", "state": "queued", "num_jobs": 2})
        if path == "/v1/tasks/task_1":
            self.polls += 1
            state = "running" if self.polls < 3 else "succeeded"
            return httpx.Response(200, json={"id": "task_1", "state": state, "num_jobs": 2,
                                             "best_job_id": "j0", "error": None})
        if path.endswith("/jobs"):
            return httpx.Response(200, json={"data": JOBS})
        if path.endswith("/metrics"):
            return httpx.Response(200, json={"jobs": CURVES})
        if path.endswith("/events"):
            after = request.url.params.get("after")
            data = [] if after else [{"id": 7, "type": "job_exited", "message": "job 1 exited",
                                      "created_at": "2026-01-01T00:00:00"}]
            return httpx.Response(200, json={"data": data, "has_more": False,
                                             "last_id": 7 if data else None})
        if path == "/v1/tasks/missing/cancel":
            return httpx.Response(404, json={"error": {"code": "not_found",
                                                       "message": "no such task"}})
        if path.endswith("/adapter"):
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w:gz") as tf:
                for name, data in (("adapter_config.json", b"{}"),
                                   ("adapter_model.safetensors", b"xyz")):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
            return httpx.Response(200, content=buf.getvalue())
        return httpx.Response(500)


def test_create_uploads_local_file_then_follows(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr("service.cli.time.sleep", lambda s: None)
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "a", "completion": "b"}\n')
    fake = FakeApi()
    console = Console(record=True, width=160)
    rc = main(["--api-key", "sk", "tasks", "create", "--model", "tiny", "--train", str(train),
               "--lr", "1e-4", "--lr", "1e-2", "--follow"], httpx.MockTransport(fake), console)
    assert rc == 0
    create = next(r for r in fake.requests if r.method == "POST" and r.url.path == "/v1/tasks")
    assert json.loads(create.content) == {"base_model": "tiny", "training_file": "file_up",
                                          "search_space": {"learning_rate": [1e-4, 1e-2]}}
    assert create.headers["authorization"] == "Bearer sk"
    assert fake.polls == 3
    afters = [r.url.params.get("after") for r in fake.requests if r.url.path.endswith("/events")]
    assert afters == [None, "7", "7"]  # events are paged, not re-printed
    text = console.export_text()
    assert "job_exited: job 1 exited" in text and "succeeded; best job j0" in text


def test_create_uploads_a_local_adapter_archive_and_sends_the_flags(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter.tar.gz"
    adapter.write_bytes(b"archive")
    fake = FakeApi()
    rc = main(["tasks", "create", "--model", "tiny", "--train", "file_t", "--init-adapter",
               str(adapter), "--wandb-project", "p", "--mlflow-uri", "https://mlflow.example.com"],
              httpx.MockTransport(fake), Console(record=True))
    assert rc == 0
    upload = next(r for r in fake.requests if r.url.path == "/v1/files")
    assert b'name="purpose"\r\n\r\nadapter' in upload.content and b"archive" in upload.content
    create = next(r for r in fake.requests if r.url.path == "/v1/tasks")
    assert json.loads(create.content) == {
        "base_model": "tiny", "training_file": "file_t", "init_adapter_file": "file_up",
        "integrations": [{"type": "wandb", "wandb": {"project": "p"}},
                         {"type": "mlflow", "mlflow": {"tracking_uri":
                                                       "https://mlflow.example.com"}}]}
    # a file id is sent as it is; a missing local archive is an error, not an id
    fake = FakeApi()
    assert main(["tasks", "create", "--model", "tiny", "--train", "file_t", "--init-adapter",
                 "file_a"], httpx.MockTransport(fake), Console(record=True)) == 0
    assert json.loads(fake.requests[-1].content)["init_adapter_file"] == "file_a"
    assert main(["tasks", "create", "--model", "tiny", "--train", "file_t", "--init-adapter",
                 "gone.tar.gz"], httpx.MockTransport(FakeApi()), Console(record=True)) == 1


def test_errors_exit_1_with_the_api_message(capsys: pytest.CaptureFixture) -> None:
    rc = main(["tasks", "cancel", "missing"], httpx.MockTransport(FakeApi()),
              Console(record=True))
    assert rc == 1
    assert "no such task" in capsys.readouterr().err
    assert main(["tasks", "create", "--model", "m", "--train", "nope.jsonl"],
                httpx.MockTransport(FakeApi()), Console(record=True)) == 1


def test_adapter_download_extracts_peft_files(tmp_path: Path) -> None:
    rc = main(["adapter", "download", "task_1", "-o", str(tmp_path / "out")],
              httpx.MockTransport(FakeApi()), Console(record=True))
    assert rc == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    assert (tmp_path / "out" / "adapter_model.safetensors").read_bytes() == b"xyz"


def test_merged_download_waits_then_resumes_a_partial_download(tmp_path: Path,
                                                                monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr("service.cli.time.sleep", lambda s: None)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in (("config.json", b"{}"), ("model.safetensors", b"w" * 5000)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    archive = buf.getvalue()
    states = iter(["queued", "running", "succeeded"])
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/tasks/task_1/merged":
            return httpx.Response(200, json={"id": "mrg_1", "state": next(states),
                                             "bytes": len(archive), "error": None})
        assert request.url.path == "/v1/tasks/task_1/merged/content"
        assert request.url.params.get("job_id") == "job_2"
        start = int(request.headers["range"].removeprefix("bytes=").rstrip("-"))
        return httpx.Response(206, content=archive[start:])

    out = tmp_path / "out"
    out.mkdir()
    (out / ".mrg_1.tar.part").write_bytes(archive[:1000])  # an earlier run broke off here
    rc = main(["merged", "download", "task_1", "--job", "job_2", "-o", str(out)],
              httpx.MockTransport(handler), Console(record=True))
    assert rc == 0
    assert [r.method for r in seen] == ["POST", "GET", "GET", "GET"]
    assert seen[-1].headers["range"] == "bytes=1000-"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"w" * 5000


def test_samples_print_each_prompt_with_the_base_model_and_the_leaders() -> None:
    page = {"object": "list", "task_id": "task_s", "file_id": "file_s", "data": [
        {"prompt": "Say [hi]", "job_id": None, "completion": "hello", "tokens": 1},
        {"prompt": "Say [hi]", "job_id": "job_" + "a" * 24, "completion": "hi there", "tokens": 2},
        {"prompt": "Count", "job_id": None, "completion": "1 2 3", "tokens": 3}]}

    def fake(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/tasks/task_s/samples"
        return httpx.Response(200, json=page)

    console = Console(record=True, width=40)
    assert main(["samples", "task_s"], httpx.MockTransport(fake), console) == 0
    text = console.export_text()
    assert text.count("prompt") == 2 and "Say [hi]" in text  # markup in prompts printed as is
    assert "base model (1 tokens)" in text and "job_" + "a" * 24 in text  # the id whole
    assert text.index("hello") < text.index("hi there") < text.index("1 2 3") and "file_s" in text
    console = Console(record=True)
    assert main(["--json", "samples", "task_s"], httpx.MockTransport(fake), console) == 0
    assert json.loads(console.export_text())["data"][1]["completion"] == "hi there"


def test_samples_on_demand_post_the_prompts_wait_and_print_the_completions() -> None:
    seen: list[httpx.Request] = []
    rows = [{"prompt": "Hi", "job_id": None, "completion": "hello", "tokens": 1},
            {"prompt": "Hi", "job_id": "job_b", "completion": "hey you", "tokens": 2}]
    states = iter(["running", "succeeded"])

    def fake(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "POST":
            assert request.url.path == "/v1/tasks/task_s/samples"
            return httpx.Response(202, json={"id": "smpl_1", "task_id": "task_s", "state": "queued",
                                             "error": None, "data": []})
        assert request.url.path == "/v1/tasks/task_s/samples/smpl_1"
        state = next(states)
        return httpx.Response(200, json={"id": "smpl_1", "task_id": "task_s", "state": state,
                                         "error": None, "data": rows if state == "succeeded" else []})

    console = Console(record=True, width=60)
    argv = ["samples", "task_s", "--prompt", "Hi", "--job", "job_b", "--max-new-tokens", "4",
            "--seed", "3", "--interval", "0"]
    assert main(argv, httpx.MockTransport(fake), console) == 0
    assert json.loads(seen[0].content) == {"prompts": ["Hi"], "job_ids": ["job_b"], "include_base": True,
                                           "max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0,
                                           "seed": 3}
    assert [r.method for r in seen] == ["POST", "GET", "GET"]
    text = console.export_text()
    assert text.index("hello") < text.index("hey you") and "job_b (2 tokens)" in text

    def failed(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200 if request.method == "GET" else 202, json={
            "id": "smpl_2", "task_id": "task_s", "state": "failed", "data": [],
            "error": "the sampling was interrupted 3 times"})

    assert main(["samples", "task_s", "--prompt", "Hi", "--top-k", "1"], httpx.MockTransport(failed),
                Console(record=True)) == 1
