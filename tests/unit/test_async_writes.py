"""Checkpoints and exports written off the step loop (trainer.checkpoint.FileWriter, one per
executor): a snapshot taken at the step boundary is what lands on disk however far training has
gone on meanwhile (bit for bit the file a synchronous run writes), a file is announced only once
it is complete, a task leaves only after its writes are done and announced, a failed write fails
its task alone and leaves the previous checkpoint to resume from.

A slow disk is simulated by wrapping the writer's two file functions (save_checkpoint of
trainer.task_files, write_peft of trainer.colocate) with a delay; they also record what they wrote
(a state.pt with the job files it names read in: the names carry each run's own token)."""

from __future__ import annotations

import errno
import math
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from contract.protocol import EarlyExitSettings, EvalSettings
from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir, write_jsonl
from tests.helpers.executor_cfg import executor_config
from trainer import checkpoint_files as checkpoint_mod
from trainer import colocate, task_files
from trainer import export as export_mod
from trainer.checkpoint import FileWriter
from trainer.executor import Callbacks, Executor, ExecutorConfig
from trainer.jobs import TrainJob

pytestmark = pytest.mark.usefixtures("one_thread")
TERMINAL = ("completed", "exited")


class Recorder:
    """Every callback, in one timeline, with each job's train points and announced adapters."""

    def __init__(self) -> None:
        self.timeline: list[tuple] = []
        self.train: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.adapters: dict[str, dict[str, Path]] = defaultdict(dict)
        self.events: list[tuple[str, str, dict]] = []
        self.hooks: list = []  # hook(job, step) after each train point

    def callbacks(self) -> Callbacks:
        def train(j: str, s: int, v: float) -> None:
            self.train[j].append((s, v))
            for hook in self.hooks:
                hook(j, s)

        def adapter(j: str, kind: str, path: Path) -> None:
            self.adapters[j][kind] = Path(path)
            self.timeline.append(("adapter", j, kind))

        return Callbacks(
            on_train_loss=train, on_adapter=adapter,
            on_job_state=lambda j, st, d: self.timeline.append(("state", j, st)),
            on_event=lambda j, m, d: self.events.append((j, m, d)),
            on_task_end=lambda outcome, d: self.timeline.append(("end", outcome)),
        )

    def at(self, *entry: Any) -> int:
        return self.timeline.index(entry)


class SlowDisk:
    """The writer's file functions, each first sleeping (a slow disk), recording what it wrote:
    every state.pt by its global step (as written, read back) and every export by (job, kind,
    the job's step); `lag`: (a checkpoint's global step, the executor's step once it was written)."""

    def __init__(self, mp: pytest.MonkeyPatch, checkpoint_s: float = 0.0, export_s: float = 0.0,
                 fail: Any = None) -> None:
        self.checkpoints: dict[int, dict] = {}
        self.exports: dict[tuple[str, str, str], dict[str, torch.Tensor]] = {}
        self.lag: list[tuple[int, int]] = []
        self.host: Executor | None = None
        real_save, real_peft = checkpoint_mod.save_checkpoint, export_mod.write_peft

        def save(path: Path, payload: dict) -> Path:
            if Path(path).name != "state.pt":  # a job file of the checkpoint: written first
                return real_save(path, payload)
            time.sleep(checkpoint_s)
            if fail is not None:
                fail(Path(path), payload)
            out = real_save(path, payload)
            if self.host is not None:
                self.lag.append((payload["global_step"], self.host.global_step))
            self.checkpoints[payload["global_step"]] = resolved(out)
            return out

        def peft(weights: dict, config: dict, out_dir: Path, dtype: Any = None, metadata: Any = None) -> Path:
            time.sleep(export_s)
            out = real_peft(weights, config, out_dir, dtype, metadata)
            self.exports[(out.parent.name, out.name, metadata["step"])] = load_file(out / "adapter_model.safetensors")
            return out

        mp.setattr(task_files, "save_checkpoint", save)
        mp.setattr(colocate, "write_peft", peft)
        mp.setattr(export_mod, "write_peft", peft)  # the in-loop path (export_peft)


def resolved(path: Path) -> dict:
    """A state.pt as read back, each job's entry replaced by the state in its file."""
    ck = checkpoint_mod.load_checkpoint(path)
    for key in ("active", "queue"):
        ck[key] = [checkpoint_mod.resolve_job(path.parent, d) for d in ck[key]]
    return ck


@pytest.fixture(scope="module")
def files(tmp_path_factory):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("async_writes")
    return (tiny_model_dir("llama", root),
            write_jsonl(root / "a.jsonl", synthetic_rows(30, seed=5, fmt="completion")),
            write_jsonl(root / "b.jsonl", synthetic_rows(24, seed=9, fmt="chat")))


def config(files, out: Path, data: int = 1, **kw) -> ExecutorConfig:  # noqa: ANN001
    """Six jobs of 12 steps, three at a time (warmup rotation, ranking, a diverging job)."""
    jobs = [TrainJob(f"{out.name}{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=lr, batch_size=b, max_steps=12, seed=i)
            for i, (r, lr, b) in enumerate([(4, 3e-3, 2), (8, 1e-2, 2), (2, 1e-3, 3), (4, 1e30, 2),
                                            (8, 5e-3, 3), (4, 2e-3, 2)])]
    base = dict(model_dir=str(files[0]), train_file=str(files[data]), output_dir=str(out), jobs=jobs,
                max_seq_len=48, eval=EvalSettings(eval_every_steps=4, eval_max_samples=None),
                checkpoint_every=3, max_active_jobs=3,
                early_exit=EarlyExitSettings(warmup_fraction=0.2, keep_fraction=0.5, tau_gap=10.0))
    base.update(kw)
    return executor_config(**base)


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal bit for bit: tensors (dtype, shape, values, NaN where NaN), floats, containers,
    and objects (monitors, ranking) by their attributes."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert isinstance(b, float) and (a == b or (math.isnan(a) and math.isnan(b))), where
    elif hasattr(a, "__dict__") and not hasattr(type(a), "model_fields"):  # not a pydantic model
        assert type(a) is type(b), where
        assert_same(vars(a), vars(b), where)
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def in_loop(files, tmp_path_factory):  # noqa: ANN001, ANN201
    """The reference: the same task with every file written in the step loop (async_writes off)."""
    out = tmp_path_factory.mktemp("in_loop") / "job"
    rec = Recorder()
    with pytest.MonkeyPatch.context() as mp:
        disk = SlowDisk(mp)
        ex = Executor(config(files, out, async_writes=False), rec.callbacks())
        assert ex.writer is None
        status = ex.run()
    return rec, disk, status


def test_snapshot_is_the_state_at_its_step_while_training_goes_on(files, tmp_path, in_loop, monkeypatch) -> None:  # noqa: ANN001
    """With a slow disk the executor trains on while each snapshot is written; every state.pt
    and every export is still exactly what the in-loop run wrote at the same step."""
    ref, ref_disk, ref_status = in_loop
    disk = SlowDisk(monkeypatch, checkpoint_s=0.25, export_s=0.05)
    rec = Recorder()
    ex = Executor(config(files, tmp_path / "job"), rec.callbacks())
    disk.host = ex
    status = ex.run()
    assert ex.writer is not None and status == ref_status
    assert any(done > taken for taken, done in disk.lag)  # training went on during a write
    assert_same(dict(rec.train), dict(ref.train))  # the run itself is the same, bit for bit
    assert sorted(disk.checkpoints) == sorted(ref_disk.checkpoints) and len(disk.checkpoints) >= 5
    for step, ck in ref_disk.checkpoints.items():
        assert_same(disk.checkpoints[step], ck, f"state.pt@{step}")
    # a final adapter at its best export's step is that export's files (TaskFiles.link), not a write
    linked = ref_disk.exports.keys() - disk.exports.keys()
    assert disk.exports.keys() <= ref_disk.exports.keys() and linked
    assert all(kind == "final" and (job, "best", step) in disk.exports for job, kind, step in linked)
    assert any(kind == "best" for _, kind, _ in disk.exports)
    for key, weights in ref_disk.exports.items():
        got = disk.exports.get(key) or load_file(str(tmp_path / "job" / "jobs" / key[0] / key[1] /
                                                     "adapter_model.safetensors"))
        assert_same(got, weights, str(key))
    timings = next(d for _, m, d in rec.events if m == "timings")
    assert timings["writer_checkpoint_s"] >= 0.25 * len(disk.lag)  # the writer's own seconds
    assert timings["writer_export_s"] >= 0.05 * len(disk.exports)
    assert {"checkpoint_s", "export_s"} <= timings.keys()  # the loop's: snapshots and waits


def test_a_file_is_announced_only_once_complete_and_the_task_ends_after(files, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Slow writes: every adapter announced exists whole when announced, a job's terminal state
    comes after its adapters, the task's end after all of them and its last state.pt; whatever
    state.pt a report sees (what the runner uploads) is a whole one."""
    SlowDisk(monkeypatch, checkpoint_s=0.05, export_s=0.03)
    rec = Recorder()
    out = tmp_path / "job"
    cfg = config(files, out)
    seen: dict[str, Any] = {"state": None, "loads": 0}
    base = rec.callbacks()

    def adapter(j: str, kind: str, path: Path) -> None:
        weights = load_file(str(Path(path) / "adapter_model.safetensors"))  # whole, readable
        assert weights and (Path(path) / "adapter_config.json").is_file()
        base.on_adapter(j, kind, path)

    def job_state(j: str, st: str, d: dict) -> None:
        if st in TERMINAL:  # what a runner uploads then is on disk
            assert all((p / "adapter_model.safetensors").is_file() for p in rec.adapters[j].values())
        base.on_job_state(j, st, d)

    def train(j: str, s: int, v: float) -> None:
        path = out / "state.pt"
        if path.exists() and path.stat().st_ino != seen["state"]:  # a new one: read it whole
            seen["state"] = path.stat().st_ino
            assert torch.load(path, map_location="cpu", weights_only=False)["global_step"] <= ex.global_step
            seen["loads"] += 1
        base.on_train_loss(j, s, v)

    def end(outcome: str, d: dict) -> None:
        ck = torch.load(out / "state.pt", map_location="cpu", weights_only=False)
        assert ck["global_step"] == d["global_step"] and not ck["active"]  # the final one, whole
        assert not ex.first.files.writes and not ex.first.files.held  # nothing left to write or to tell
        base.on_task_end(outcome, d)

    ex = Executor(cfg, Callbacks(on_train_loss=train, on_adapter=adapter, on_job_state=job_state,
                                 on_event=base.on_event, on_task_end=end))
    status = ex.run()
    assert seen["loads"] >= 1  # a report saw a new state.pt (whole, checked above)
    assert rec.timeline[-1] == ("end", "succeeded")
    completed = [j for j, st in status.items() if st["state"] == "completed"]
    assert len(completed) == 3
    for j in completed:
        assert rec.at("adapter", j, "final") < rec.at("state", j, "completed") < len(rec.timeline) - 1
        assert rec.adapters[j].keys() == {"best", "final"}
    for j, st in status.items():  # every job's terminal state was told, before the end
        assert ("state", j, st["state"]) in rec.timeline


def test_a_pause_leaves_after_its_checkpoint_is_whole_and_resumes(files, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A co-located task paused (detach 'paused') while its checkpoint is slow to write: its
    outcome comes after state.pt of the pause step is on disk; a later executor resumes it there
    and no step is lost or trained twice. The other task finishes."""
    SlowDisk(monkeypatch, checkpoint_s=0.3)
    rec_a, before, after = Recorder(), Recorder(), Recorder()
    cfg_a = config(files, tmp_path / "a", checkpoint_every=10**6, max_active_jobs=None)
    cfg_b = config(files, tmp_path / "b", data=2, checkpoint_every=10**6,
                   early_exit=EarlyExitSettings(enabled=False), max_active_jobs=None)
    cfg_b.jobs = cfg_b.jobs[:2]
    ends: list[tuple[str, int, int]] = []
    cb_b = before.callbacks()
    real_end = cb_b.on_task_end

    def b_end(outcome: str, d: dict) -> None:
        ck = torch.load(tmp_path / "b" / "state.pt", map_location="cpu", weights_only=False)
        ends.append((outcome, ck["global_step"], d["global_step"]))
        real_end(outcome, d)

    cb_b.on_task_end = b_end
    host = Executor(cfg_a, rec_a.callbacks(), task_id="A")
    host.attach_task(cfg_b, cb_b, task_id="B")
    before.hooks.append(lambda j, s: s == 3 and host.detach_task("B", "paused"))
    host.run()
    assert ends == [("paused", 3, 3)]  # told after the pause step's checkpoint was whole
    assert host.results()["A"]["outcome"] == "succeeded"
    assert Executor(cfg_b, after.callbacks()).run() == {j.job_id: {"state": "completed", "exit_reason": None}
                                                        for j in cfg_b.jobs}
    for j in ("b0", "b1"):
        assert [s for s, _ in before.train[j] + after.train[j]] == list(range(1, 13)), j


def test_a_failed_write_fails_only_its_task(files, tmp_path) -> None:  # noqa: ANN001
    """B's state.pt cannot be written (its temp name is taken by a directory): B fails with that
    error, once, its checkpoint never announced; A on the same executor finishes and writes."""
    rec_a, rec_b = Recorder(), Recorder()
    cfg_a = config(files, tmp_path / "a", max_active_jobs=None)
    cfg_b = config(files, tmp_path / "b", data=2)
    (tmp_path / "b" / "state.pt.tmp").mkdir(parents=True)
    host = Executor(cfg_a, rec_a.callbacks(), task_id="A")
    host.attach_task(cfg_b, rec_b.callbacks(), task_id="B")
    host.run()
    res = host.results()
    assert res["B"]["outcome"] == "failed" and "Is a directory" in res["B"]["error"]
    assert [e for e in rec_b.timeline if e[0] == "end"] == [("end", "failed")]
    assert not (tmp_path / "b" / "state.pt").exists()
    assert res["A"]["outcome"] == "succeeded" and res["A"]["error"] is None
    assert 3 <= max(len(p) for p in rec_b.train.values()) < 12  # B trained, then stopped early
    assert sum(st["state"] == "completed" for st in res["A"]["status"].values()) == 3
    assert torch.load(tmp_path / "a" / "state.pt", map_location="cpu", weights_only=False)["global_step"] > 0
    for adapters in rec_a.adapters.values():
        assert all((p / "adapter_model.safetensors").is_file() for p in adapters.values())


def test_a_write_cut_off_midway_leaves_the_last_checkpoint_to_resume_from(files, tmp_path, in_loop,
                                                                            monkeypatch) -> None:  # noqa: ANN001
    """The third state.pt write dies half way (disk full): the task fails, state.pt is still the
    second one, whole, and a new executor resumes from it to the very numbers of an unbroken run."""
    ref, _, ref_status = in_loop
    calls = {"n": 0}

    def disk_full(path: Path, payload: dict) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            path.with_name(path.name + ".tmp").write_bytes(b"PK\x03\x04 half a zip")
            raise OSError(errno.ENOSPC, "No space left on device")

    SlowDisk(monkeypatch, fail=disk_full)
    out = tmp_path / "job"
    before = Recorder()
    with pytest.raises(OSError, match="No space"):
        Executor(config(files, out), before.callbacks()).run()
    assert torch.load(out / "state.pt", map_location="cpu", weights_only=False)["global_step"] == 6
    for adapters in before.adapters.values():  # what it announced is there
        assert all((p / "adapter_model.safetensors").is_file() for p in adapters.values())
    monkeypatch.undo()
    after = Recorder()
    assert Executor(config(files, out), after.callbacks()).run() == ref_status
    assert any(m == "resumed" for _, m, _ in after.events)
    for j, points in ref.train.items():
        resumed_from = min((s for s, _ in after.train[j]), default=math.inf)
        assert_same([p for p in before.train[j] if p[0] < resumed_from] + after.train[j], points, j)


def test_file_writer_keeps_order_bounds_its_snapshots_and_reports_errors() -> None:
    """Writes run in the order submitted; `room` waits while the queued snapshots exceed the
    bound (one always may wait); an exception is the write's, the thread goes on; close drains."""
    writer = FileWriter(max_pending_bytes=100)
    gate = threading.Event()
    done: list[int] = []

    def work(i: int) -> Any:
        def run() -> None:
            if i == 0:
                gate.wait(10)
            if i == 2:
                raise OSError("disk gone")
            done.append(i)
        return run

    first = writer.submit("t", "checkpoint", 80, work(0))
    writer.room(20)  # 80 + 20 bytes fit the bound
    waited = threading.Event()

    def second() -> None:
        writer.room(80)
        waited.set()

    t = threading.Thread(target=second)
    t.start()
    assert not waited.wait(0.3)  # the loop would wait here: 160 bytes > 100
    gate.set()
    assert waited.wait(10) and first.done.wait(10)
    t.join()
    writes = [writer.submit("t", "export", 10, work(i)) for i in (1, 2, 3)]
    writer.close()
    assert done == [0, 1, 3] and all(w.done.is_set() for w in writes)
    assert isinstance(writes[1].error, OSError) and writes[0].error is None and writes[1].work is None
    assert writer.busy["export"] > 0.0 and writer._pending_bytes == 0


def test_file_writer_thread_stops_on_close_and_a_later_submit_starts_it_again() -> None:
    """The writer's thread (a daemon: a killed executor still exits) starts on the first submit,
    waits for writes without spinning, ends on close once its queue is drained, and a submit
    after close starts a new one; close with nothing ever submitted returns at once."""
    FileWriter().close()
    writer = FileWriter()
    threads: list[threading.Thread] = []

    def work() -> None:
        threads.append(threading.current_thread())

    writer.submit("t", "checkpoint", 1, work).done.wait(10)
    thread = threads[0]
    assert thread.name == "loraplex-writer" and thread.daemon and thread.is_alive()
    time.sleep(0.1)  # its look at the queue after the write
    runs = writer._worker.health().runs
    time.sleep(0.3)
    assert writer._worker.health().runs - runs <= 1  # idle: it waits for the next submit
    writer.submit("t", "export", 1, work).done.wait(10)
    assert threads[1] is thread  # one thread for the writes in between
    gate = threading.Event()
    last = writer.submit("t", "export", 1, lambda: gate.wait(10) and work())
    closing = threading.Thread(target=writer.close)
    closing.start()
    time.sleep(0.1)
    assert closing.is_alive() and not last.done.is_set()  # close waits for the queued write
    gate.set()
    closing.join(10)
    assert last.done.is_set() and threads[2] is thread and not thread.is_alive()
    assert writer.submit("t", "checkpoint", 1, work).done.wait(10)
    assert threads[3] is not thread and threads[3].daemon and threads[3].is_alive()
    writer.close()
    assert not threads[3].is_alive() and writer._pending_bytes == 0
    assert all(w > 0.0 for w in writer.busy.values())
