"""Issues 15 and 41 on CUDA: the executor builds its memory model from the config (no profiling
pass), corrects it from its steps' peaks and stores it; a second executor on the node starts from
the stored one; evaluation forwards are as wide as the admitted budget and give the same losses as
narrow ones. Skipped without CUDA."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from contract.protocol import EarlyExitSettings, EvalSettings, TaskSettings  # noqa: E402
from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir, write_jsonl  # noqa: E402
from trainer.executor import Callbacks, Executor, ExecutorConfig  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402


def _cfg(tmp_path, out: str, cache) -> ExecutorConfig:  # noqa: ANN001
    d = tiny_model_dir("llama", tmp_path)
    train = write_jsonl(tmp_path / "train.jsonl", synthetic_rows(40, seed=1, fmt="completion"))
    val = write_jsonl(tmp_path / "val.jsonl", synthetic_rows(12, seed=2, fmt="completion"))
    jobs = [TrainJob(f"j{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=3e-3, batch_size=b, max_steps=6, seed=i)
            for i, (r, b) in enumerate([(4, 1), (8, 2), (16, 4)])]
    return ExecutorConfig(model_dir=str(d), train_file=str(train), val_file=str(val),
                          output_dir=str(tmp_path / out), jobs=jobs, profile_cache=str(cache),
                          settings=TaskSettings(max_seq_len=64, early_exit=EarlyExitSettings(enabled=False),
                                                eval=EvalSettings(eval_every_steps=3, eval_max_samples=None,
                                                                  eval_every_samples=4)))


def test_profile_stored_once_and_reused_then_wide_eval(tmp_path) -> None:  # noqa: ANN001
    cache = tmp_path / "node" / "memory_profiles.json"
    runs = []
    for name in ("first", "second"):
        events: list = []
        vals: dict = {}
        ex = Executor(_cfg(tmp_path, name, cache),
                      Callbacks(on_event=lambda j, m, d, ev=events: ev.append((m, d)),
                                on_eval=lambda j, s, v, vs=vals: vs.setdefault(j, []).append(v)))
        status = ex.run()
        assert all(s["state"] == "completed" for s in status.values())
        mm = next(d for m, d in events if m == "memory_model")
        runs.append((ex, ex.timings(), mm, vals))
    (first, t1, mm1, v1), (second, t2, mm2, v2) = runs
    assert t1["profile_reused"] is False and t2["profile_reused"] is True
    assert t1["profile_s"] < 1.0  # no profiling pass: the analytic model
    # the second starts from the model the first left on the node (corrected by its steps)
    left = first.memory.corrections[True].model
    assert (mm2["k0"], mm2["k1"]) == pytest.approx((left.k0, left.k1))
    # every step the allocator saw was checked against the model (the 10% target is the 8B
    # bench's: bench/executor_task.py), and none ran out of memory
    assert t1["memory_steps_checked"] > 0 and t1["memory_retries"] == 0
    cells, resident, peak, predicted = (t1[f"memory_worst_{k}"] for k in ("cells", "resident", "peak", "predicted"))
    assert cells > 0 and peak > resident and abs(predicted - peak) / peak == pytest.approx(t1["memory_model_error"])
    key = json.loads(next(iter(json.loads(cache.read_text()))))
    assert key["gpu"] == torch.cuda.get_device_name() and key["seq_len"] == 64
    # the same jobs, seeds and data: the same validation curves whether profiled or reused
    for j in v1:
        assert v2[j] == pytest.approx(v1[j], rel=2e-2)
    # evaluation at the admitted budget: one forward for all 3 jobs x 12 samples when it fits
    width = second.admission.max_total_batch()
    assert width >= 36
    assert second.eval_shape(3) == (12, 36)
    eng = second.engine
    for spec in second.cfg.jobs:
        eng.attach(TrainJob(**{**vars(spec), "job_id": spec.job_id + "_x"}))
    narrow = eng.evaluate_metrics(second.val, 1, None, 1)
    wide = eng.evaluate_metrics(second.val, 12, None, 36)
    for j in narrow:
        assert wide[j]["loss"] == pytest.approx(narrow[j]["loss"], rel=2e-2)


def test_the_arenas_packed_once_jobs_left_and_the_curves_unchanged(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Jobs of 2, 4 and 6 steps: once the first two completed, the arenas held their regions for
    no job. With the packing's threshold at 0 and recompute on (every step short of memory, the
    packing's condition), each step after a job left packs them (and drops the step graphs); the
    validation curves equal a run that never packs."""
    from trainer import memory_plan

    curves, counts = [], []
    for share in (1.0, 0.0):
        monkeypatch.setattr(memory_plan, "ARENA_COMPACT_SHARE", share)
        cfg = _cfg(tmp_path, f"share{share}", tmp_path / f"profiles{share}.json")
        cfg.jobs = [TrainJob(**{**vars(j), "max_steps": 2 * (i + 1)}) for i, j in enumerate(cfg.jobs)]
        cfg.gradient_checkpointing = True
        vals: dict = {}
        ex = Executor(cfg, Callbacks(on_eval=lambda j, s, v, vs=vals: vs.setdefault(j, []).append(v)))
        status = ex.run()
        assert all(s["state"] == "completed" for s in status.values())
        curves.append(vals)
        counts.append(ex.timings()["arena_compactions"])
    assert counts[0] == 0 and counts[1] >= 2
    for j, want in curves[0].items():
        assert curves[1][j] == pytest.approx(want, rel=2e-2), j
