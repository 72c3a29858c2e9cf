"""Unit: the samples a task ends with (trainer.task_samples through the executor, CPU): every
prompt answered by the base model and the top k jobs by best validation loss, written to
samples.jsonl and reported; inline prompts; a failure of the samples leaves the task succeeded;
disabled, nothing is made."""

from __future__ import annotations

import json
import math
import time

import pytest

from contract.protocol import SampleSettings
from tests.unit.test_engine_executor import Recorder, config
from trainer import sampling
from trainer.executor import Executor

pytestmark = pytest.mark.usefixtures("one_thread")


def slowed(monkeypatch, module, name: str, seconds: float, clock: list, label) -> None:  # noqa: ANN001
    """module.name sleeps `seconds` first; its end goes on the clock as label(*its arguments)."""
    real = getattr(module, name)

    def slow(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        time.sleep(seconds)
        out = real(*a, **kw)
        clock.append((label(*a), time.monotonic()))
        return out

    monkeypatch.setattr(module, name, slow)


def timed_decode(monkeypatch, clock: list) -> None:  # noqa: ANN001
    """The samples' decode notes its start on the clock."""
    real = sampling.generate

    def timed(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        clock.append(("decode", time.monotonic()))
        return real(*a, **kw)

    monkeypatch.setattr(sampling, "generate", timed)


def samples_of(rec: Recorder) -> list[dict]:
    found = [d for j, m, d in rec.events if m == "samples"]
    assert len(found) <= 1
    return found[0]["samples"] if found else []


def test_a_task_ends_with_its_leading_adapters_and_the_base_model_side_by_side(tmp_path) -> None:  # noqa: ANN001
    rec = Recorder()
    cfg = config(tmp_path, "run", samples=SampleSettings(top_k=2, n_prompts=3, max_new_tokens=5))
    status = Executor(cfg, rec.callbacks()).run()
    rows = samples_of(rec)
    assert len(rows) == 3 * (1 + 2)
    best = {j: min(v for _, v in rec.evals[j]) for j in rec.evals if rec.evals[j]}
    best = {j: v for j, v in best.items() if math.isfinite(v) and
            (tmp_path / "run" / "jobs" / j / "best" / "adapter_model.safetensors").exists()}
    leaders = sorted(best, key=best.get)[:2]
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    assert len(prompts) == 3
    for p in prompts:  # per prompt: the base model first, then the leaders by best validation loss
        assert [r["job_id"] for r in rows if r["prompt"] == p] == [None, *leaders]
    assert all(1 <= r["tokens"] <= 5 and isinstance(r["completion"], str) for r in rows)
    written = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert written == rows
    assert all(status[j]["state"] == "completed" for j in leaders)
    timings = [d for j, m, d in rec.events if m == "timings"][0]
    assert timings["samples_s"] > 0
    # the phase's split, as details: the adapters' attach, the decode's parts, the text
    parts = {k.removeprefix("samples_part_"): v for k, v in timings.items() if k.startswith("samples_part_")}
    assert {"attach", "point", "steps", "detach", "text"} <= set(parts)
    assert all(v >= 0 for v in parts.values()) and parts["steps"] > 0
    assert sum(parts.values()) <= timings["samples_s"] + 1e-3


def test_inline_prompts_and_a_failure_that_leaves_the_task_succeeded(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    seen = {}

    def broken(engine, prompts, job_ids, **kw):  # noqa: ANN001, ANN003, ANN202
        seen["rows"] = (len(prompts), list(job_ids))
        raise RuntimeError("decode broke at /srv/secret/path.py")

    monkeypatch.setattr(sampling, "generate", broken)
    rec = Recorder()
    cfg = config(tmp_path, "broken", samples=SampleSettings(top_k=1, prompts=["Tell me", "Why"], max_new_tokens=3))
    status = Executor(cfg, rec.callbacks()).run()
    assert seen["rows"][0] == 2 * 2 and seen["rows"][1][0] is None  # 2 inline prompts x (base + 1)
    assert samples_of(rec) == []
    [failed] = [d for j, m, d in rec.events if m == "samples_failed"]
    assert "decode broke" in failed["error"] and "/srv" not in failed["error"]  # no server path
    assert not (tmp_path / "broken" / "samples.jsonl").exists()
    assert any(s["state"] == "completed" for s in status.values())
    assert not any(j.startswith("__sample__") for j in status)


def test_disabled_samples_make_nothing(tmp_path) -> None:  # noqa: ANN001
    rec = Recorder()
    Executor(config(tmp_path, "off", samples=SampleSettings(enabled=False)), rec.callbacks()).run()
    assert samples_of(rec) == [] and not (tmp_path / "off" / "samples.jsonl").exists()
    assert not any(m.startswith("samples") for _, m, _ in rec.events)


def test_a_base_models_row_survives_the_daemons_serialisation() -> None:
    """The daemon's client leaves None out of a report's JSON: a base model's row (job_id null)
    must still be a valid report on the service's side."""
    from contract.protocol import Sample, TaskSamples

    msg = TaskSamples(placement_id="pl_x", samples=[Sample(prompt="a", completion="b", tokens=1)])
    again = TaskSamples.model_validate(msg.model_dump(exclude_none=True))
    assert again.samples[0].job_id is None


def test_a_long_prompt_is_shown_by_its_end_within_the_reports_bound() -> None:
    from contract.protocol import Sample
    from trainer.task_samples import PROMPT_CHARS, shown

    long = "x" * 10_000 + "the end"
    cut = shown(long)
    assert len(cut) == PROMPT_CHARS and cut.startswith("…") and cut.endswith("the end")
    Sample(prompt=cut, completion="y", tokens=1)  # within the contract's bound
    assert shown("short") == "short"


def test_the_samples_decode_while_the_last_writes_go_on_and_are_announced_after_them(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # issue 41: the samples wait for the best adapters' files only; the final adapters and the last
    # checkpoint are written meanwhile, and every file of the task is announced before the samples
    from trainer import task_files

    clock: list[tuple[str, float]] = []
    slowed(monkeypatch, task_files, "write_checkpoint", 0.6, clock, lambda *a: "checkpoint written")
    timed_decode(monkeypatch, clock)
    order: list[str] = []
    rec = Recorder()
    cb = rec.callbacks()
    on_adapter, on_state, on_event = cb.on_adapter, cb.on_job_state, cb.on_event
    cb.on_adapter = lambda j, k, p: (order.append(f"adapter {j} {k}"), on_adapter(j, k, p))
    cb.on_job_state = lambda j, s, d: (order.append(f"state {j} {s}"), on_state(j, s, d))
    cb.on_event = lambda j, m, d: (order.append(m), on_event(j, m, d))
    cfg = config(tmp_path, "overlap", samples=SampleSettings(top_k=2, n_prompts=2, max_new_tokens=3))
    Executor(cfg, cb).run()
    assert samples_of(rec)
    decode = next(t for what, t in clock if what == "decode")
    assert clock[-1][0] == "checkpoint written" and clock[-1][1] > decode  # the decode did not wait for it
    last_file = max(i for i, what in enumerate(order) if what.startswith(("adapter ", "state ")))
    assert order.index("samples") > last_file
    assert any(what.endswith(" final") for what in order)


def test_the_samples_read_a_best_adapter_still_being_written_from_its_snapshot(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # the samples do not wait for the writer: a best adapter whose files are not complete is read
    # from the snapshot its write holds (TaskFiles.pending_best), and the samples are the same
    from trainer import colocate

    settings = SampleSettings(top_k=2, n_prompts=2, max_new_tokens=4)
    rec = Recorder()
    Executor(config(tmp_path, "fast", samples=settings), rec.callbacks()).run()
    expected = samples_of(rec)
    assert len(expected) == 2 * 3

    clock: list[tuple[str, float]] = []
    slowed(monkeypatch, colocate, "write_peft", 0.4, clock, lambda state, config_dict, path: f"written {path.name}")
    timed_decode(monkeypatch, clock)
    rec = Recorder()
    Executor(config(tmp_path, "slow", samples=settings), rec.callbacks()).run()
    decode = next(t for what, t in clock if what == "decode")
    last_best = max(t for what, t in clock if what == "written best")
    assert decode < last_best  # it read at least one best adapter before its files were complete
    assert samples_of(rec) == expected
    assert (tmp_path / "slow" / "samples.jsonl").exists()


def test_the_phase_clock_counts_garbage_collection_and_parts_since_a_task_joined() -> None:
    import gc

    from trainer.phase_clock import PhaseClock, collecting

    parts: dict[str, float] = {}
    with collecting(parts):
        gc.collect()
    assert parts["gc"] > 0
    seen = parts["gc"]
    gc.collect()  # after the block: not counted
    assert parts["gc"] == seen
    clock = PhaseClock(None)
    clock.start()
    clock.add_parts("samples", {"steps": 1.5, "token_steps": 16})

    class Task:  # what the clock reads and marks of a task (trainer.phase_clock.Joined)
        joined_at = None
        phases_at_join: dict = {}
        first_step_s = None

    task = Task()
    clock.mark_joined(task, at_start=False)  # a task that joins after another one's samples
    clock.add_parts("samples", {"steps": 0.5, "token_steps": 8})
    assert clock.split()["samples_part_steps"] == 2.0 and clock.split()["samples_part_token_steps"] == 24
    own = clock.split(task)
    assert own["samples_part_steps"] == 0.5 and own["samples_part_token_steps"] == 8
