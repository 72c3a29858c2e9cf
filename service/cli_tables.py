"""The user CLI's tables (service.cli): jobs with their losses, files, tasks, samples. Ids are never cut:
a table that does not fit the terminal leaves out its least needed columns (`--json` shows
everything), and output that is not a terminal (a pipe, a file) gets every column whole."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class Col:
    header: str
    right: bool = False  # numbers
    drop: int | None = None  # the order it is left out on a narrow terminal; None: always shown


def fitted(console: Console, cols: Sequence[Col], rows: Sequence[Sequence[str]]) -> Table:
    """A table of `rows` whose cells are never cut or wrapped: columns are left out, lowest
    `drop` first, until it fits the terminal; a note under it names them."""
    widths = [max([len(c.header), *(len(r[i]) for r in rows)]) for i, c in enumerate(cols)]
    shown = list(range(len(cols)))
    room = console.width if console.is_terminal else None

    def width(idx: list[int]) -> int:  # cells + one space of padding each side + borders
        return sum(widths[i] + 3 for i in idx) + 1

    droppable = sorted(((c.drop, i) for i, c in enumerate(cols) if c.drop is not None),
                       reverse=True)
    while room is not None and width(shown) > room and droppable:
        shown.remove(droppable.pop()[1])
    left_out = [cols[i].header for i in range(len(cols)) if i not in shown]
    caption = f"left out to fit the terminal: {', '.join(left_out)} (--json shows all)"
    table = Table(caption=caption if left_out else None, caption_justify="left")
    for i in shown:
        table.add_column(cols[i].header, justify="right" if cols[i].right else "left",
                         no_wrap=True, min_width=widths[i])
    for r in rows:
        table.add_row(*(r[i] for i in shown))
    return table


def print_table(console: Console, table: Table) -> None:
    """Print at the table's own width when it is wider than the console (never cropped)."""
    need = sum((c.min_width or 0) + 3 for c in table.columns) + 1
    console.print(table, width=max(console.width, need), crop=False)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _when(unix: int | str | None) -> str:
    """An OpenAI-style unix-seconds timestamp (or an ISO string) as UTC ``YYYY-MM-DD HH:MM:SS``."""
    if isinstance(unix, int | float):
        return datetime.fromtimestamp(unix, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    return str(unix or "-")[:19].replace("T", " ")


def jobs_table(jobs: Sequence[dict], curves: Sequence[dict], best_job_id: str | None = None
               ) -> Table:
    """One row per job: configuration, state (with the exit reason), latest losses."""
    last = {c["job_id"]: c for c in curves}
    table = Table(expand=False)
    for col in ("#", "lr", "rank", "alpha", "batch", "state", "step", "train loss",
                "val loss", "best val"):
        table.add_column(col, justify="right" if col not in ("state",) else "left")
    for job in sorted(jobs, key=lambda j: j["index"]):
        hp = job["hyperparameters"]
        curve = last.get(job["id"], {})
        train = [p for p in curve.get("train", []) if p.get("loss") is not None]
        val = [p for p in curve.get("val", []) if p.get("loss") is not None]
        state = job["state"] + (f" ({job['exit_reason']})" if job.get("exit_reason") else "")
        if job["id"] == best_job_id:
            state += " *best*"
        step = train[-1]["step"] if train else job.get("last_step")
        table.add_row(str(job["index"]), f"{hp.get('learning_rate', 0):g}",
                      str(hp.get("lora_rank", "")), f"{hp.get('lora_alpha', 0):g}",
                      str(hp.get("batch_size", "")), state, "-" if step is None else str(step),
                      _fmt(train[-1]["loss"] if train else None),
                      _fmt(val[-1]["loss"] if val else None), _fmt(job.get("best_val_loss")))
    return table


FILE_COLS = (Col("id"), Col("filename", drop=4), Col("format", drop=3), Col("records", True, 1),
             Col("bytes", True, 0), Col("status", drop=5), Col("created", drop=2))


def files_table(console: Console, files: Sequence[dict]) -> Table:
    """One row per file, in the OpenAI file object's fields plus what loraplex found in it."""
    rows = [(f["id"], f["filename"], f.get("format") or "-", str(f.get("line_count", "-")),
             str(f["bytes"]), f.get("status") or "-", _when(f.get("created_at"))) for f in files]
    return fitted(console, FILE_COLS, rows)


TASK_COLS = (Col("id"), Col("state"), Col("model", drop=3), Col("jobs", drop=1),
             Col("best job", drop=2), Col("created", drop=0))


def tasks_table(console: Console, tasks: Sequence[dict]) -> Table:
    rows = []
    for t in tasks:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(t.get("job_counts", {}).items()))
        rows.append((t["id"], t["state"], t["base_model"], f"{t['num_jobs']} ({counts})",
                     t.get("best_job_id") or "-", _when(t.get("created_at"))))
    return fitted(console, TASK_COLS, rows)


def print_samples(console: Console, page: dict) -> None:
    """A task's samples (or a sample request's), prompt by prompt: the base model's completion,
    then each configuration's (its job id whole), as the dashboard shows them side by side."""
    if not page["data"]:
        console.print(f"no samples yet for {page['task_id']} (they come when the task succeeds)")
        return
    last = None
    for row in page["data"]:
        if row["prompt"] != last:
            last = row["prompt"]
            console.rule()
            console.print("[bold]prompt[/bold]", soft_wrap=True)
            console.print(row["prompt"], markup=False, soft_wrap=True)
        who = "base model" if row["job_id"] is None else row["job_id"]
        console.print(f"[bold]{who}[/bold] ({row['tokens']} tokens)", soft_wrap=True)
        console.print(row["completion"], markup=False, soft_wrap=True)
    console.rule()
    if page.get("file_id"):
        console.print(f"file {page['file_id']}", soft_wrap=True)
