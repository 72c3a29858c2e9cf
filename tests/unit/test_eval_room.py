"""Unit: evaluation forwards sized by a no-grad forward's room on one GPU (issue 40): the plan in
tokens (trainer.evaluation.eval_chunk_tokens), one arena copy in the compute dtype for all of an
evaluation's forwards (AdapterArena.compute_copy), the memory plan's room, its correction from
the allocator's peak and its retry after running out of memory (MemoryPlan.eval_tokens,
MemoryPlan.evaluation; the device's counters stood in for on the CPU), and an executor whose
evaluations are planned by tokens giving the losses of one sequence per forward."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from contract.protocol import EvalSettings
from tests.helpers.engine_ref import tiny_model_dir
from tests.unit.test_eval_speed import Spy, files, make_cfg  # noqa: F401  (files: a fixture)
from tests.unit.test_step_graphs import examples, job
from trainer.arena import AdapterArena
from trainer.config import Callbacks
from trainer.engine import MultiLoraEngine
from trainer.evaluation import eval_chunk, eval_chunk_tokens, eval_forwards
from trainer.jobs import TrainJob
from trainer.memory_model import Shapes, eval_fixed_bytes, eval_token_bytes, per_token_bytes

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("seed", range(6))
def test_eval_chunk_tokens_is_the_fewest_forwards_whose_largest_fits(seed: int) -> None:
    rng = random.Random(seed)
    n_jobs, n = rng.randint(1, 40), rng.randint(1, 70)
    lengths = sorted((rng.randint(20, 500) for _ in range(n)), reverse=True)
    max_tokens, floor = rng.randint(300, 60_000), rng.choice([1, 4, 8])
    chunk, cap = eval_chunk_tokens(n_jobs, lengths, max_tokens, floor)
    group = cap // chunk
    prefix = list(itertools.accumulate(lengths))
    lo = min(floor, n)
    fitting = [(c, min(n_jobs, max_tokens // prefix[c - 1])) for c in range(lo, n + 1)
               if max_tokens >= prefix[c - 1]]
    if not fitting:  # not even the floor fits: one job, the floor's chunk
        assert (chunk, cap) == (lo, lo)
        return
    assert chunk >= lo and 1 <= group <= n_jobs
    assert group * prefix[chunk - 1] <= max_tokens  # the largest forward (the first) fits
    best = min(eval_forwards(n_jobs, n, c, g * c) for c, g in fitting)
    assert eval_forwards(n_jobs, n, chunk, cap) == best


def test_eval_chunk_tokens_holds_many_jobs_where_a_step_held_few() -> None:
    lengths = [300] * 8 + [200] * 56  # 64 examples, 13.6k tokens a job
    # chunks of 32 (7.2k tokens a job): 8 jobs a forward, 6 x 2 forwards (64: 4 jobs, 12 x 1, as few)
    # a step's room of 8 sequences (the old plan) made 48 x 8 = 384 forwards of one job
    assert eval_forwards(48, 64, 8, 8) == 384
    assert eval_chunk_tokens(48, lengths, 60_000, 8) == (32, 32 * 8)
    assert eval_forwards(48, 64, 32, 32 * 8) == 12
    assert eval_chunk_tokens(3, [900, 800], 500, 1) == (1, 1)  # nothing fits: one example of one job
    # each job's adapter copy costs room too: chunks of 64 (4 jobs of 13.6k + 1k: 12 forwards) now
    # beat chunks of 32 (7 jobs of 7.2k + 1k: 14)
    assert eval_chunk_tokens(48, lengths, 60_000, 8, job_tokens=1000) == (64, 64 * 4)


def test_an_evaluation_forward_needs_a_fraction_of_a_training_steps_bytes_per_token() -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256)
    s = Shapes.of(cfg)
    forward = eval_token_bytes(cfg, 7, 64)
    assert forward < 0.5 * per_token_bytes(s, True, 7, 64)  # recompute keeps each layer's input
    assert forward < 0.05 * per_token_bytes(s, False, 7, 64)
    assert eval_fixed_bytes(cfg, 1024) > 16 * 1024 * 128256  # the head's chunk


def _bf16_engine(model_dir, data):  # noqa: ANN001, ANN202
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    return MultiLoraEngine(model, data, 0, gradient_checkpointing=True, attention="varlen", step_graphs=True)


def test_an_evaluation_reads_one_copy_of_its_jobs_adapters(tmp_path) -> None:  # noqa: ANN001
    """Float32 adapters under a bfloat16 backbone: within compute_copy, the evaluated jobs'
    regions alone are copied once (each at its offset modulo 16), every no-grad layout reads that
    copy (no capture), and the numbers equal those of the whole arena copied at each forward."""
    data = examples(24, 20, seed=3)
    held_out = examples(6, 20, seed=9)
    eng = _bf16_engine(tiny_model_dir("llama", tmp_path), data)
    assert eng.slots.arena.dtype == torch.float32 and eng.compute_dtype == torch.bfloat16
    for spec in (job("a", 4, 2, 1), job("b", 16, 1, 2), job("c", 8, 1, 3)):
        eng.attach(spec)
    eng.step()
    slots = eng.slots
    evaluated = [eng.jobs["a"], eng.jobs["c"]]
    eng.model.eval()
    with torch.no_grad():
        want, counts = eng.evaluation.token_sums(evaluated, held_out)  # the whole arena, copied now
        want = want.double().clone()  # (a graph's output buffer)
        with slots.compute_copy(evaluated):
            copy, regions, _ = slots._copy
            assert slots.copied and set(regions) == {"a", "c"}
            assert copy.dtype == torch.bfloat16 and copy.numel() < slots.arena.numel()
            for j, (lo, hi) in regions.items():
                a_lo, a_hi = slots.regions[j]
                assert lo % 16 == a_lo % 16 and hi - lo == a_hi - a_lo
                assert torch.equal(copy[lo:hi], slots.arena[a_lo:a_hi].to(torch.bfloat16))
            assert slots.layout_arenas()[0] is copy
            with pytest.raises(ValueError, match="not in the evaluation's arena copy"):
                slots.layout_offsets([eng.jobs["b"]])
            with torch.enable_grad():  # a layout with grad (a step) copies the whole arena
                assert slots.layout_arenas()[0] is not copy
            runs = eng.step_graphs.replays + eng.step_graphs.captures + eng.step_graphs.eager_runs
            got, got_counts = eng.evaluation.token_sums(evaluated, held_out)
            # eager on the copy: no graph, not even the graphs' eager run on their buffers
            assert eng.step_graphs.replays + eng.step_graphs.captures + eng.step_graphs.eager_runs == runs
    assert not slots.copied and slots._copy is None
    assert torch.equal(counts, got_counts)
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-6)
    # the engine's evaluation makes that copy per group of jobs
    metrics = eng.evaluate_metrics(held_out, batch_size=6, job_ids=["a", "c"])
    for k, j in enumerate(["a", "c"]):
        assert metrics[j]["loss"] == pytest.approx(want[k, 0].item() / counts[k].item(), rel=1e-6), j
    same = AdapterArena([], torch.device("cpu"), torch.float32, torch.float32)
    with same.compute_copy(evaluated):  # the arena in the compute dtype: nothing copied
        assert not same.copied and same.layout_arenas()[0] is same.arena


class _Device:
    """The allocator's counters the memory plan reads during an evaluation (no CUDA here)."""

    def __init__(self, monkeypatch, allocated: int) -> None:  # noqa: ANN001
        self.allocated, self.peak = allocated, allocated
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def _executor(paths, name: str, **kw):  # noqa: ANN001, ANN202
    jobs = [TrainJob(f"j{i}", lora_rank=2 + i, lora_alpha=4, learning_rate=1e-2, batch_size=1 + i % 2,
                     max_steps=2, seed=i) for i in range(3)]
    return Spy(make_cfg(paths, name, jobs, eval_batch_size=1, **kw), Callbacks())


def test_the_memory_plan_sizes_corrects_and_retries_evaluations(files, monkeypatch) -> None:  # noqa: ANN001, F811
    ex = _executor(files, "plan", max_tokens_per_step=10_000)
    ex._load()
    plan = ex.memory
    assert plan.eval_per_token is None and plan.eval_tokens() is None  # the CPU: sized as a step
    plan.eval_per_token, plan.eval_fixed = 2.0, 1000.0  # what a GPU's plan holds
    room = plan.admission.headroom
    assert plan.eval_tokens() == int((room - 1000.0) / 2.0)
    device = _Device(monkeypatch, 500)

    def forwards(peak: int, tokens: int):  # noqa: ANN202
        def run():  # noqa: ANN202
            device.peak = peak
            return "numbers", tokens
        return run

    # a peak under the model changes nothing; one above it raises the bytes per token
    assert plan.evaluation(forwards(500 + 1000 + 2 * 8000, 8000)) == "numbers"
    assert plan.eval_per_token == 2.0
    assert plan.evaluation(forwards(500 + 1000 + 3 * 8000, 8000)) == "numbers"
    assert plan.eval_per_token == pytest.approx(3.0 * 1.05)
    # a small forward (a graph's replay shows nothing to the allocator) teaches nothing
    plan.evaluation(forwards(500 + 1000 + 100 * 4000, 4000))
    assert plan.eval_per_token == pytest.approx(3.0 * 1.05)

    # out of memory: again with the bytes per token doubled, then with the device relieved (parked
    # states to the host), then sized as a training step
    seen: list[int | None] = []

    def failing(times: int):  # noqa: ANN202
        def run():  # noqa: ANN202
            seen.append(plan.eval_tokens())
            if len(seen) <= times:
                raise torch.cuda.OutOfMemoryError("out of memory")
            return "numbers", 10
        return run

    relieved: list[bool] = []

    def relieve() -> bool:  # the parked states go to the host once; then nothing is left to move
        relieved.append(not relieved)
        return relieved[-1]

    assert plan.evaluation(failing(2), relieve) == "numbers"
    assert seen == [int((room - 1000.0) / 3.15), int((room - 1000.0) / 6.3), int((room - 1000.0) / 6.3)]
    assert relieved == [True] and plan.eval_retries == 2
    seen.clear()
    assert plan.evaluation(failing(1), relieve) == "numbers"  # nothing left to relieve
    assert seen == [int((room - 1000.0) / 6.3), None] and relieved == [True, False]
    assert plan.eval_per_token is None and plan.eval_tokens() is None
    assert plan.eval_retries == 3 and ex.timings()["eval_retries"] == 3


def test_evaluations_planned_by_tokens_give_the_losses_of_one_sequence_a_forward(files, monkeypatch) -> None:  # noqa: ANN001, F811
    """An executor whose evaluations are planned by a no-grad forward's room: each forward within
    the room, jobs grouped as the plan says, and the same losses as one sequence per forward."""
    _Device(monkeypatch, 0)
    ex = _executor(files, "tokens", max_tokens_per_step=12 * 48,
                   eval=EvalSettings(eval_every_steps=2, eval_max_samples=None))
    real_load = ex._load

    def load() -> None:
        real_load()
        ex.memory.eval_per_token, ex.memory.eval_fixed = 1.0, 0.0  # the room in tokens: the headroom

    ex._load = load
    ex.run()
    room = int(ex.memory.admission.headroom)
    lengths = sorted((len(e.input_ids) for e in ex.val), reverse=True)
    assert ex.calls
    for call in ex.calls:
        bs, cap = call["batch_size"], call["max_sequences"]
        group = min(len(call["jobs"]), cap // bs)
        assert group * sum(lengths[:bs]) <= room  # the largest forward fits the room
        assert (bs, cap) == eval_chunk_tokens(len(call["jobs"]), lengths, room, 1)
    # planned by tokens (the examples are shorter than max_seq_len): fewer forwards than a step's
    # room of 12 sequences made
    first = ex.calls[0]
    assert eval_forwards(3, 9, first["batch_size"], first["max_sequences"]) < eval_forwards(3, 9, eval_chunk(3, 9, 12, 1), 12)
    eng = ex.engine
    for spec in ex.cfg.jobs:
        eng.attach(spec)
    narrow = eng.evaluate_metrics(ex.val, 1, None, 1)
    call = ex.calls[0]
    with eng.slots.compute_copy(list(eng.jobs.values())):
        planned = eng.evaluate_metrics(ex.val, call["batch_size"], None, call["max_sequences"])
    for j in narrow:
        assert math.isclose(planned[j]["loss"], narrow[j]["loss"], rel_tol=1e-5), j
