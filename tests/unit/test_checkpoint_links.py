"""Unit: the runner announces each new checkpoint as hard links (state.pt and the job files it
names, the same inodes as the executor's), skips one whose files a newer checkpoint deleted, and
seeds a resume by linking the whole checkpoint (worker.checkpoint_links)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainer.checkpoint_files import CheckpointIncomplete, write_checkpoint
from worker import runner
from worker.checkpoint_links import checkpoint_step, link_checkpoint
from worker.spool import SpoolWriter, read_complete_lines

torch = pytest.importorskip("torch")


def checkpoint(out: Path, step: int, jobs: dict[str, int]) -> None:
    """A state.pt at global step `step` naming one file per job (job -> its step); the files
    of jobs at a step already written stay as they are."""
    refs, new = [], {}
    for job, job_step in jobs.items():
        name = f"job-{job}-{job_step}-t.pt"
        refs.append({"file": name, "spec": {"job_id": job}, "step": job_step, "total_steps": 9})
        if not (out / name).exists():
            new[name] = {"adapter": torch.full((256,), float(job_step))}
    write_checkpoint(out, {"format": 2, "global_step": step, "active": refs[:1], "queue": refs[1:]}, new)


def announced(directory: Path) -> list[dict]:
    return [r for _, _, t in read_complete_lines(directory / "spool.jsonl", 0)
            if (r := json.loads(t))["type"] == "artifact"]


def test_checkpoints_are_announced_as_hard_links(tmp_path: Path) -> None:
    out = tmp_path / "executor"
    out.mkdir()
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    bridge = runner._Bridge(runner.SpoolReporter(spool, tmp_path), out)
    checkpoint(out, 1, {"a": 1, "b": 1})
    bridge.on_train_loss("a", 1, 0.5)
    checkpoint(out, 2, {"a": 2, "b": 1})  # b parked: its file stays
    bridge.on_train_loss("a", 2, 0.4)
    bridge.on_train_loss("a", 2, 0.4)  # the same state.pt: not announced twice
    spool.close()
    first, second = (tmp_path / r["dir"] for r in announced(tmp_path))
    assert sorted(p.name for p in first.iterdir()) == ["job-a-1-t.pt", "job-b-1-t.pt", "state.pt"]
    assert sorted(p.name for p in second.iterdir()) == ["job-a-2-t.pt", "job-b-1-t.pt", "state.pt"]
    for name in ("state.pt", "job-a-2-t.pt", "job-b-1-t.pt"):
        assert os.path.samefile(second / name, out / name)
    assert os.path.samefile(first / "job-b-1-t.pt", second / "job-b-1-t.pt")
    assert not (out / "job-a-1-t.pt").exists() and (first / "job-a-1-t.pt").is_file()  # a link kept it
    assert checkpoint_step(first / "state.pt") == 1 and checkpoint_step(second / "state.pt") == 2


def test_a_checkpoint_whose_files_are_gone_is_skipped(tmp_path: Path) -> None:
    out = tmp_path / "executor"
    out.mkdir()
    spool = SpoolWriter(tmp_path / "spool.jsonl")
    bridge = runner._Bridge(runner.SpoolReporter(spool, tmp_path), out)
    checkpoint(out, 1, {"a": 1, "b": 1})
    (out / "job-b-1-t.pt").unlink()  # as if a newer checkpoint had deleted it meanwhile
    bridge.on_train_loss("a", 1, 0.5)
    spool.close()
    assert announced(tmp_path) == []
    assert not any((tmp_path / "artifacts").iterdir())


def test_a_resume_links_the_whole_checkpoint_or_fails(tmp_path: Path) -> None:
    resume, out = tmp_path / "resume", tmp_path / "executor"
    resume.mkdir()
    checkpoint(resume, 3, {"a": 3, "b": 2})
    assert link_checkpoint(resume, out) == ["job-a-3-t.pt", "job-b-2-t.pt"]
    assert all(os.path.samefile(out / p.name, p) for p in resume.iterdir())
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    data = (resume / "job-b-2-t.pt").read_bytes()
    (resume / "job-b-2-t.pt").unlink()
    with pytest.raises(FileNotFoundError):
        link_checkpoint(resume, tmp_path / "elsewhere")
    assert not (tmp_path / "elsewhere" / "state.pt").exists()  # state.pt only once all is there
    (resume / "job-b-2-t.pt").write_bytes(data[:100])
    with pytest.raises(CheckpointIncomplete):
        link_checkpoint(resume, tmp_path / "cut")
