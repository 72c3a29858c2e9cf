"""The executor recipe on a tiny Llama: admission limit, warmup rotation and ranking, divergence
exit, best/final PEFT exports, callbacks, and a killed run resumed from its checkpoint."""

from __future__ import annotations

import json
import time
from collections import defaultdict

import pytest
import torch

from contract.protocol import EarlyExitSettings, EvalSettings
from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir, write_jsonl
from tests.helpers.executor_cfg import executor_config
from trainer.executor import Callbacks, Executor, ExecutorConfig
from trainer.jobs import TrainJob

pytestmark = pytest.mark.usefixtures("one_thread")


class Recorder:
    def __init__(self) -> None:
        self.train: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.evals: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.states: list[tuple[str, str, dict]] = []
        self.events: list[tuple[str, str, dict]] = []
        self.adapters: list[tuple[str, str]] = []

    def callbacks(self) -> Callbacks:
        return Callbacks(
            on_train_loss=lambda j, s, v: self.train[j].append((s, v)),
            on_eval=lambda j, s, v: self.evals[j].append((s, v)),
            on_job_state=lambda j, st, d: self.states.append((j, st, d)),
            on_adapter=lambda j, kind, p: self.adapters.append((j, kind)),
            on_event=lambda j, m, d: self.events.append((j, m, d)),
        )


def config(tmp_path, out: str, **kw) -> ExecutorConfig:  # noqa: ANN001
    d = tiny_model_dir("llama", tmp_path)
    train = write_jsonl(tmp_path / "train.jsonl", synthetic_rows(30, seed=5, fmt="completion"))
    jobs = [TrainJob(f"job{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=lr, batch_size=b, max_steps=12, seed=i)
            for i, (r, lr, b) in enumerate([(4, 3e-3, 2), (8, 1e-2, 2), (2, 1e-3, 3), (4, 1e30, 2),
                                            (8, 5e-3, 3), (4, 2e-3, 2)])]
    base = dict(model_dir=str(d), train_file=str(train), output_dir=str(tmp_path / out), jobs=jobs,
                max_seq_len=48, eval=EvalSettings(eval_every_steps=4, eval_max_samples=None), checkpoint_every=5, max_active_jobs=3,
                early_exit=EarlyExitSettings(warmup_fraction=0.2, keep_fraction=0.5, tau_gap=10.0))
    base.update(kw)
    return executor_config(**base)


def test_executor_runs_a_task_end_to_end(tmp_path) -> None:  # noqa: ANN001
    rec = Recorder()
    status = Executor(config(tmp_path, "run"), rec.callbacks()).run()
    # every configuration got its warmup (3 steps = ceil(0.2 * 12)) before the ranking
    assert all(len(rec.train[f"job{i}"]) >= 3 for i in (0, 1, 2, 4, 5))
    assert 1 <= len(rec.train["job3"]) < 12
    ranking = [d for j, m, d in rec.events if m == "warmup_ranking"]
    assert len(ranking) == 1
    assert any(m == "parked_after_warmup" for _, m, _ in rec.events)  # rotation happened
    assert status["job3"] == {"state": "exited", "exit_reason": "diverging"}
    kept = ranking[0]["keep"]
    assert len(kept) == 3 and "job3" not in kept  # ceil(0.5 * 5 survivors)
    for j in kept:
        assert status[j]["state"] == "completed"
        assert [s for s, _ in rec.train[j]] == list(range(1, 13))
        assert (j, "best") in rec.adapters and (j, "final") in rec.adapters
        cfg = json.loads((tmp_path / "run" / "jobs" / j / "best" / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "LORA" and cfg["r"] in (2, 4, 8)
    for j in ranking[0]["evict"]:
        assert status[j] == {"state": "exited", "exit_reason": "underperforming"}
    # the kept ones are the lowest end-of-warmup validation losses
    warm = {j: v for j in ranking[0]["keep"] + ranking[0]["evict"] for s, v in rec.evals[j] if s == 3}
    assert max(warm[j] for j in kept) <= min(warm[j] for j in ranking[0]["evict"])
    assert ("job0", "running", {"resumed": False, "rank": 0}) in rec.states


def test_states_parked_on_the_device_go_to_the_host_when_a_queued_job_cannot_start(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # an 80 GB card in the search: jobs that finished their warmup wait for the ranking parked on
    # the device while its memory allows; once they leave no room for the next configuration's
    # warmup, with nothing running, the ranking (which waits for that warmup) never came and the
    # task ended "succeeded" with its jobs still pending. Stand-in for the device's memory: the
    # admission refuses while 3 states are parked on the device.
    from trainer.admission import AdmissionController
    from trainer.arena import AdapterArena

    ex = Executor(config(tmp_path, "run"), (rec := Recorder()).callbacks())
    admit = AdmissionController.admit

    def crowded(self, pending, running):  # noqa: ANN001, ANN202
        return [] if sum(len(t.parked_on_device) for t in ex.tasks.values()) >= 3 else admit(self, pending, running)

    monkeypatch.setattr(AdmissionController, "admit", crowded)
    monkeypatch.setattr(AdapterArena, "park_target", lambda self, job_id: None)  # room on the device
    status = ex.run()
    spills = [d["jobs"] for _, m, d in rec.events if m == "parked_to_host"]
    assert spills and all(len(jobs) == 3 for jobs in spills)
    ranking = [d for _, m, d in rec.events if m == "warmup_ranking"]
    assert len(ranking) == 1 and len(ranking[0]["keep"]) == 3
    assert all(st["state"] in ("completed", "exited") for st in status.values()), status
    for j in ranking[0]["keep"]:
        assert status[j]["state"] == "completed" and [s for s, _ in rec.train[j]] == list(range(1, 13))


def test_an_evaluation_short_of_room_sends_the_states_parked_on_the_device_to_the_host(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # session 33's search planned its warmup evaluations beside 10.6 GB of states parked on the
    # device (32 sequences a forward, 0.49-0.64 s a job against 0.43 s; 8 beside 31.7 GB). Stand-in
    # for the device's memory: no room for an evaluation's forward while any state is parked there.
    from trainer.arena import AdapterArena
    from trainer.memory_plan import MemoryPlan

    ex = Executor(config(tmp_path, "run"), (rec := Recorder()).callbacks())

    def parked() -> int:
        return sum(len(t.parked_on_device) for t in ex.tasks.values())

    monkeypatch.setattr(MemoryPlan, "eval_tokens", lambda self: 0 if parked() else 10**6)
    monkeypatch.setattr(AdapterArena, "park_target", lambda self, job_id: None)  # room on the device
    at_plan: list[int] = []
    shape = Executor.eval_shape
    monkeypatch.setattr(Executor, "eval_shape", lambda self, *a, **k: at_plan.append(parked()) or shape(self, *a, **k))
    status = ex.run()
    assert [m for _, m, _ in rec.events].count("parked_to_host") >= 1
    assert at_plan and max(at_plan) == 0  # no evaluation planned beside a state parked on the device
    ranking = [d for _, m, d in rec.events if m == "warmup_ranking"]
    assert len(ranking) == 1 and len(ranking[0]["keep"]) == 3
    for j in ranking[0]["keep"]:
        assert status[j]["state"] == "completed" and [s for s, _ in rec.train[j]] == list(range(1, 13))


def test_a_job_no_executor_can_admit_fails_saying_so_not_left_pending(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from trainer.admission import AdmissionController

    admit = AdmissionController.admit
    monkeypatch.setattr(AdmissionController, "admit", lambda self, pending, running: admit(
        self, [j for j in pending if j.job_id != "job5"], running))
    rec = Recorder()
    status = Executor(config(tmp_path, "run", early_exit=EarlyExitSettings(enabled=False)), rec.callbacks()).run()
    assert status["job5"]["state"] == "failed"
    failed = [d for j, st, d in rec.states if j == "job5" and st == "failed"]
    assert failed and "could not be admitted" in failed[0]["error"]
    assert all(status[f"job{i}"]["state"] in ("completed", "exited") for i in range(5))


def test_each_step_reports_its_jobs_exact_tokens_and_gpu_seconds(tmp_path) -> None:  # noqa: ANN001
    """on_usage: a job's sequence tokens of each step; one job per example for an epoch and one
    with the whole set in one step both trained every example once."""
    usage: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    cb = Recorder().callbacks()
    cb.on_usage = lambda j, s, n, g: usage[j].append((s, n, g))
    probe = Executor(config(tmp_path, "probe", jobs=[TrainJob("x", lora_rank=2, learning_rate=1e-3, batch_size=1,
                                                             max_steps=1)]))
    probe.run()
    # the load by part (logged for a node's cold start): every part timed, within the load phase,
    # and the process's age when the load began (the interpreter and the imports before it)
    parts = dict(probe.load_parts)
    age = parts.pop("process_age_at_load_s")
    assert list(parts) == ["imports", "device", "tokenizer", "model", "data", "engine", "memory", "open"]
    assert all(v >= 0 for v in parts.values()) and sum(parts.values()) <= probe.clock.phases["load"] + 1e-3
    assert age is None or 0 < age < time.monotonic()
    n, tokens = len(probe.first.train), sum(len(e.input_ids) for e in probe.first.train)
    jobs = [TrainJob("one", lora_rank=4, learning_rate=1e-3, batch_size=1, max_steps=n, seed=1),
            TrainJob("all", lora_rank=4, learning_rate=1e-3, batch_size=n, max_steps=1, seed=2)]
    ex = Executor(config(tmp_path, "usage", jobs=jobs, early_exit=EarlyExitSettings(enabled=False)),
                  cb)
    ex.run()
    assert [s for s, _, _ in usage["one"]] == list(range(1, n + 1))
    assert sum(t for _, t, _ in usage["one"]) == sum(t for _, t, _ in usage["all"]) == tokens
    # the first step's executor time (the load included) is split by tokens, all of it
    first = usage["one"][0][2] + usage["all"][0][2]
    assert usage["all"][0][2] / first == pytest.approx(tokens / (tokens + usage["one"][0][1]))
    assert all(g > 0 for rows in usage.values() for _, _, g in rows)


def test_killed_executor_resumes_exactly(tmp_path) -> None:  # noqa: ANN001
    full = Recorder()
    ref_status = Executor(config(tmp_path, "full"), full.callbacks()).run()
    first, second = Recorder(), Recorder()
    Executor(config(tmp_path, "killed", stop_after_steps=7), first.callbacks()).run()
    status = Executor(config(tmp_path, "killed"), second.callbacks()).run()
    assert any(m == "resumed" for _, m, _ in second.events)
    assert status == ref_status
    for j, ref in full.train.items():
        got = first.train.get(j, []) + second.train.get(j, [])
        assert [s for s, _ in got] == [s for s, _ in ref]
        torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in ref]),
                                   atol=1e-6, rtol=1e-6, equal_nan=True)


def test_memory_probe_step_leaves_the_engine_untouched(tmp_path) -> None:  # noqa: ANN001
    ex = Executor(config(tmp_path, "probe"))
    ex._load()
    for spec in ex.cfg.jobs[:2]:
        ex.engine.attach(spec)
    ex.engine.step()
    before = {j: ({k: v.clone() for k, v in s.adapter.state_dict().items()}, s.step)
              for j, s in ex.engine.jobs.items()}
    train = ex.engine.train_examples
    ex.memory.probe_step(2)
    assert list(ex.engine.jobs) == list(before) and ex.engine.train_examples is train
    for j, (w, step) in before.items():
        s = ex.engine.jobs[j]
        assert s.step == step and all(torch.equal(v, s.adapter.state_dict()[k]) for k, v in w.items())


def test_checkpoint_cadence_by_time_and_eval_sample_cap(tmp_path) -> None:  # noqa: ANN001
    """checkpoint_every_s bounds the time between checkpoints whatever checkpoint_every says (a
    throughput report goes with each one); eval_max_samples caps the validation set."""
    early = EarlyExitSettings(enabled=False)
    jobs = [TrainJob("a", lora_rank=2, lora_alpha=4, learning_rate=1e-3, batch_size=2, max_steps=5, seed=1)]
    every, counts = {}, {}
    for name, seconds in (("by_time", 0.0), ("by_steps", None)):
        rec = Recorder()
        cfg = config(tmp_path, name, jobs=jobs, early_exit=early, checkpoint_every=10**6,
                     checkpoint_every_s=seconds, eval=EvalSettings(eval_every_steps=5, eval_max_samples=2))
        Executor(cfg, rec.callbacks()).run()
        every[name] = [d["global_step"] for _, m, d in rec.events if m == "throughput"]
        counts[name] = next(d["val"] for _, m, d in rec.events if m == "executor_loaded")
    assert every["by_time"] == [1, 2, 3, 4, 5]  # a checkpoint after every step (the final one too)
    assert every["by_steps"] == [5]  # only the final one
    assert counts == {"by_time": 2, "by_steps": 2}


@pytest.mark.parametrize("steps, seconds, want", [(None, None, [5]), (0, None, [5]), (2, None, [2, 4, 5]),
                                                  (None, 3600.0, [5])])
def test_checkpoint_cadence_without_a_step_count(tmp_path, steps, seconds, want) -> None:  # noqa: ANN001
    """checkpoint_every None or 0 (a node's default: by time alone) counts no steps; a step count
    still checkpoints at its multiples; the task's end always checkpoints."""
    jobs = [TrainJob("a", lora_rank=2, lora_alpha=4, learning_rate=1e-3, batch_size=2, max_steps=5, seed=1)]
    rec = Recorder()
    cfg = config(tmp_path, "cadence", jobs=jobs, early_exit=EarlyExitSettings(enabled=False), checkpoint_every=steps,
                 checkpoint_every_s=seconds, eval=EvalSettings(eval_every_steps=5, eval_max_samples=2))
    Executor(cfg, rec.callbacks()).run()
    assert [d["global_step"] for _, m, d in rec.events if m == "throughput"] == want


def test_stop_request_checkpoints_at_a_step_boundary_and_resumes(tmp_path) -> None:  # noqa: ANN001
    """What SIGTERM does through the runner: the executor finishes its step, writes state.pt and
    returns; the next run resumes there and ends where an uninterrupted run ends."""
    full = Recorder()
    ref_status = Executor(config(tmp_path, "full"), full.callbacks()).run()
    calls = {"n": 0}

    def stop_after_three() -> bool:
        calls["n"] += 1
        return calls["n"] >= 3

    before = Recorder()
    first = Executor(config(tmp_path, "stopped", checkpoint_every=10**6), before.callbacks(),
                     stop_requested=stop_after_three)
    first.run()
    assert first.stopped and first.global_step == 3
    ck = torch.load(tmp_path / "stopped" / "state.pt", map_location="cpu", weights_only=False)
    assert ck["global_step"] == 3
    second = Recorder()
    status = Executor(config(tmp_path, "stopped"), second.callbacks()).run()
    assert status == ref_status
    resumed = [(j, d) for j, st, d in second.states if st == "running" and d.get("resumed")]
    assert resumed  # the jobs it picks up are reported running again (a retry's truth)
    for j, ref in full.train.items():  # no step lost, none trained twice
        got = before.train.get(j, []) + second.train.get(j, [])
        assert [s for s, _ in got] == [s for s, _ in ref]


def test_a_final_adapter_at_its_best_step_is_the_best_exports_files_not_a_second_write(tmp_path) -> None:  # noqa: ANN001
    import os

    from safetensors import safe_open

    rec = Recorder()
    status = Executor(config(tmp_path, "linked"), rec.callbacks()).run()

    def step_of(d) -> str:  # noqa: ANN001
        with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
            return f.metadata()["step"]

    linked = 0
    for job_id, st in status.items():
        jobs = tmp_path / "linked" / "jobs" / job_id
        final, best = jobs / "final", jobs / "best"
        if st["state"] != "completed" or not (best / "adapter_model.safetensors").exists():
            continue
        assert (final / "adapter_model.safetensors").exists() and (final / "adapter_config.json").exists()
        same = step_of(final) == step_of(best)
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            if same:  # the one write's files, under both names
                assert os.stat(final / name).st_ino == os.stat(best / name).st_ino
                linked += 1
            else:
                assert (final / name).read_bytes() != (best / name).read_bytes() or name.endswith(".json")
        assert (job_id, "final") in rec.adapters
    assert linked  # at least one job ended on its best step (evaluated at its last step)
