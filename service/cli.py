"""`loraplex`, the user's command line: upload files, create a task from a JSONL file and a search
space, follow it live (progress bar + table of jobs and losses), cancel it, download adapters
and merged models.

Talks HTTP only (httpx). Configuration: --api-url / --api-key, or env LORAPLEX_API_URL and
LORAPLEX_API_KEY. Exit code 0 on success, 1 on an API error or a task that did not succeed,
130 when stopped with Ctrl-C.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from contract.methods import METHOD_KNOBS, METHODS
from contract.states import JOB_TERMINAL, TASK_TERMINAL, TaskState
from service import cli_samples
from service.cli_tables import files_table, jobs_table, print_table, tasks_table
from service.merged.states import MERGE_LIVE, MergeState

SEARCH_FLAGS = {"lr": "learning_rate", "rank": "lora_rank", "alpha": "lora_alpha",
                "batch_size": "batch_size", **{k: k for k in METHOD_KNOBS}}


INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped with Ctrl-C


class CliError(Exception):
    """A message for the user; main() prints it and exits 1."""


class Api:
    """The public /v1 API with the caller's key; errors become CliError with the API's text."""

    def __init__(self, url: str, key: str | None, transport: httpx.BaseTransport | None = None,
                 timeout_s: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s,
                                 transport=transport)

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            r = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise CliError(f"cannot reach {self.http.base_url}: {exc}") from exc
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
                detail = f"{err.get('code')}: {err.get('message')}"
                if err.get("param"):
                    detail += f" (param {err['param']})"
            except (ValueError, KeyError, TypeError):
                detail = r.text[:500]
            raise CliError(f"{method} {path} -> {r.status_code} {detail}")
        return r

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.call(method, path, **kwargs).json()

    def upload(self, path: Path, purpose: str = "fine-tune", **form: str) -> dict:
        return self.upload_new(path, purpose, **form)[0]

    def upload_new(self, path: Path, purpose: str = "fine-tune", **form: str
                   ) -> tuple[dict, bool]:
        """(the file object, whether this upload stored it): the service answers 200 with the
        file it already holds for the same bytes and purpose, 201 for a new one."""
        if not path.is_file():
            raise CliError(f"no such file: {path}")
        kind = "application/gzip" if purpose == "adapter" else "application/jsonl"
        with open(path, "rb") as fh:
            r = self.call("POST", "/v1/files", data={"purpose": purpose} | form,
                          files={"file": (path.name, fh, kind)})
        return r.json(), r.status_code == 201


# -- arguments ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="loraplex", description="loraplex: LoRA fine-tuning "
                                 "with hyperparameter search, as a service.")
    ap.add_argument("--api-url", default=os.environ.get("LORAPLEX_API_URL",
                                                        "http://127.0.0.1:8000"),
                    help="Service URL (env LORAPLEX_API_URL).")
    ap.add_argument("--api-key", default=os.environ.get("LORAPLEX_API_KEY"),
                    help="Your API key (env LORAPLEX_API_KEY).")
    ap.add_argument("--json", action="store_true", help="Print raw JSON instead of tables.")
    top = ap.add_subparsers(dest="group", required=True)

    files = top.add_parser("files", help="Training data files.").add_subparsers(
        dest="cmd", required=True)
    up = files.add_parser("upload", help="Upload a JSONL file.")
    up.add_argument("path", type=Path)
    up.add_argument("--purpose", default="fine-tune")
    files.add_parser("list", help="List your files.")

    models = top.add_parser("models", help="Base models.").add_subparsers(dest="cmd",
                                                                         required=True)
    models.add_parser("list", help="Base models you can fine-tune.")

    tasks = top.add_parser("tasks", help="Fine-tuning tasks.").add_subparsers(
        dest="cmd", required=True)
    create = tasks.add_parser("create", help="Create a task (one job per configuration).")
    create.add_argument("--model", required=True, help="Base model id (see `models list`).")
    create.add_argument("--train", required=True,
                        help="A local JSONL file (uploaded first) or a file id.")
    create.add_argument("--validation", help="A local JSONL file or a file id.")
    create.add_argument("--search", help='Search space JSON, e.g. \'{"learning_rate": [1e-4, '
                        '3e-4], "lora_rank": [8, 16]}\'; flags below add to it.')
    create.add_argument("--lr", type=_learning_rate, action="append",
                        help="Learning rate (repeat), or auto: around the model's calibrated "
                             "centre LoRA rate.")
    create.add_argument("--rank", type=int, action="append", help="LoRA rank (repeat).")
    create.add_argument("--alpha", type=float, action="append", help="LoRA alpha (repeat).")
    create.add_argument("--batch-size", type=int, action="append", help="Batch size (repeat).")
    create.add_argument("--method", choices=tuple(METHODS), help="; ".join(
        f"{m.name}: {m.summary}" for m in METHODS.values()))
    for knob in METHOD_KNOBS.values():  # each method's own knob (contract.methods)
        create.add_argument(f"--{knob.name.replace('_', '-')}", dest=knob.name, type=float,
                            action="append", help=f"{knob.description} (repeat).")
    create.add_argument("--epochs", type=int)
    create.add_argument("--max-seq-len", type=int)
    create.add_argument("--validation-split", type=float)
    create.add_argument("--seed", type=int)
    create.add_argument("--init-adapter", metavar="FILE_ID",
                        help="Start every job from this adapter: a file id (purpose adapter) or "
                             "a local PEFT adapter archive (.tar.gz, uploaded first).")
    create.add_argument("--wandb-project", metavar="NAME",
                        help="Write each job as a W&B run of this project once the task ends.")
    create.add_argument("--mlflow-uri", metavar="URI",
                        help="Write each job as a run on this MLflow tracking server once the "
                             "task ends.")
    create.add_argument("--mlflow-experiment", metavar="NAME",
                        help="The MLflow experiment of the runs (default loraplex).")
    create.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="Any other task field, e.g. --set 'eval={\"eval_every_steps\":20}'.")
    create.add_argument("--idempotency-key", help="Retry-safe creation key.")
    create.add_argument("--follow", action="store_true", help="Follow the task until it ends.")
    lst = tasks.add_parser("list", help="Your tasks, newest first.")
    lst.add_argument("--limit", type=int, default=20)
    for name, text in (("get", "Show a task."), ("cancel", "Cancel a task."),
                       ("follow", "Live progress until the task ends.")):
        p = tasks.add_parser(name, help=text)
        p.add_argument("task_id")
        if name == "follow":
            p.add_argument("--interval", type=float, default=2.0, help="Seconds between polls.")

    adapter = top.add_parser("adapter", help="Trained adapters.").add_subparsers(
        dest="cmd", required=True)
    dl = adapter.add_parser("download", help="Download the best adapter of a task (PEFT files).")
    dl.add_argument("task_id")
    dl.add_argument("-o", "--output", type=Path, required=True, help="Directory to write to.")
    dl.add_argument("--job", help="A specific job's adapter instead of the task's best.")
    cli_samples.add_arguments(top.add_parser(
        "samples", help="The completions a task ended with (its leading configurations and the "
        "base model on the same prompts), or, with --prompt, yours on demand."))
    merged = top.add_parser("merged", help="Adapters merged into the base model.").add_subparsers(
        dest="cmd", required=True)
    mdl = merged.add_parser("download", help="Merge the best adapter of a task into its base "
                            "model (once, on the service) and download the model directory.")
    mdl.add_argument("task_id")
    mdl.add_argument("-o", "--output", type=Path, required=True, help="Directory to write to.")
    mdl.add_argument("--job", help="A specific job's adapter instead of the task's best.")
    mdl.add_argument("--interval", type=float, default=2.0, help="Seconds between polls.")
    return ap


def search_space(args: argparse.Namespace) -> dict[str, list]:
    """The search space from --search JSON plus the repeatable flags (flags win per key)."""
    space: dict[str, list] = {}
    if args.search:
        try:
            space = json.loads(args.search)
        except ValueError as exc:
            raise CliError(f"--search is not valid JSON: {exc}") from exc
        if not isinstance(space, dict):
            raise CliError("--search must be a JSON object of lists")
        space = {k: v if isinstance(v, list) or v == "auto" else [v] for k, v in space.items()}
    for flag, key in SEARCH_FLAGS.items():
        values = getattr(args, flag)
        if values:
            space[key] = "auto" if "auto" in values else values
    return space


def _learning_rate(text: str) -> float | str:
    """A --lr value: a number, or "auto" (the service centres the grid on the model)."""
    return "auto" if text == "auto" else float(text)


def integrations(args: argparse.Namespace) -> list[dict]:
    """The task's tracking integrations from --wandb-project and --mlflow-uri/-experiment."""
    out: list[dict] = []
    if args.wandb_project:
        out.append({"type": "wandb", "wandb": {"project": args.wandb_project}})
    if args.mlflow_experiment and not args.mlflow_uri:
        raise CliError("--mlflow-experiment needs --mlflow-uri")
    if args.mlflow_uri:
        mlflow = {"tracking_uri": args.mlflow_uri}
        if args.mlflow_experiment:
            mlflow["experiment_name"] = args.mlflow_experiment
        out.append({"type": "mlflow", "mlflow": mlflow})
    return out


def task_body(args: argparse.Namespace, train_id: str, validation_id: str | None,
              init_adapter_id: str | None = None) -> dict:
    """The POST /v1/tasks body; --set KEY=JSON wins over the flags."""
    body: dict[str, Any] = {"base_model": args.model, "training_file": train_id}
    if validation_id:
        body["validation_file"] = validation_id
    if init_adapter_id:
        body["init_adapter_file"] = init_adapter_id
    if tracking := integrations(args):
        body["integrations"] = tracking
    space = search_space(args)
    if space:
        body["search_space"] = space
    for field in ("method", "epochs", "max_seq_len", "validation_split", "seed"):
        value = getattr(args, field)
        if value is not None:
            body[field] = value
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise CliError(f"--set expects KEY=JSON, got {item!r}")
        try:
            body[key] = json.loads(raw)
        except ValueError:
            body[key] = raw
    return body


def _file_ref(api: Api, ref: str | None, purpose: str = "fine-tune",
              made: list[str] | None = None, **form: str) -> str | None:
    """A local path is uploaded (its id added to `made` when the upload stored a new file);
    anything else is taken as a file id."""
    if ref is None:
        return None
    path = Path(ref)
    if path.exists():
        out, new = api.upload_new(path, purpose, **form)
        if new and made is not None:
            made.append(out["id"])
        return out["id"]
    if ref.endswith((".jsonl", ".json", ".tar.gz", ".tgz")) or os.sep in ref:
        raise CliError(f"no such file: {ref}")
    return ref


def create_task(api: Api, args: argparse.Namespace) -> dict:
    """POST /v1/tasks from the flags, the local files uploaded first (the service answers an
    upload of bytes it holds with that file). A create that fails removes the files this
    create stored, never a file the tenant already had."""
    made: list[str] = []
    try:
        body = task_body(args, _file_ref(api, args.train, made=made) or "",
                         _file_ref(api, args.validation, made=made),
                         _file_ref(api, args.init_adapter, "adapter", made,
                                   base_model=args.model))
        headers = {"Idempotency-Key": args.idempotency_key} if args.idempotency_key else {}
        return api.json("POST", "/v1/tasks", json=body, headers=headers)
    except (CliError, KeyboardInterrupt):
        for file_id in made:
            # a 409 (a task of this create did start from it after all) keeps it
            try:
                api.call("DELETE", f"/v1/files/{file_id}")
            except CliError:
                pass
        raise


# -- rendering ------------------------------------------------------------------------------
def follow(api: Api, task_id: str, console: Console, interval: float = 2.0,
           sleep: Any = time.sleep) -> dict:
    """Poll the task, its jobs, loss curves and events until it ends; returns the final task."""
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        console=console)
    bar = progress.add_task("jobs finished", total=None)
    after: int | None = None
    with Live(console=console, refresh_per_second=4, transient=False) as live:
        while True:
            task = api.json("GET", f"/v1/tasks/{task_id}")
            jobs = api.json("GET", f"/v1/tasks/{task_id}/jobs")["data"]
            curves = api.json("GET", f"/v1/tasks/{task_id}/metrics")["jobs"]
            params = {"limit": 1000} | ({"after": after} if after is not None else {})
            page = api.json("GET", f"/v1/tasks/{task_id}/events", params=params)
            for event in page["data"]:
                live.console.print(f"[dim]{str(event['created_at'])[11:19]}[/dim] "
                                   f"{event['type']}: {event['message']}")
            after = page.get("last_id") or after
            done = sum(j["state"] in JOB_TERMINAL for j in jobs)
            progress.update(bar, total=task["num_jobs"], completed=done,
                            description=f"task {task_id} {task['state']}")
            live.update(Group(progress, jobs_table(jobs, curves, task.get("best_job_id"))))
            if task["state"] in TASK_TERMINAL:
                break
            sleep(interval)
    if not console.is_terminal:  # Live ends a terminal's last line itself, not a pipe's or file's
        console.line()
    return task


def download_adapter(api: Api, task_id: str, output: Path, job_id: str | None = None) -> list[str]:
    """Fetch the adapter archive and unpack its PEFT files into output; returns the names."""
    path = f"/v1/jobs/{job_id}/adapter" if job_id else f"/v1/tasks/{task_id}/adapter"
    blob = api.call("GET", path, params={"format": "tar.gz"}).content
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tf:
        return _unpack(tf, output)


def download_merged(api: Api, task_id: str, output: Path, job_id: str | None = None,
                    interval: float = 2.0) -> list[str]:
    """Ask for the best adapter (or a job's) merged into the base model, wait while the service
    builds it, download the tar (a partial download left by an earlier run resumes with Range)
    and unpack the model directory into output; returns the names."""
    path, params = f"/v1/tasks/{task_id}/merged", {"job_id": job_id} if job_id else {}
    merged = api.json("POST", path, params=params)
    while merged["state"] in MERGE_LIVE:
        time.sleep(interval)
        merged = api.json("GET", path, params=params)
    if merged["state"] != MergeState.SUCCEEDED:
        raise CliError(f"merge {merged['id']} {merged['state']}: {merged.get('error')}")
    output.mkdir(parents=True, exist_ok=True)
    part = output / f".{merged['id']}.tar.part"
    have = part.stat().st_size if part.exists() else 0
    if have != merged["bytes"]:
        headers = {"Range": f"bytes={have}-"} if 0 < have < merged["bytes"] else {}
        try:
            with api.http.stream("GET", f"{path}/content", params=params,
                                 headers=headers) as r:
                if r.status_code >= 400:
                    r.read()
                    raise CliError(f"GET {path}/content -> {r.status_code} {r.text[:500]}")
                with open(part, "ab" if r.status_code == 206 else "wb") as fh:
                    for block in r.iter_bytes():
                        fh.write(block)
        except httpx.TransportError as exc:
            raise CliError(f"download interrupted ({exc}); run again to resume") from exc
    with tarfile.open(part) as tf:
        names = _unpack(tf, output)
    part.unlink()
    return names


def _unpack(tf: tarfile.TarFile, output: Path) -> list[str]:
    """The archive's files, flat, into output (never outside it); their names."""
    output.mkdir(parents=True, exist_ok=True)
    names = []
    for member in tf.getmembers():
        name = Path(member.name).name
        if not member.isfile() or not name or name.startswith("."):
            continue
        src = tf.extractfile(member)
        assert src is not None
        with open(output / name, "wb") as dst:
            shutil.copyfileobj(src, dst, 1024 * 1024)
        names.append(name)
    return sorted(names)


# -- commands -------------------------------------------------------------------------------
def run(args: argparse.Namespace, api: Api, console: Console) -> int:
    def show(obj: Any, table: Table | None = None) -> None:
        if args.json or table is None:
            console.print_json(json.dumps(obj, default=str))
        else:
            print_table(console, table)

    if args.group == "files" and args.cmd == "upload":
        show(api.upload(args.path, args.purpose))
    elif args.group == "files":
        page = api.json("GET", "/v1/files", params={"limit": 100})
        show(page, files_table(console, page["data"]))
    elif args.group == "models":
        show(api.json("GET", "/v1/models"))
    elif args.group == "tasks" and args.cmd == "create":
        task = create_task(api, args)
        if args.json:
            show(task)
        else:
            console.print(f"task {task['id']} {task['state']}: {task['num_jobs']} jobs")
        if args.follow:
            return _ended(follow(api, task["id"], console), console)
    elif args.group == "tasks" and args.cmd == "list":
        page = api.json("GET", "/v1/tasks", params={"limit": args.limit})
        show(page, tasks_table(console, page["data"]))
    elif args.group == "tasks" and args.cmd == "get":
        show(api.json("GET", f"/v1/tasks/{args.task_id}"))
    elif args.group == "tasks" and args.cmd == "cancel":
        task = api.json("POST", f"/v1/tasks/{args.task_id}/cancel")
        console.print(f"task {task['id']} {task['state']}")
    elif args.group == "tasks" and args.cmd == "follow":
        return _ended(follow(api, args.task_id, console, args.interval), console)
    elif args.group == "samples":
        cli_samples.run(api, args, console, show)
    elif args.group in ("adapter", "merged"):
        _download(args, api, console)
    return 0


def _download(args: argparse.Namespace, api: Api, console: Console) -> None:
    """`adapter download` (PEFT files) or `merged download` (the merged model's directory)."""
    if args.group == "adapter":
        names = download_adapter(api, args.task_id, args.output, args.job)
    else:
        names = download_merged(api, args.task_id, args.output, args.job, args.interval)
    console.print(f"wrote {', '.join(names)} to {args.output}")


def _ended(task: dict, console: Console) -> int:
    if task["state"] == TaskState.SUCCEEDED:
        console.print(f"task {task['id']} succeeded; best job {task['best_job_id']}")
        return 0
    err = (task.get("error") or {}).get("message", "")
    console.print(f"task {task['id']} {task['state']} {err}".rstrip())
    return 1


def main(argv: Sequence[str] | None = None, transport: httpx.BaseTransport | None = None,
         console: Console | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = console or Console()
    try:
        return run(args, Api(args.api_url, args.api_key, transport), console)
    except (CliError, cli_samples.SamplesError) as exc:
        Console(stderr=True).print(f"[red]error:[/red] {exc}")
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's code for SIGINT, no traceback
        Console(stderr=True).print("loraplex: interrupted (Ctrl-C)", soft_wrap=True)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
