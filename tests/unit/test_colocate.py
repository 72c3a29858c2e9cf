"""Co-location on a tiny Llama (CPU, fixed seeds): one executor hosts the jobs of several tasks,
which attach and detach while it runs, each with its own data, validation set, ranking,
checkpoints and adapters.

Bit-for-bit equality of a task alone and co-located needs one thing the host does not control:
the engine packs a step's rows at ONE length chosen from every job's sequences (pack_step), so
another task's sequences change a job's row length, and the attention kernel's blocking depends
on the row length (SDPA on CPU: a row of 20 tokens padded to 64 gives other last bits than alone;
measured in the report), as does the layout of the job's sequences in rows. `fixed_rows` makes
every row one fixed length, whoever shares the step: then every job's losses, evaluations and
adapters are exactly the same alone and co-located, which proves that everything the host does
per task (data, streams, evaluation, ranking, checkpoints) is isolated exactly. Without it, the
failure cases are compared at the same batch composition (the other task's rows present in
both runs, or leaving at the same step boundary): bit for bit too.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from contract.protocol import EarlyExitSettings, EvalSettings
from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir, write_jsonl
from tests.helpers.executor_cfg import executor_config
from trainer import engine as engine_mod
from trainer.executor import Callbacks, Executor, ExecutorConfig
from trainer.jobs import TrainJob
from trainer.packing import PackedBatch

pytestmark = pytest.mark.usefixtures("one_thread")
FIXED = 4 * 48  # the longest row the engine's packing makes of sequences of max_seq_len 48


class Crash(BaseException):
    """What a killed executor looks like to the test: no except clause of the host catches it."""


class Recorder:
    def __init__(self, timeline: list | None = None) -> None:
        self.timeline = [] if timeline is None else timeline  # job states, shared across tasks
        self.train: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.evals: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.states: list[tuple[str, str, dict]] = []
        self.events: list[tuple[str, str, dict]] = []
        self.hooks: list = []  # called as hook(job, step) after each train loss
        self.ends: list[tuple[str, dict]] = []

    def callbacks(self) -> Callbacks:
        def train(j: str, s: int, v: float) -> None:
            self.train[j].append((s, v))
            for hook in self.hooks:
                hook(j, s)

        return Callbacks(
            on_train_loss=train,
            on_eval=lambda j, s, v: self.evals[j].append((s, v)),
            on_job_state=lambda j, st, d: (self.states.append((j, st, d)), self.timeline.append((j, st))),
            on_event=lambda j, m, d: self.events.append((j, m, d)),
            on_task_end=lambda outcome, d: self.ends.append((outcome, d)),
        )

    def losses(self, job: str) -> list[float]:
        return [v for _, v in self.train[job]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):  # noqa: ANN001, ANN201
    """A tiny Llama and three tenants' files: completions, chats, and records of no known format."""
    root = tmp_path_factory.mktemp("colocate")
    rows = {"a": synthetic_rows(24, seed=5, fmt="completion"), "b": synthetic_rows(24, seed=9, fmt="chat"),
            "bad": [{"text_of_another_api": "x"}] * 3}
    return root, tiny_model_dir("llama", root), {k: write_jsonl(root / f"{k}.jsonl", v) for k, v in rows.items()}


def task_cfg(files, tmp_path: Path, name: str, data: str, jobs: list[TrainJob], **kw) -> ExecutorConfig:  # noqa: ANN001
    _, model, paths = files
    base = dict(model_dir=str(model), train_file=str(paths[data]), output_dir=str(tmp_path / name),
                jobs=jobs, max_seq_len=48, checkpoint_every=3, seed=1,
                eval=EvalSettings(eval_every_steps=3, eval_max_samples=4),
                early_exit=EarlyExitSettings(warmup_fraction=0.25, keep_fraction=0.5, tau_gap=10.0))
    base.update(kw)
    return executor_config(**base)


def jobs_a(steps: int = 8) -> list[TrainJob]:
    return [TrainJob(f"a{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=lr, batch_size=b, max_steps=steps, seed=i)
            for i, (r, lr, b) in enumerate([(4, 3e-3, 2), (8, 1e-2, 3), (2, 5e-3, 2)])]


def jobs_b(steps: int = 8, lr0: float = 4e-3) -> list[TrainJob]:
    return [TrainJob(f"b{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=lr, batch_size=b, max_steps=steps, seed=20 + i)
            for i, (r, lr, b) in enumerate([(4, lr0, 1), (2, 2e-3, 2)])]


def final_weights(cfg: ExecutorConfig, job: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(cfg.output_dir) / "jobs" / job / "final" / "adapter_model.safetensors"))


def assert_same_task(got: Recorder, ref: Recorder, cfg_got: ExecutorConfig, cfg_ref: ExecutorConfig,
                     jobs: list[str]) -> None:
    for j in jobs:
        assert got.train[j] == ref.train[j], j  # every step's loss, bit for bit
        assert got.evals[j] == ref.evals[j], j
        final = Path(cfg_ref.output_dir) / "jobs" / j / "final"
        if final.exists():
            a, b = final_weights(cfg_got, j), final_weights(cfg_ref, j)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), j
        else:
            assert not (Path(cfg_got.output_dir) / "jobs" / j / "final").exists()


@pytest.fixture
def fixed_rows(monkeypatch):  # noqa: ANN001, ANN201
    """Every packed row FIXED tokens long, whoever shares the step (see the module docstring):
    each job's sequences laid out by the engine's own packing at that one length."""
    real = engine_mod.pack_step

    def pack(per_job, pad_id, pack=True, multiple_of=1, **_):  # noqa: ANN001, ANN202
        parts = [real([seqs], pad_id, pack=pack, multiple_of=FIXED) for seqs in per_job]
        assert all(p.input_ids.shape[1] == FIXED for p in parts)
        first, seq, offsets = 0, [], [0]
        for p, seqs in zip(parts, per_job, strict=True):
            seq.append(torch.where(p.seq_index >= 0, p.seq_index + first, p.seq_index))
            first += len(seqs)
            offsets.append(offsets[-1] + p.input_ids.shape[0])
        return PackedBatch(torch.cat([p.input_ids for p in parts]), torch.cat([p.position_ids for p in parts]),
                           torch.cat([p.targets for p in parts]), offsets,
                           sum(p.real_tokens for p in parts), torch.cat(seq))

    monkeypatch.setattr(engine_mod, "pack_step", pack)


def test_a_task_attached_mid_run_trains_exactly_as_alone(files, tmp_path, fixed_rows) -> None:  # noqa: ANN001
    alone_a, alone_b = Recorder(), Recorder()
    cfg_a, cfg_b = task_cfg(files, tmp_path, "alone_a", "a", jobs_a()), task_cfg(files, tmp_path, "alone_b", "b", jobs_b())
    Executor(cfg_a, alone_a.callbacks()).run()
    Executor(cfg_b, alone_b.callbacks()).run()

    got_a, got_b = Recorder(), Recorder()
    shared_a = task_cfg(files, tmp_path, "shared_a", "a", jobs_a())
    shared_b = task_cfg(files, tmp_path, "shared_b", "b", jobs_b())
    host = Executor(shared_a, got_a.callbacks(), task_id="A")
    a_at_step_2 = threading.Event()
    got_a.hooks.append(lambda j, s: s >= 2 and a_at_step_2.set())
    steps_seen: list[int] = []
    got_b.hooks.append(lambda j, s: steps_seen.append(host.global_step))

    def tenant_b() -> None:  # another thread, as the daemon would deliver a placement
        a_at_step_2.wait(60)
        host.attach_task(shared_b, got_b.callbacks(), task_id="B")
        host.close()

    t = threading.Thread(target=tenant_b)
    t.start()
    results = host.serve()  # until B's thread closes it
    t.join()
    assert min(steps_seen) > 2  # B joined while A was training, at a later step boundary
    assert results["A"]["outcome"] == results["B"]["outcome"] == "succeeded"
    with pytest.raises(ValueError, match="closing"):  # a task never waits on an executor that left
        host.attach_task(task_cfg(files, tmp_path, "late", "b", [TrainJob("late0")]))
    assert_same_task(got_a, alone_a, shared_a, cfg_a, ["a0", "a1", "a2"])
    assert_same_task(got_b, alone_b, shared_b, cfg_b, ["b0", "b1"])
    # each task ranked its own jobs only
    (rank_a,) = [d for _, m, d in got_a.events if m == "warmup_ranking"]
    (rank_b,) = [d for _, m, d in got_b.events if m == "warmup_ranking"]
    assert sorted(rank_a["keep"] + rank_a["evict"]) == ["a0", "a1", "a2"]
    assert sorted(rank_b["keep"] + rank_b["evict"]) == ["b0", "b1"]
    assert not {j for j, *_ in got_a.states} & {j for j, *_ in got_b.states}
    assert (Path(shared_a.output_dir) / "state.pt").exists() and (Path(shared_b.output_dir) / "state.pt").exists()
    # each task reports its own timings: B's wall and first step count from its arrival, its phases
    # hold none of the model load that came before it; A's count from the executor's start
    (tim_a,) = [d for _, m, d in got_a.events if m == "timings"]
    (tim_b,) = [d for _, m, d in got_b.events if m == "timings"]
    assert tim_a["load_s"] > 0 and tim_b["load_s"] == 0
    # A's also show the load by part (details of its report, not phases); B's hold none of it
    from worker.runner import timings_report

    report_a = timings_report(tim_a)
    assert {"load_part_model", "load_part_data", "load_part_engine"} <= set(report_a["details"])
    assert not any(k.startswith("load_part") for k in report_a["phases"])
    parts = [v for k, v in report_a["details"].items()
             if k.startswith("load_part_") and k != "load_part_process_age_at_load"]
    # each part is rounded to the millisecond: up to half of one each over the unrounded load
    assert sum(parts) <= tim_a["load_s"] + 5e-4 * len(parts) + 1e-3
    assert not any(k.startswith("load_part") for k in tim_b)
    assert tim_b["wall_s"] < tim_b["host_wall"]  # the host started before B arrived
    assert 0 < tim_b["first_step_s"] < tim_b["wall_s"]
    assert tim_a["first_step_s"] == pytest.approx(host.clock.first_step_s)


def co_run(files, tmp_path: Path, name: str, b_jobs: list[TrainJob], hook_b=None, b_data: str = "b",  # noqa: ANN001
           early_b: EarlyExitSettings | None = None, **kw_a) -> tuple[Executor, Recorder, Recorder, ExecutorConfig]:
    """A (3 jobs) and B on one executor from the first step, B attached before the run."""
    rec_a, rec_b = Recorder(), Recorder()
    cfg_a = task_cfg(files, tmp_path, f"{name}_a", "a", jobs_a(), **kw_a)
    cfg_b = task_cfg(files, tmp_path, f"{name}_b", b_data, b_jobs,
                     early_exit=early_b or EarlyExitSettings(enabled=False))
    host = Executor(cfg_a, rec_a.callbacks(), task_id="A")
    if hook_b is not None:
        rec_b.hooks.append(lambda j, s: hook_b(host, j, s))
    host.attach_task(cfg_b, rec_b.callbacks(), task_id="B")
    host.run()
    return host, rec_a, rec_b, cfg_a


def test_a_diverging_task_leaves_the_other_bit_identical(files, tmp_path) -> None:  # noqa: ANN001
    # B's learning rate diverges: its updates are skipped (its early exit is off, so its rows stay
    # in every step, the same composition as the sane run)
    _, sane_a, sane_b, cfg_sane = co_run(files, tmp_path, "sane", jobs_b(lr0=4e-3))
    host, nan_a, nan_b, cfg_nan = co_run(files, tmp_path, "nan", [
        TrainJob("b0", lora_rank=4, lora_alpha=8, learning_rate=1e30, batch_size=1, max_steps=8, seed=20, max_grad_norm=None),
        jobs_b()[1]])
    assert any(math.isnan(v) for v in nan_b.losses("b0")) and not any(math.isnan(v) for v in sane_b.losses("b0"))
    assert any(m == "update_skipped" for j, m, _ in nan_b.events if j == "b0")
    assert_same_task(nan_a, sane_a, cfg_nan, cfg_sane, ["a0", "a1", "a2"])
    assert host.results()["A"]["outcome"] == "succeeded"


def test_a_raising_callback_or_bad_data_fails_only_its_task(files, tmp_path) -> None:  # noqa: ANN001
    def raise_at_4(host, j, s):  # noqa: ANN001, ANN202
        if s == 4:
            raise RuntimeError("tenant B's reporting broke")

    def cancel_at_4(host, j, s):  # noqa: ANN001, ANN202
        if s == 4:
            host.detach_task("B")

    host, got_a, got_b, cfg_got = co_run(files, tmp_path, "raise", jobs_b(), raise_at_4)
    ref, ref_a, ref_b, cfg_ref = co_run(files, tmp_path, "cancel", jobs_b(), cancel_at_4)
    res = host.results()
    assert res["B"]["outcome"] == "failed" and "reporting broke" in res["B"]["error"]
    assert ref.results()["B"]["outcome"] == "cancelled"
    assert res["A"]["outcome"] == "succeeded" and res["A"]["error"] is None
    assert [o for o, _ in got_a.ends] == ["succeeded"] and [o for o, _ in ref_b.ends] == ["cancelled"]
    ((outcome, details),) = got_b.ends  # told once, though its other callbacks fell silent
    assert outcome == "failed" and details["error"] == "RuntimeError: tenant B's reporting broke"
    # b1 (placed first: admission takes larger batches first) raised at its step 4: from then on
    # B reported nothing, b0's step 4 included
    assert {j: max(s for s, _ in got_b.train[j]) for j in ("b0", "b1")} == {"b0": 3, "b1": 4}
    # B left at the same boundary both ways: A is exactly what it is beside a B cancelled there
    assert_same_task(got_a, ref_a, cfg_got, cfg_ref, ["a0", "a1", "a2"])
    assert all(st["state"] == "cancelled" for st in ref.results()["B"]["status"].values())

    # a task whose data does not parse fails at attach; A never sees it
    alone = Recorder()
    cfg_alone = task_cfg(files, tmp_path, "alone_a", "a", jobs_a())
    Executor(cfg_alone, alone.callbacks()).run()
    host, bad_a, bad_b, cfg_bad = co_run(files, tmp_path, "bad", jobs_b(), b_data="bad")
    assert host.results()["B"]["outcome"] == "failed" and "unknown record format" in host.results()["B"]["error"]
    assert not bad_b.train
    assert_same_task(bad_a, alone, cfg_bad, cfg_alone, ["a0", "a1", "a2"])


def test_cancelling_a_task_frees_only_its_slots(files, tmp_path) -> None:  # noqa: ANN001
    """A budget of 6 sequences: A's two jobs of 2 hold 4, B's first job takes the rest, B's other
    two wait queued (A's jobs are not disturbed); A cancelled: B's queued jobs start at once."""
    off = EarlyExitSettings(enabled=False)
    two = [TrainJob(f"a{i}", lora_rank=4, lora_alpha=8, learning_rate=3e-3, batch_size=2, max_steps=10, seed=i) for i in range(2)]
    b_jobs = [TrainJob(f"b{i}", lora_rank=2, lora_alpha=4, learning_rate=2e-3, batch_size=2, max_steps=4, seed=20 + i) for i in range(3)]
    timeline: list = []
    rec_a, rec_b = Recorder(timeline), Recorder(timeline)
    cfg_a = task_cfg(files, tmp_path, "cap_a", "a", two, early_exit=off, max_tokens_per_step=6 * 48)
    cfg_b = task_cfg(files, tmp_path, "cap_b", "b", b_jobs, early_exit=off)
    host = Executor(cfg_a, rec_a.callbacks(), task_id="A")
    running_at: dict[int, set[str]] = {}

    def watch(j: str, s: int) -> None:
        running_at[host.global_step] = set(host.engine.jobs)
        if j == "a0" and s == 3:
            host.attach_task(cfg_b, rec_b.callbacks(), task_id="B")
        if j == "a0" and s == 6:
            host.detach_task("A")

    rec_a.hooks.append(watch)
    rec_b.hooks.append(watch)
    host.run()
    assert running_at[4] == {"a0", "a1", "b0"}  # B joined; b1, b2 wait for room
    # b1 and b2 started only after A's jobs were cancelled
    log = rec_a.timeline
    assert log.index(("b1", "running")) > log.index(("a1", "cancelled"))
    assert running_at[6] == {"a0", "a1", "b0"}
    assert running_at[7] == {"b0", "b1", "b2"}  # A's slots went to B's queued jobs, only A's
    assert len(rec_a.train["a0"]) == 6 and host.results()["A"]["outcome"] == "cancelled"
    assert {j: st["state"] for j, st in host.results()["A"]["status"].items()} == {"a0": "cancelled", "a1": "cancelled"}
    assert all(st["state"] == "completed" for st in host.results()["B"]["status"].values())
    assert [s for s, _ in rec_b.train["b0"]] == [1, 2, 3, 4]


def test_after_a_crash_each_task_resumes_from_its_own_checkpoint(files, tmp_path, fixed_rows) -> None:  # noqa: ANN001
    ref_a, ref_b = Recorder(), Recorder()
    Executor(task_cfg(files, tmp_path, "ref_a", "a", jobs_a(10)), ref_a.callbacks()).run()
    Executor(task_cfg(files, tmp_path, "ref_b", "b", jobs_b(10)), ref_b.callbacks()).run()

    before_a, before_b = Recorder(), Recorder()
    cfg_a = task_cfg(files, tmp_path, "crash_a", "a", jobs_a(10))
    cfg_b = task_cfg(files, tmp_path, "crash_b", "b", jobs_b(10))
    host = Executor(cfg_a, before_a.callbacks(), task_id="A")
    host.attach_task(cfg_b, before_b.callbacks(), task_id="B")

    def crash(j: str, s: int) -> None:
        if host.global_step == 7:
            raise Crash

    before_b.hooks.append(crash)
    with pytest.raises(Crash):
        host.run()
    # A alone on a one-task executor; B on a new shared executor beside a fresh task C
    after_a, after_b, after_c = Recorder(), Recorder(), Recorder()
    Executor(cfg_a, after_a.callbacks()).run()
    cfg_c = task_cfg(files, tmp_path, "fresh_c", "a", [TrainJob("c0", lora_rank=2, lora_alpha=4, learning_rate=1e-3, batch_size=2,
                                                               max_steps=5, seed=7)])
    second = Executor(cfg_b, after_b.callbacks(), task_id="B")
    second.attach_task(cfg_c, after_c.callbacks(), task_id="C")
    second.run()
    assert any(m == "resumed" for _, m, _ in after_a.events) and any(m == "resumed" for _, m, _ in after_b.events)
    assert not any(m == "resumed" for _, m, _ in after_c.events) and len(after_c.train["c0"]) == 5
    for before, after, ref in ((before_a, after_a, ref_a), (before_b, after_b, ref_b)):
        for j, points in ref.train.items():
            resumed_from = min((s for s, _ in after.train[j]), default=math.inf)
            got = [p for p in before.train[j] if p[0] < resumed_from] + after.train[j]
            assert got == points, j  # no step lost, none different: bit for bit
            assert resumed_from > 1 or not before.train[j]  # it did not start over


def test_attach_refuses_what_cannot_share_the_executor(files, tmp_path) -> None:  # noqa: ANN001
    host = Executor(task_cfg(files, tmp_path, "h", "a", jobs_a()), task_id="A")
    with pytest.raises(ValueError, match="max_seq_len"):
        host.attach_task(task_cfg(files, tmp_path, "x", "b", jobs_b(), max_seq_len=64))
    with pytest.raises(ValueError, match="method"):
        host.attach_task(task_cfg(files, tmp_path, "x", "b", jobs_b(), method="dpo"))
    with pytest.raises(ValueError, match=r"job ids .*a1"):
        host.attach_task(task_cfg(files, tmp_path, "x", "b", [TrainJob("a1")]))
    with pytest.raises(ValueError, match="output_dir"):
        host.attach_task(task_cfg(files, tmp_path, "h", "b", jobs_b()))
    with pytest.raises(ValueError, match="already"):
        host.attach_task(task_cfg(files, tmp_path, "y", "b", jobs_b()), task_id="A")
    with pytest.raises(ValueError, match="outcome"):
        host.detach_task("A", "deleted")
    assert list(host.tasks) == ["A"] and not host.roster.pending()  # nothing was queued


def test_dpo_tasks_share_an_executor_and_checkpoint_only_their_own_references(files, tmp_path) -> None:  # noqa: ANN001
    """DPO's reference log-probs are cached once per pair for the whole executor; a task's
    state.pt holds its own pairs' numbers only (nothing of the other tenant's data)."""
    from tests.unit.test_dpo import preference_rows

    root = files[0]
    data = {k: write_jsonl(root / f"pref_{k}.jsonl", preference_rows(16, seed=s)) for k, s in (("a", 3), ("b", 4))}
    recs = {"A": Recorder(), "B": Recorder()}
    cfgs = {t: task_cfg(files, tmp_path, f"dpo_{t}", "a", [
        TrainJob(f"{t}{i}", lora_rank=2 + 2 * i, lora_alpha=4, learning_rate=5e-3, batch_size=2, beta=0.1 * (i + 1), max_steps=4, seed=i)
        for i in range(2)], method="dpo", train_file=str(data[t.lower()]), max_seq_len=40,
        early_exit=EarlyExitSettings(enabled=False)) for t in ("A", "B")}
    host = Executor(cfgs["A"], recs["A"].callbacks(), task_id="A")
    host.attach_task(cfgs["B"], recs["B"].callbacks(), task_id="B")
    host.run()
    assert {t: r["outcome"] for t, r in host.results().items()} == {"A": "succeeded", "B": "succeeded"}
    keys = {}
    for t, cfg in cfgs.items():
        ck = torch.load(Path(cfg.output_dir) / "state.pt", map_location="cpu", weights_only=False)
        keys[t] = {bytes(k) for k in ck["reference"]["keys"].tolist()}
        task = host.ended[t]
        own, val = {p.key for p in task.train + task.val}, {p.key for p in task.val}
        assert val <= keys[t] <= own  # its validation pairs and the train pairs it used
        assert all(len(recs[t].train[j]) == 4 for j in (f"{t}0", f"{t}1"))
    assert not keys["A"] & keys["B"] and keys["A"] | keys["B"] == set(host.engine.reference)


def test_a_task_asked_to_stop_pauses_alone_and_resumes_elsewhere(files, tmp_path, fixed_rows) -> None:  # noqa: ANN001
    """B's own stop flag (its placement paused): B checkpoints at the step boundary and leaves,
    A trains on; B resumes later on its own executor and ends exactly where it would have."""
    ref_b = Recorder()
    ref_status = Executor(task_cfg(files, tmp_path, "ref_b", "b", jobs_b()), ref_b.callbacks()).run()
    rec_a, before_b, after_b = Recorder(), Recorder(), Recorder()
    cfg_b = task_cfg(files, tmp_path, "paused_b", "b", jobs_b(), checkpoint_every=10**6)
    host = Executor(task_cfg(files, tmp_path, "runs_a", "a", jobs_a()), rec_a.callbacks(), task_id="A")
    host.attach_task(cfg_b, before_b.callbacks(), task_id="B",
                     stop_requested=lambda: max((s for s, _ in before_b.train["b0"]), default=0) >= 3)
    host.run()
    res = host.results()
    assert res["A"]["outcome"] == "succeeded" and res["B"]["outcome"] == "paused" and host.ended["B"].stopped
    # the flag is read once a step, before that step's reports: seen at step 4, which completes
    assert [s for s, _ in before_b.train["b0"]] == [1, 2, 3, 4] and max(map(len, rec_a.train.values())) == 8
    again = Executor(cfg_b, after_b.callbacks())
    assert again.run() == ref_status
    for j, points in ref_b.train.items():
        assert before_b.train[j] + after_b.train[j] == points, j
