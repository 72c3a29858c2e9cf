"""Checkpoints whose size follows what changed (trainer.checkpoint_files): each job's state in
its own immutable file named by state.pt, written only when the job trained since its last one (a
parked job once), the files state.pt no longer names deleted; resume from it (and from the older
inline format) exact; a job file missing or cut, or a write killed between the job files and
state.pt, never gives half a resume."""

from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from contract.protocol import EarlyExitSettings, EvalSettings
from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir, write_jsonl
from tests.helpers.executor_cfg import executor_config
from trainer import checkpoint_files as files_mod
from trainer import task_files
from trainer.checkpoint_files import (
    CheckpointIncomplete,
    job_refs,
    load_checkpoint,
    resolve_job,
    write_checkpoint,
)
from trainer.executor import Callbacks, Executor, ExecutorConfig
from trainer.jobs import TrainJob

pytestmark = pytest.mark.usefixtures("one_thread")


def named(state: Path) -> list[str]:
    """The job files a complete state.pt names (load_checkpoint refuses an incomplete one)."""
    return [ref["file"] for ref in job_refs(load_checkpoint(state, mmap=True))]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("ckpt_files")
    return tiny_model_dir("llama", root), write_jsonl(root / "a.jsonl", synthetic_rows(30, seed=5, fmt="completion"))


def config(inputs, out: Path, **kw) -> ExecutorConfig:  # noqa: ANN001
    """Six jobs of 12 steps, two at a time: each pair warms up (3 steps) and parks while the next
    pair warms up, then the ranking keeps half; a checkpoint after every step."""
    jobs = [TrainJob(f"j{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=lr, batch_size=2, max_steps=12, seed=i)
            for i, (r, lr) in enumerate([(4, 3e-3), (8, 1e-2), (2, 1e-3), (4, 5e-3), (8, 5e-3), (4, 2e-3)])]
    base = dict(model_dir=str(inputs[0]), train_file=str(inputs[1]), output_dir=str(out), jobs=jobs,
                max_seq_len=48, eval=EvalSettings(eval_every_steps=3, eval_max_samples=None),
                checkpoint_every=1, max_active_jobs=2,
                early_exit=EarlyExitSettings(warmup_fraction=0.25, keep_fraction=0.5, tau_gap=10.0))
    base.update(kw)
    return executor_config(**base)


class Recorder:
    def __init__(self) -> None:
        self.train: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.events: list[tuple[str, str, dict]] = []

    def callbacks(self) -> Callbacks:
        return Callbacks(on_train_loss=lambda j, s, v: self.train[j].append((s, v)),
                         on_event=lambda j, m, d: self.events.append((j, m, d)))


class Disk:
    """Every file the writer saves, and at each state.pt: what it names and what is on disk."""

    def __init__(self, mp: pytest.MonkeyPatch, out: Path) -> None:
        self.saved: list[str] = []
        self.states: list[dict] = []  # {"refs": {job: file}, "disk": {name: (inode, bytes)}, "step"}
        real = files_mod.save_checkpoint

        def save(path: Path, payload: dict) -> Path:
            self.saved.append(Path(path).name)
            if Path(path).name == "state.pt":
                disk = {p.name: (p.stat().st_ino, p.stat().st_size) for p in out.glob("job-*")}
                self.states.append({"refs": {d["spec"]["job_id"]: d["file"] for d in job_refs(payload)},
                                    "disk": disk, "step": payload["global_step"]})
            return real(path, payload)

        mp.setattr(task_files, "save_checkpoint", save)


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):  # noqa: ANN001, ANN201
    rec = Recorder()
    status = Executor(config(inputs, tmp_path_factory.mktemp("ref") / "run"), rec.callbacks()).run()
    return rec, status


def test_a_parked_job_is_written_once_and_unreferenced_files_go(inputs, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    out = tmp_path / "run"
    disk = Disk(monkeypatch, out)
    Executor(config(inputs, out), Recorder().callbacks()).run()
    job_files = [n for n in disk.saved if n.startswith("job-")]
    assert len(job_files) == len(set(job_files))  # every job file written once, never rewritten
    # a parked job: the same file named by several consecutive state.pt, one inode throughout
    runs: dict[str, list[int]] = defaultdict(list)
    for s in disk.states:
        for name in s["refs"].values():
            runs[name].append(s["step"])
            assert name in s["disk"]  # written before state.pt names it
    parked = {n: steps for n, steps in runs.items() if len(steps) >= 3}
    assert parked, runs
    for name in parked:
        inodes = {s["disk"][name][0] for s in disk.states if name in s["disk"]}
        assert len(inodes) == 1 and job_files.count(name) == 1
    # an active job: a new file at each checkpoint it trained in
    trained = [s for s in disk.states if "j0" in s["refs"]][:3]
    assert len({s["refs"]["j0"] for s in trained}) == 3
    # on disk while state.pt is written: the last one's files and this one's, nothing older
    for prev, cur in zip(disk.states, disk.states[1:], strict=False):
        assert set(cur["disk"]) == set(prev["refs"].values()) | set(cur["refs"].values())
        # parked jobs count once: the bytes of two consecutive checkpoints are under two copies
        both = sum(b for _, b in cur["disk"].values())
        one = sum(cur["disk"][n][1] for n in cur["refs"].values())
        old_only = set(prev["refs"].values()) - set(cur["refs"].values())
        assert both == one + sum(cur["disk"][n][1] for n in old_only)
        if len(set(prev["refs"].values()) & set(cur["refs"].values())) >= 2:  # parked jobs
            assert both < 2 * one
    final = load_checkpoint(out / "state.pt")
    assert {p.name for p in out.glob("job-*")} == {d["file"] for d in job_refs(final)}
    assert not final["active"]  # the task is over: no job left, no job file
    assert not list(out.glob("job-*"))


def _stopped(inputs, root: Path, after: int) -> Path:  # noqa: ANN001
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] >= after

    out = root / "stopped"
    ex = Executor(config(inputs, out, checkpoint_every=2), Recorder().callbacks(), stop_requested=stop)
    ex.run()
    assert ex.stopped
    return out


def _inline(directory: Path) -> None:
    """Rewrite a state.pt in the older format: every job's state inline, no job file."""
    ck = load_checkpoint(directory / "state.pt")
    for key in ("active", "queue"):
        ck[key] = [resolve_job(directory, d) for d in ck[key]]
    del ck["format"]
    for p in directory.glob("job-*"):
        p.unlink()
    torch.save(ck, directory / "state.pt")


@pytest.mark.parametrize("fmt", ["files", "inline"])
def test_resume_from_either_format_is_exact(inputs, tmp_path, reference, fmt) -> None:  # noqa: ANN001
    ref, ref_status = reference
    before = _stopped(inputs, tmp_path, after=5)  # mid warmup rotation: jobs parked and active
    ck = load_checkpoint(before / "state.pt")
    assert ck["format"] == 2 and ck["queue"] and job_refs(ck)
    assert all("adapter" not in d for d in ck["active"] + ck["queue"])  # no tensors inline
    if fmt == "inline":
        _inline(before)
    rec = Recorder()
    assert Executor(config(inputs, before), rec.callbacks()).run() == ref_status
    assert any(m == "resumed" for _, m, _ in rec.events)
    for j, points in ref.train.items():
        got = rec.train.get(j, [])
        assert points[len(points) - len(got):] == got, j  # bit for bit from where it resumed


def test_a_missing_or_cut_job_file_makes_the_checkpoint_unusable(inputs, tmp_path) -> None:  # noqa: ANN001
    out = _stopped(inputs, tmp_path, after=5)
    names = named(out / "state.pt")
    assert names and all((out / n).is_file() for n in names)
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    data = (cut / names[0]).read_bytes()
    (cut / names[0]).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointIncomplete, match="bytes"):
        named(cut / "state.pt")
    (out / names[-1]).unlink()
    with pytest.raises(CheckpointIncomplete, match="missing"):
        load_checkpoint(out / "state.pt")
    with pytest.raises(CheckpointIncomplete):  # the executor refuses it: no half resume
        Executor(config(inputs, out), Recorder().callbacks()).run()


def test_a_write_killed_after_the_job_files_leaves_the_previous_checkpoint(tmp_path) -> None:
    """The writer dies after the new job files, before state.pt: the previous state.pt and every
    file it names are still there, whole; the next complete write deletes the leftovers."""
    t = torch.arange(1000, dtype=torch.float32)

    def entry(job: str, step: int, name: str) -> dict:
        return {"file": name, "spec": {"job_id": job}, "step": step, "total_steps": 9}

    first = {"active": [entry("a", 1, "job-a-1-x.pt")], "queue": [entry("b", 1, "job-b-1-x.pt")],
             "global_step": 1}
    write_checkpoint(tmp_path, first, {"job-a-1-x.pt": {"w": t}, "job-b-1-x.pt": {"w": t * 2}})
    second = {"active": [entry("a", 2, "job-a-2-x.pt")], "queue": [entry("b", 1, "job-b-1-x.pt")],
              "global_step": 2}

    def dies(path: Path, payload: dict) -> Path:
        if path.name == "state.pt":
            raise KeyboardInterrupt("kill -9")
        return files_mod.save_checkpoint(path, payload)

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path, second, {"job-a-2-x.pt": {"w": t + 1}}, save=dies)
    ck = load_checkpoint(tmp_path / "state.pt")
    assert ck["global_step"] == 1 and named(tmp_path / "state.pt") == ["job-a-1-x.pt", "job-b-1-x.pt"]
    assert torch.equal(resolve_job(tmp_path, ck["active"][0])["w"], t)
    write_checkpoint(tmp_path, second, {"job-a-2-x.pt": {"w": t + 1}})
    assert sorted(p.name for p in tmp_path.glob("job-*")) == ["job-a-2-x.pt", "job-b-1-x.pt"]
    missing = {"active": [entry("c", 1, "job-c-1-x.pt")], "queue": [], "global_step": 3}
    with pytest.raises(CheckpointIncomplete):  # state.pt never names a file that is not there
        write_checkpoint(tmp_path, missing, {})
    assert load_checkpoint(tmp_path / "state.pt")["global_step"] == 2
