"""Issue 15 on the CPU: evaluation honours eval_max_samples, evaluates by samples seen
(eval_every_samples) so every batch size evaluates equally often per sample, evaluates at the
admitted budget (wide forwards, the same losses as narrow ones), the memory profile is stored per
node and reused for the same key only, and the executor splits its wall time by phase."""

from __future__ import annotations

import json
import random
from collections import defaultdict

import pytest
import torch

from contract.protocol import EarlyExitSettings, EvalSettings
from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir, write_jsonl
from tests.helpers.executor_cfg import executor_config
from trainer.admission import MemoryModel, load_profile, store_profile
from trainer.data import read_jsonl, tokenize_all
from trainer.evaluation import eval_chunk, eval_forwards
from trainer.executor import Callbacks, Executor, ExecutorConfig
from trainer.jobs import TrainJob
from trainer.memory_plan import MemoryPlan
from trainer.phase_clock import PHASES
from trainer.varlen import flash_varlen_available

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("eval_speed")
    model = tiny_model_dir("llama", root)
    train = write_jsonl(root / "train.jsonl", synthetic_rows(24, seed=3, fmt="completion"))
    val = write_jsonl(root / "val.jsonl", synthetic_rows(9, seed=4, fmt="completion"))
    return root, model, train, val


def make_cfg(files, out: str, jobs, **kw) -> ExecutorConfig:  # noqa: ANN001
    root, model, train, val = files
    base = dict(model_dir=str(model), train_file=str(train), val_file=str(val),
                output_dir=str(root / out), jobs=jobs, max_seq_len=48,
                early_exit=EarlyExitSettings(enabled=False), checkpoint_every=10**6,
                eval=EvalSettings(eval_every_steps=1000, eval_max_samples=None))
    base.update(kw)
    return executor_config(**base)


class Spy(Executor):
    """Records every evaluation call the executor makes of its engine."""

    def _load(self) -> None:
        super()._load()
        real = self.engine.evaluate_metrics
        self.calls: list[dict] = []

        def spy(examples, batch_size=8, job_ids=None, max_sequences=None, forwards=None):  # noqa: ANN001, ANN202
            self.calls.append({"examples": list(examples), "batch_size": batch_size,
                               "jobs": job_ids, "max_sequences": max_sequences,
                               "forwards": forwards})
            return real(examples, batch_size, job_ids, max_sequences, forwards)

        self.engine.evaluate_metrics = spy


def run(cfg: ExecutorConfig) -> tuple[Spy, dict[str, list[int]], list]:
    evals: dict[str, list[int]] = defaultdict(list)
    events: list = []
    ex = Spy(cfg, Callbacks(on_eval=lambda j, s, v: evals[j].append(s),
                            on_event=lambda j, m, d: events.append((m, d))))
    ex.run()
    return ex, dict(evals), events


def test_eval_max_samples_uses_the_first_n_validation_samples(files) -> None:  # noqa: ANN001
    jobs = [TrainJob("a", lora_rank=2, lora_alpha=4, learning_rate=1e-3, batch_size=2, max_steps=2, seed=1)]
    ex, evals, _ = run(make_cfg(files, "cap", jobs, eval=EvalSettings(
        eval_every_steps=1, eval_max_samples=4)))
    every = tokenize_all(ex.tokenizer, read_jsonl(files[3]), 48)
    # the evaluation set: the first 4 of the validation file in the split seed's shuffled order
    random.Random(0).shuffle(every)
    first4 = every[:4]
    assert evals == {"a": [1, 2]}
    for call in ex.calls:  # the same 4 (in length order) in every evaluation
        assert sorted(call["examples"], key=lambda e: e.input_ids) == sorted(first4, key=lambda e: e.input_ids)
        lengths = [len(e.input_ids) for e in call["examples"]]
        assert lengths == sorted(lengths, reverse=True)
    ex_all, _, _ = run(make_cfg(files, "nocap", jobs, eval=EvalSettings(
        eval_every_steps=1, eval_max_samples=None)))
    assert len(ex_all.calls[0]["examples"]) == 9


def test_eval_cadence_by_samples_is_the_same_per_sample_for_every_batch_size(files) -> None:  # noqa: ANN001
    jobs = [TrainJob("b1", lora_rank=2, lora_alpha=4, learning_rate=1e-3, batch_size=1, max_steps=12, seed=1),
            TrainJob("b4", lora_rank=4, lora_alpha=8, learning_rate=1e-3, batch_size=4, max_steps=3, seed=2),
            TrainJob("b3", lora_rank=2, lora_alpha=4, learning_rate=1e-3, batch_size=3, max_steps=4, seed=3)]
    _, by_samples, _ = run(make_cfg(files, "samples", jobs, eval=EvalSettings(
        eval_every_steps=1, eval_every_samples=4, eval_max_samples=3)))
    # a job evaluates when its samples seen cross a multiple of 4 (and at its end)
    assert by_samples == {"b1": [4, 8, 12], "b4": [1, 2, 3], "b3": [2, 3, 4]}
    seen = {j: [s * b for s in steps] for (j, steps), b in zip(sorted(by_samples.items()), (1, 3, 4), strict=True)}
    assert seen == {"b1": [4, 8, 12], "b3": [6, 9, 12], "b4": [4, 8, 12]}
    # by steps (the old cadence): the batch-1 job evaluates 4x as often per sample as batch 4
    _, by_steps, _ = run(make_cfg(files, "steps", jobs, eval=EvalSettings(
        eval_every_steps=1, eval_max_samples=3)))
    assert by_steps == {"b1": list(range(1, 13)), "b4": [1, 2, 3], "b3": [1, 2, 3, 4]}


def test_default_cadence_is_by_samples_unless_a_step_cadence_is_named() -> None:
    default = EvalSettings()
    assert (default.eval_every_samples, default.eval_max_samples) == (1024, 256)
    # a request (or a stored task) naming eval_every_steps alone keeps that step cadence
    assert EvalSettings(eval_every_steps=5).eval_every_samples is None
    assert EvalSettings.model_validate({"eval_every_steps": 5}).eval_every_samples is None
    assert EvalSettings.model_validate({"eval_max_samples": 8}).eval_every_samples == 1024
    both = EvalSettings.model_validate({"eval_every_steps": 5, "eval_every_samples": 64})
    assert (both.eval_every_steps, both.eval_every_samples) == (None, 64)  # samples win
    # what the service stores (a dump) reads back the same
    for e in (default, both, EvalSettings(eval_every_steps=7),
              EvalSettings.model_validate({"eval_every_samples": None})):
        assert EvalSettings.model_validate(e.model_dump()) == e


def test_evaluation_runs_at_the_admitted_budget_with_the_same_losses(files) -> None:  # noqa: ANN001
    jobs = [TrainJob(f"j{i}", lora_rank=2 + i, lora_alpha=4, learning_rate=1e-2, batch_size=1 + i % 2, max_steps=2, seed=i)
            for i in range(3)]
    # a token budget of 16 sequences of 48 tokens: one eval forward may hold 16 sequences
    wide, wide_vals, _ = run(make_cfg(files, "wide", jobs, max_tokens_per_step=16 * 48, eval_batch_size=1,
                                      eval=EvalSettings(eval_every_steps=2, eval_max_samples=None)))
    call = wide.calls[0]
    assert call["max_sequences"] == 16 and call["batch_size"] == 5  # 3 jobs x 9: 2 chunks of 5
    assert eval_forwards(3, 9, call["batch_size"], 16) == 2  # the old plan: 9 x 3 = 27 forwards
    assert eval_forwards(3, 9, 1, 3) == 9 * 3 // 3
    # the same numbers as one sequence per forward
    eng = wide.engine
    for spec in jobs:
        eng.attach(spec)
    val = wide.val
    narrow = eng.evaluate_metrics(val, 1, None, 1)
    broad = eng.evaluate_metrics(val, 9, None, 27)
    eng.head_chunk = 3  # the no-grad loss in chunks of 3 tokens: the same sums
    sliced = eng.evaluate_metrics(val, 9, None, 27)
    for j in narrow:
        assert broad[j]["loss"] == pytest.approx(narrow[j]["loss"], rel=1e-5)
        assert sliced[j]["loss"] == pytest.approx(narrow[j]["loss"], rel=1e-5)


@pytest.mark.parametrize("n_jobs,n_examples,cap,floor", [(8, 256, 200, 8), (3, 9, 16, 1), (5, 7, 3, 4),
                                                         (32, 64, 100, 8), (1, 1, 1, 8)])
def test_eval_chunk_is_the_fewest_forwards_within_the_cap(n_jobs, n_examples, cap, floor) -> None:  # noqa: ANN001
    c = eval_chunk(n_jobs, n_examples, cap, floor)
    lo = min(floor, n_examples)
    width = max(cap, lo)
    assert lo <= c <= max(width, lo) and (width // c) * c <= width
    best = min(eval_forwards(n_jobs, n_examples, k, width) for k in range(lo, min(width, n_examples) + 1))
    assert eval_forwards(n_jobs, n_examples, c, width) == best


def test_stored_profiles_roundtrip_and_keys(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "node" / "memory_profiles.json"
    assert load_profile(path, "k") is None  # no file yet
    store_profile(path, "k", MemoryModel(1.5, 2.5))
    store_profile(path, "other", MemoryModel(3.0, 4.0))
    assert load_profile(path, "k") == MemoryModel(1.5, 2.5)
    assert load_profile(path, "other") == MemoryModel(3.0, 4.0)
    assert load_profile(path, "missing") is None and load_profile(None, "k") is None
    path.write_text("{not json")
    assert load_profile(path, "k") is None  # a torn/corrupt file is a miss, never an error
    store_profile(path, "k", MemoryModel(5.0, 6.0))  # and is replaced by a good one
    assert json.loads(path.read_text())["k"]["k0"] == 5.0


def test_executor_builds_its_model_once_per_key_then_reuses(files, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """No probe step: the first executor of a key builds the memory model from the config
    (trainer.memory_model) and stores it at once; the next of that key starts from the stored one."""
    cache = tmp_path / "profiles.json"
    probed = []
    monkeypatch.setattr(MemoryPlan, "probe_step", lambda self, total_batch: probed.append(total_batch))

    jobs = [TrainJob("a", lora_rank=4, lora_alpha=8, learning_rate=1e-3, batch_size=2, max_steps=1)]
    got = []
    for seq in (48, 48, 32):
        ex = Executor(make_cfg(files, f"p{len(got)}", jobs, max_seq_len=seq, profile_cache=str(cache)))
        ex._load()  # on the CPU admission uses a token budget; ask for the (stored) model
        got.append((ex.memory.stored_model(), ex.memory.profile_reused))
    assert probed == []  # no profiling pass
    assert got[0][0] == got[1][0] and got[0][0].k1 > 0 and got[0][0].k0 > 0
    assert [reused for _, reused in got] == [False, True, False]  # another max_seq_len: another key
    keys = [json.loads(k) for k in json.loads(cache.read_text())]
    assert sorted(k["seq_len"] for k in keys) == [32, 48]
    assert {k["gpu"] for k in keys} == {"cpu"} and {k["torch"] for k in keys} == {torch.__version__}
    assert {k["memory_model"] for k in keys} == {"static"}  # one GPU (live form) keys apart
    # what is stored is what the next executor starts from (e.g. corrected by a task's steps)
    table = json.loads(cache.read_text())
    key48 = next(k for k in table if json.loads(k)["seq_len"] == 48)
    table[key48].update(k0=5e9, k1=7e5)
    cache.write_text(json.dumps(table))
    ex = Executor(make_cfg(files, "p_corrected", jobs, max_seq_len=48, profile_cache=str(cache)))
    ex._load()
    assert ex.memory.stored_model() == MemoryModel(5e9, 7e5) and ex.memory.profile_reused
    # a different model (its config changed) is another key too
    key = ex.memory.profile_key()
    assert key in json.loads(cache.read_text())
    changed = json.loads(key)
    changed["model_config"] = (changed["model_config"] or "") + " "
    assert json.dumps(changed, sort_keys=True) not in json.loads(cache.read_text())
    # the model without activation recompute is another key, larger per token
    ex = Executor(make_cfg(files, "p_nr", jobs, max_seq_len=48, profile_cache=str(cache)))
    ex._load()
    without = ex.memory.stored_model(recompute=False)
    assert ex.memory.profile_key(False) != ex.memory.profile_key(True) and without.k1 > got[0][0].k1 and probed == []


def test_executor_reports_its_wall_time_by_phase(files) -> None:  # noqa: ANN001
    jobs = [TrainJob("a", lora_rank=2, lora_alpha=4, learning_rate=1e-3, batch_size=2, max_steps=4, seed=1)]
    ex, _, events = run(make_cfg(files, "phases", jobs, checkpoint_every=2, eval=EvalSettings(
        eval_every_steps=2, eval_max_samples=3)))
    t = next(d for m, d in events if m == "timings")
    assert set(t) >= {f"{p}_s" for p in PHASES} | {"wall_s", "idle_s", "first_step_s"}
    assert all(t[f"{p}_s"] > 0 for p in ("load", "train", "eval", "checkpoint", "export"))
    assert t["profile_s"] == 0.0  # the CPU never profiles
    busy = sum(t[f"{p}_s"] for p in PHASES)
    assert busy <= t["wall_s"] + 1e-6 and t["idle_s"] == pytest.approx(t["wall_s"] - busy, abs=1e-3)
    assert t["load_s"] < t["first_step_s"] <= t["wall_s"] and t["global_step"] == 4


def test_executor_attention_setting_packs_varlen_with_the_rows_losses(files) -> None:  # noqa: ANN001
    """ExecutorConfig.attention reaches the engine: "varlen" lays sequences back to back (no
    padding cells) and trains to the losses of "rows"; the stored profile is keyed by it."""
    jobs = [TrainJob("a", lora_rank=2, lora_alpha=4, learning_rate=1e-3, batch_size=3, max_steps=3, seed=1),
            TrainJob("b", lora_rank=4, lora_alpha=8, learning_rate=2e-3, batch_size=2, max_steps=3, seed=2)]
    losses: dict[str, dict[str, list[float]]] = {}
    keys = {}
    for mode in ("rows", "varlen"):
        seen: dict[str, list[float]] = defaultdict(list)
        ex = Executor(make_cfg(files, f"att_{mode}", jobs, attention=mode),
                      Callbacks(on_train_loss=lambda j, s, loss, seen=seen: seen[j].append(loss)))
        ex.run()
        assert ex.engine.attention == mode
        losses[mode], keys[mode] = dict(seen), json.loads(ex.memory.profile_key())["attention"]
    assert keys == {"rows": "rows", "varlen": "varlen"}
    for job in ("a", "b"):
        assert len(losses["varlen"][job]) == 3
        assert losses["varlen"][job] == pytest.approx(losses["rows"][job], rel=1e-4, abs=1e-5)
    with pytest.raises(ValueError, match="attention"):
        Executor(make_cfg(files, "att_bad", jobs, attention="flash")).run()
    # the default, "auto": varlen only where the flash kernel runs (CUDA, SFT, one GPU)
    auto = Executor(make_cfg(files, "att_auto", jobs))
    assert auto.cfg.attention == "auto"
    assert auto._attention_mode(torch.device("cpu")) == "rows"
    assert auto._attention_mode(torch.device("cuda")) == ("varlen" if flash_varlen_available() else "rows")
    dpo = Executor(make_cfg(files, "att_dpo", jobs, method="dpo"))
    assert dpo._attention_mode(torch.device("cuda")) == "rows"
    # a model whose attention the flash kernel cannot compute (Gemma-2's soft-cap) keeps rows
    capped = Executor(make_cfg(files, "att_gemma2", jobs,
                               model_dir=str(tiny_model_dir("gemma2", files[0]))))
    assert capped._attention_mode(torch.device("cuda")) == "rows"


def test_eval_subset_size_rounds_to_the_minimum_times_a_power_of_two() -> None:
    from trainer.task_eval import eval_subset_size

    assert [eval_subset_size(e, 64, 256) for e in (0, 1, 64, 65, 128, 129, 250, 10_000)] == [
        64, 64, 64, 128, 128, 256, 256, 256]
    assert eval_subset_size(500, 64, 200) == 200  # never past the evaluation set
    assert eval_subset_size(1, 64, 40) == 40  # a set smaller than the minimum: all of it


def test_evaluations_scale_with_the_samples_trained_since_the_last_one(tmp_path, files) -> None:  # noqa: ANN001
    _, model, train, _ = files
    val = write_jsonl(tmp_path / "val40.jsonl", synthetic_rows(40, seed=5, fmt="completion"))
    ev = EvalSettings(eval_every_samples=8, eval_max_samples=None, eval_samples_per_trained=0.5,
                      eval_min_samples=2)
    jobs = [TrainJob("a", lora_rank=2, lora_alpha=4, learning_rate=1e-3, batch_size=2, max_steps=6, seed=1),
            TrainJob("b", lora_rank=2, lora_alpha=4, learning_rate=1e-3, batch_size=1, max_steps=3, seed=2)]
    ex, evals, _ = run(make_cfg(files, "scale", jobs, val_file=str(val), eval=ev))
    assert evals == {"a": [4, 6], "b": [3]}
    sizes = {(tuple(c["jobs"]), len(c["examples"])) for c in ex.calls}
    # a: 8 samples since its start earn 4; its last evaluation is sized by all 12 it trained on
    # (6, rounded up to 2 x 4 = 8); b's last: 3 samples earn 1.5, rounded up to 2
    assert sizes == {(("a",), 4), (("a",), 8), (("b",), 2)}
    # every evaluation is a leading subset of one order: the smaller inside the larger
    by_size = {len(c["examples"]): {e.input_ids for e in c["examples"]} for c in ex.calls}
    assert by_size[2] < by_size[4] < by_size[8]
    # null ratio: the whole set every time
    ex_all, _, _ = run(make_cfg(files, "scale-all", jobs, val_file=str(val), eval=EvalSettings(
        eval_every_samples=8, eval_max_samples=None, eval_samples_per_trained=None)))
    assert {len(c["examples"]) for c in ex_all.calls} == {40}


def test_the_warmup_ranking_evaluates_every_job_on_the_same_subset(tmp_path, files) -> None:  # noqa: ANN001
    val = write_jsonl(tmp_path / "val64.jsonl", synthetic_rows(64, seed=6, fmt="completion"))
    jobs = [TrainJob(f"j{i}", lora_rank=2, lora_alpha=4, learning_rate=1e-3, batch_size=b, max_steps=steps, seed=i)
            for i, (b, steps) in enumerate([(1, 40), (2, 20), (4, 10), (2, 20)])]
    ee = EarlyExitSettings(warmup_fraction=0.2, keep_fraction=0.5)
    ev = EvalSettings(eval_every_samples=10**6, eval_max_samples=None, eval_samples_per_trained=1.0,
                      eval_min_samples=2)
    ex, evals, events = run(make_cfg(files, "rank", jobs, val_file=str(val), early_exit=ee, eval=ev))
    ranking = [d for m, d in events if m == "warmup_ranking"]
    assert ranking and len(ranking[0]["keep"]) == 2
    first = {j: min(steps) for j, steps in evals.items()}
    assert first == {"j0": 8, "j1": 4, "j2": 2, "j3": 4}  # each at its warmup end
    # the longest warmup trains 8 samples: every job's ranking evaluation uses the same 8
    firsts = [next(c for c in ex.calls if j in c["jobs"]) for j in first]
    assert {frozenset(e.input_ids for e in c["examples"]) for c in firsts} == {
        frozenset(e.input_ids for e in firsts[0]["examples"])}
    assert all(len(c["examples"]) == 8 for c in firsts)


def test_recompute_policy_runs_steps_that_fit_without_recompute(files) -> None:  # noqa: ANN001
    """A step whose own tokens the no-recompute memory model fits (decided once the step has
    drawn its batch) runs without activation recompute, a larger one with it; the losses are
    those of recompute everywhere, and the timings event counts both."""
    from trainer.admission import RecomputePolicy

    jobs = [TrainJob("big", lora_rank=2, lora_alpha=4, learning_rate=1e-2, batch_size=3, max_steps=2, seed=1),
            TrainJob("small", lora_rank=4, lora_alpha=8, learning_rate=1e-2, batch_size=1, max_steps=5, seed=2)]

    class Policy(Executor):
        def _load(self) -> None:
            super()._load()
            # without recompute, 96 bytes: a step fits without it up to 76 tokens (x1.25 padding)
            self.memory.recompute_policy = RecomputePolicy(MemoryModel(0.0, 1.0), 2 * 48, 48)
            real, self.modes, self.tokens = self.engine.step, [], []

            def step():  # noqa: ANN202
                report = real()
                self.modes.append(self.engine.gradient_checkpointing)  # what this step ran with
                self.tokens.append(sum(report.job_tokens.values()))
                return report

            self.engine.step = step

    losses: dict[str, list[float]] = defaultdict(list)
    events: list = []
    ex = Policy(make_cfg(files, "policy", jobs), Callbacks(
        on_train_loss=lambda j, s, v: losses[j].append(v), on_event=lambda j, m, d: events.append((m, d))))
    ex.run()
    assert ex.modes == [t * 1.25 > 96 for t in ex.tokens]  # each step by its own tokens
    assert True in ex.modes and False in ex.modes
    timings = next(d for m, d in events if m == "timings")
    on = sum(ex.modes)
    assert (timings["recompute_steps"], timings["no_recompute_steps"], timings["recompute"]) == (on, 5 - on, "auto")
    ref: dict[str, list[float]] = defaultdict(list)
    Executor(make_cfg(files, "policy-ref", jobs, gradient_checkpointing=True),
             Callbacks(on_train_loss=lambda j, s, v: ref[j].append(v))).run()
    for j in ref:
        assert losses[j] == pytest.approx(ref[j], rel=1e-5)
