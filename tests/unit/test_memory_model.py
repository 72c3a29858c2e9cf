"""Unit: the memory model built with no profiling pass (trainer.memory_model): its terms from a
model config, and the online correction from the allocator's peaks of real steps (raised at once
when a step needs more, lowered to what the steps needed once they agree, replays ignored)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from trainer.admission import AdmissionController, MemoryModel
from trainer.jobs import ADAMW_CHUNK, TrainJob
from trainer.memory_model import (
    HEAD_BYTES,
    MAX_POINTS,
    STEP_FIXED,
    OnlineCorrection,
    Shapes,
    analytic_model,
    envelope,
    head_bytes,
    over,
    per_token_bytes,
    state_bytes_per_param,
)

LLAMA_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8)


def test_shapes_and_terms_of_the_8b_config() -> None:
    s = Shapes.of(LLAMA_8B)
    assert (s.hidden, s.intermediate, s.layers, s.kv, s.vocab) == (4096, 14336, 32, 1024, 128256)
    with_rc, without = (per_token_bytes(s, rc, 7, 64) for rc in (True, False))
    # recompute keeps a layer's input per layer (+ one layer live): far less than every layer's
    assert 32 * 2 * 4096 < with_rc < without / 4
    live = analytic_model(LLAMA_8B, head_chunk=2048, max_rank=64, n_targets=7, recompute=True)
    # live form: the step's fixed transient only (the head's chunk: 4.2 GB; AdamW's group; a workspace)
    assert head_bytes(s, 2048) == 16 * 2048 * 128256
    assert head_bytes(s, 2048) < live.k0 < head_bytes(s, 2048) + 1.7e9
    assert live.k1 == pytest.approx(with_rc)
    # static form: with the resident bytes and one job of the largest rank
    static = analytic_model(LLAMA_8B, head_chunk=2048, max_rank=64, n_targets=7, recompute=True,
                            resident=16e9, state_bytes_per_rank=2.6e6 * 18)
    assert static.k0 == pytest.approx(live.k0 + 16e9 + 2.6e6 * 18 * 64)
    # a DPO item is two sequences
    pairs = analytic_model(LLAMA_8B, head_chunk=2048, max_rank=16, n_targets=7, recompute=True,
                           sequences_per_item=2)
    assert pairs.k1 == pytest.approx(2 * per_token_bytes(s, True, 7, 16))
    # a job's state: fp32 adapter + two moments + fp32 gradient, with the arena's growth
    assert state_bytes_per_param(4) == pytest.approx(16 * 1.125)


def test_live_admission_counts_what_is_resident_and_each_jobs_state() -> None:
    resident = {"now": 20e9}
    adm = AdmissionController(MemoryModel(1e9, 1e6), 40e9, 1000, safety=1.0, resident=lambda: resident["now"],
                              state_bytes=lambda j: 2e9 * j.lora_rank / 64)
    jobs = [TrainJob(f"j{i}", lora_rank=64, batch_size=2) for i in range(6)]
    # headroom 20 GB: each job 2 GB state + 2 GB of activations (2 x 1000 tokens x 1 MB), 1 GB fixed
    assert adm.admit(jobs, []) == ["j0", "j1", "j2", "j3"]
    resident["now"] = 30e9  # e.g. states parked on the device since
    assert adm.admit(jobs, []) == ["j0", "j1"]
    assert adm.max_total_batch() == 9
    assert adm.unschedulable([TrainJob("big", lora_rank=64, batch_size=7)]) == []
    assert adm.unschedulable([TrainJob("huge", lora_rank=64, batch_size=8)]) == ["huge"]


def test_online_correction_raises_at_once_and_settles_to_the_steps_envelope() -> None:
    corr = OnlineCorrection(MemoryModel(20e9, 500e3), head_per_token=1e6, head_chunk=1000, settle=3)
    fixed = corr.fixed(1000, 0)  # the head's chunk (1 GB at >= 1000 tokens) and the step's constant
    assert fixed == pytest.approx(1e9 + STEP_FIXED)
    res = 20_000_000_000
    # the largest step so far needing 600 kB a token: the slope raised at once, above it
    assert corr.observe(2000, True, res, int(res + fixed + 600e3 * 2000))
    assert corr.model.k1 == pytest.approx(600e3 * 1.05) and corr.extra == 0
    # a step that leaves more allocated (a first step's AdamW moments): not corrected from, and
    # predicted as its activations or its lasting allocations, whichever is larger
    assert not corr.observe(2000, True, res, int(res + 5e9 + 1e9), after=int(res + 5e9))
    assert corr.model.k1 == pytest.approx(600e3 * 1.05)
    assert corr.trace[-1].predicted == pytest.approx(max(res + fixed + 630e3 * 2000, res + 5e9))
    # a smaller step short by 300 MB: the constant rises (k0 with it), not the slope (charged per
    # token, 300 MB over 100 tokens would have made k1 3 MB/token: 5x every large step's need)
    assert corr.observe(100, True, res, int(res + corr.fixed(100, 0) + 630e3 * 100 + 300e6))
    assert corr.model.k1 == pytest.approx(630e3)
    assert corr.extra == pytest.approx(300e6 * 1.05 + 630e3 * 100 * 0.05)
    assert corr.model.k0 == pytest.approx(20e9 + corr.extra)
    again = corr.trace[-1]
    assert corr.predict_transient(100) + res >= again.peak  # covers the step that raised it
    # settled (3 steps over a span of 20x): the covering line of least relative over-prediction,
    # taken where it over-predicts the steps less than the line before
    assert corr.observe(4000, True, res, int(res + corr.fixed(4000, 0) + 520e3 * 4000 + 300e6))
    assert corr.model.k1 < 630e3
    for t, x in [(2000, 600e3 * 2000), (100, 630e3 * 100 + 300e6), (4000, 520e3 * 4000 + 300e6)]:
        assert corr.extra + corr.model.k1 * t >= x  # every step stays covered
    top = 520e3 * 4000 + 300e6
    assert corr.extra + corr.model.k1 * 4000 == pytest.approx(top * 1.05)
    # every step is traced with its prediction at the model of its time
    corr2 = OnlineCorrection(MemoryModel(20e9, 900e3), head_per_token=1e6, head_chunk=1000, settle=2)
    corr2.observe(1000, True, res, int(res + fixed + 500e3 * 1000))
    corr2.observe(1000, True, res, int(res + fixed + 520e3 * 1000))
    assert corr2.model == MemoryModel(20e9, 900e3)  # no span of tokens: no slope to settle to
    assert [round(p.predicted) for p in corr2.trace] == [round(res + fixed + 900e3 * 1000)] * 2


def test_envelope_of_the_steps() -> None:
    # the covering line whose largest over-prediction relative to a step's peak is least; none
    # without a span of tokens
    assert envelope([(1000, 1e9, 10e9), (1500, 1.4e9, 10e9)]) is None
    pts = [(100, 0.5e9, 10e9), (1000, 2e9, 10e9), (4000, 5e9, 10e9)]
    e, k = envelope(pts)
    # equal peaks: tangent at the middle step, the two ends over-predicted alike
    assert k == pytest.approx(4.5e9 / 3900, rel=1e-6) and e == pytest.approx(2e9 - 1000 * k, rel=1e-6)
    assert all(e + k * t >= x - 1 for t, x, _ in pts)
    assert over(pts, e, k) == pytest.approx((e + 100 * k - 0.5e9) / 10e9, rel=1e-6)
    # session 38's rule (through the largest step, the steepest slope covering the rest) over-predicts more
    k38 = 3e9 / 3000
    assert over(pts, 5e9 - 4000 * k38, k38) > over(pts, e, k) * 1.05
    # a step of a small peak weighs more: the line comes closer to it
    e2, k2 = envelope([(100, 0.5e9, 1e9), (1000, 2e9, 10e9), (4000, 5e9, 10e9)])
    assert e2 + 100 * k2 - 0.5e9 < e + 100 * k - 0.5e9
    # a floor on the slope: the least covering constant at the floor
    e3, k3 = envelope(pts, floor=1.4e6)
    assert k3 == pytest.approx(1.4e6) and e3 == pytest.approx(max(x - 1.4e6 * t for t, x, _ in pts))
    # points under a line through the origin: no negative constant
    assert envelope([(100, 1e6, 1e9), (1000, 1e9, 1e9)]) == (pytest.approx(0.0, abs=1.0), pytest.approx(1e6))
    # equally tight lines (the largest relative over-prediction is a step the tangent step's own
    # constant sets, whatever the slope in [0.5, 1] MB): the steepest, the safer for larger steps
    tie = [(1000, 1e9, 1e9), (1000, 0.5e9, 1e9), (500, 0.4e9, 1e12), (2000, 1.5e9, 1e12)]
    assert envelope(tie)[1] == pytest.approx(1e6, rel=1e-3)


def test_a_later_lighter_largest_step_does_not_raise_every_small_steps_prediction() -> None:
    """Session 39's H200 search (a): its warmup's 48-job steps (8.7-9.7k cells) needed more per
    token than its largest step (14.3k cells, after the ranking, 12 jobs); session 38's envelope
    through that largest step then took a 3.5 MB slope and an 18 GB constant, and every later
    small step was over-predicted by 23-60%. The covering line of least relative over-prediction
    keeps them within 11% (the trace has no arena sizes: the arena's copy, counted since, is not
    told apart here, and the 48-job steps' larger copy is part of their larger need)."""
    mb = 1 << 20
    # the analytic model of the 8B shape without recompute there: k1 4.79 MB a cell
    corr = OnlineCorrection(MemoryModel(3.74e9, 4.79e6), head_per_token=1.03e6, head_chunk=2080, settle=8)
    steps = [(9728, 72506, 122957)] + [(8704, 72506, 118593)] * 5 + [
        (14336, 34532, 99603), (3584, 29972, 48418), (3584, 29972, 47778), (5120, 29092, 54352),
        (4096, 28212, 49002), (1280, 27332, 35238), (1536, 26453, 35573), (640, 26453, 31459),
        (80, 25653, 28070), (96, 24853, 27335), (112, 24853, 27406)]
    for cells, resident, peak in steps:
        corr.observe(cells, False, resident * mb, peak * mb)
    errors = [(p.predicted - p.peak) / p.peak for p in corr.trace]
    assert min(errors) >= -0.03  # the first step, before anything was learned
    assert max(errors[8:]) <= 0.11, errors  # the small steps after the model settled (device: 0.23-0.60)
    assert max(errors) <= 0.12  # the largest step, predicted from the warmup's heavier slope


def test_online_correction_on_a_shared_hosts_steps_recorded_on_an_h200() -> None:
    """Every step the allocator saw in the shared executor host on an H200 (two 8-job tasks of
    the 8B shape in one process, 64 to 8192 tokens, with and without recompute), replayed through
    the correction from the analytic model: each peak predicted within 10% (the code that ran
    there over-predicted an 842-token step by 15.4%: small steps' deficits charged per token) and
    never more than 1% under."""
    data = json.loads((Path(__file__).parent / "data" / "memory_trace_host_h200.json").read_text())
    config = LlamaConfig(**data["model"])
    s = Shapes.of(config)
    worst_before = max(abs(p - peak) / peak for _, _, _, peak, p in data["steps"])
    assert worst_before > 0.15  # what the trace's own predictions were
    for recompute in (True, False):
        mm = analytic_model(config, head_chunk=data["head_chunk"], max_rank=data["max_rank"],
                            n_targets=data["targets"], recompute=recompute)
        corr = OnlineCorrection(mm, head_per_token=HEAD_BYTES * s.vocab, head_chunk=data["head_chunk"])
        steps = [st for st in data["steps"] if st[1] == int(recompute)]
        assert len(steps) >= 4
        for cells, _, resident, peak, _ in steps:
            corr.observe(cells, recompute, resident << 20, peak << 20, ADAMW_CHUNK)
        for p in corr.trace:
            error = (p.predicted - p.peak) / p.peak
            assert -0.01 <= error <= 0.10, (p, error)


def test_the_analytic_model_against_peaks_measured_on_an_h100() -> None:
    """Every step of an 8B-shaped task the allocator saw on an H100 (eager steps and graph
    captures, with and without recompute, 640 to 8192 tokens): the analytic model, before any
    correction, predicts its peak within 10% and never more than 1% under."""
    data = json.loads((Path(__file__).parent / "data" / "memory_peaks_h100.json").read_text())
    s = Shapes.of(LlamaConfig(**data["model"]))
    assert len(data["steps"]) >= 10 and {st["recompute"] for st in data["steps"]} == {True, False}
    for st in data["steps"]:
        t = st["tokens"]
        transient = (head_bytes(s, min(t, data["head_chunk"])) + 4 * ADAMW_CHUNK + STEP_FIXED
                     + per_token_bytes(s, st["recompute"], data["targets"], data["max_rank"]) * t)
        error = (st["resident"] + transient - st["peak"]) / st["peak"]
        assert -0.01 <= error <= 0.10, (st, error)


def test_the_fused_analytic_model_against_peaks_measured_on_an_h100() -> None:
    """The same with the norms and the MLP gate on fused kernels (trainer.fused_blocks: no float32
    copy of a norm's input, no silu(gate) kept): every step of the 60-step task the allocator saw
    (session 26, 640 to 7168 tokens, with and without recompute) within 10% and never more than 1%
    under; the unfused model's slack would over-predict its steps without recompute by more."""
    data = json.loads((Path(__file__).parent / "data" / "memory_peaks_fused_h100.json").read_text())
    s = Shapes.of(LlamaConfig(**data["model"]))
    assert len(data["steps"]) >= 10 and {st["recompute"] for st in data["steps"]} == {True, False}
    worst_unfused = 0.0
    for st in data["steps"]:
        t = st["tokens"]
        fixed = head_bytes(s, min(t, data["head_chunk"])) + 4 * ADAMW_CHUNK + STEP_FIXED
        for fused in (True, False):
            per_token = per_token_bytes(s, st["recompute"], data["targets"], data["max_rank"], fused)
            error = (st["resident"] + fixed + per_token * t - st["peak"]) / st["peak"]
            if fused:
                assert -0.01 <= error <= 0.10, (st, error)
            elif not st["recompute"]:
                worst_unfused = max(worst_unfused, error)
    assert worst_unfused > 0.10


def test_the_model_with_the_fused_head_and_unexpanded_key_value_against_peaks_measured_on_an_h100() -> None:
    """Session 38's code (the head's cross-entropy fused: bf16 logits alone; grouped-query key and
    value kept at their own width by the flash kernel): every step the allocator saw of the 60-step
    task, and of search (a) after its warmup (384 to 6912 cells, with and without recompute), within
    10% and never more than 1% under; counted as before (float32 head, expanded key/value) the same
    steps are over-predicted by more than 10%, the 11-13% that session 38's first run showed."""
    data = json.loads((Path(__file__).parent / "data" / "memory_peaks_s38_h100.json").read_text())
    s = Shapes.of(LlamaConfig(**data["model"]))
    assert len(data["steps"]) >= 10 and {st["recompute"] for st in data["steps"]} == {True, False}
    worst_before = 0.0
    for st in data["steps"]:
        t = st["tokens"]
        for now in (True, False):
            fixed = head_bytes(s, min(t, data["head_chunk"]), fused_head=now) + 4 * ADAMW_CHUNK + STEP_FIXED
            per_token = per_token_bytes(s, st["recompute"], data["targets"], data["max_rank"], True, kv_expanded=not now)
            error = (st["resident"] + fixed + per_token * t - st["peak"]) / st["peak"]
            if now:
                assert -0.01 <= error <= 0.10, (st, error)
            else:
                worst_before = max(worst_before, error)
    assert worst_before > 0.10


def test_the_terms_follow_how_the_engine_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the head's cross-entropy is torch's and the attention repeats key and value: the
    counted terms say so. A head the fused kernel serves (here forced, its device check stood in)
    is counted as fused, and the expanded key/value add 2 (query width - key/value width)
    elements a token a layer."""
    from transformers import AutoModelForCausalLM

    from trainer import head as head_mod
    from trainer.engine import MultiLoraEngine
    from trainer.memory_model import engine_terms, layer_activation_bytes

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    eng = MultiLoraEngine(AutoModelForCausalLM.from_config(cfg), [], 0, attention="varlen")
    assert engine_terms(eng) == {"fused_head": False, "kv_expanded": True}
    monkeypatch.setattr(head_mod, "fused_ce_available", lambda _t: True)
    assert engine_terms(eng)["fused_head"] is False  # on the CPU only when forced
    eng.output_logits.force_fused = True
    assert engine_terms(eng) == {"fused_head": True, "kv_expanded": True}
    sh = Shapes.of(cfg)
    grown = layer_activation_bytes(sh, 7, 16, True) - layer_activation_bytes(sh, 7, 16, True, kv_expanded=False)
    assert grown == pytest.approx(1.06 * 2 * 2 * (32 - 16))


def test_recompute_is_chosen_from_the_steps_own_tokens(tmp_path) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    from tests.helpers.engine_ref import tiny_model_dir
    from trainer.admission import RecomputePolicy
    from trainer.data import IGNORE, Example
    from trainer.engine import MultiLoraEngine

    policy = RecomputePolicy(MemoryModel(1e9, 1e6), 10e9, 1024, resident=lambda: 4e9)
    # 1024-token sequences: the worst case of 2 needs recompute; 3,000 real tokens (x1.25) do not
    assert policy.recompute(5) and not policy.recompute_tokens(3000) and policy.recompute_tokens(4100)
    # a row whose length is known (a graphed step's key) gets no padding allowance: 4,100 fit then
    assert not policy.recompute_tokens(4100, padding=1.0) and policy.recompute_tokens(5100, padding=1.0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", tmp_path), dtype=torch.float32)
    data = [Example(tuple(range(3, 3 + n)), tuple([IGNORE] + list(range(4, 3 + n)))) for n in (8, 40)]
    eng = MultiLoraEngine(model, data, 0, gradient_checkpointing=True)
    seen = []
    eng.recompute_for = lambda tokens: seen.append(tokens) or tokens > 16
    eng.attach(TrainJob("j", lora_rank=4, batch_size=1, max_steps=4, seed=0))
    flags = []
    for _ in range(4):
        eng.step()
        flags.append(eng.gradient_checkpointing)
    assert sorted(set(seen)) == [8, 40] and flags == [t > 16 for t in seen]


def test_a_long_tasks_steps_keep_the_largest_and_the_latest() -> None:
    corr = OnlineCorrection(MemoryModel(1e9, 1e5), head_per_token=0.0, head_chunk=1, settle=2)
    res = 10**10
    for i in range(3 * MAX_POINTS):
        t = 9000 if i == 5 else 100 + (i * 37) % 4000
        corr.observe(t, True, res, int(res + corr.fixed(t, 0) + 9e4 * t + 1e8))
    assert len(corr._points) == MAX_POINTS and max(t for t, _, _ in corr._points) == 9000
    # the line found from them: the steps' 90 kB a token and 100 MB constant, with the margin
    assert corr.model.k1 == pytest.approx(9e4 * 1.05) and corr.extra == pytest.approx(1e8 * 1.05)


def test_a_step_that_one_pass_would_recompute_runs_as_passes_that_each_fit_without() -> None:
    from trainer.admission import MAX_PASSES, MIN_PASS_TOKENS, RecomputePolicy

    # room for (10e9 - 4e9 - 1e9) / (1e5 x 1.25) = 40,000 tokens a pass
    policy = RecomputePolicy(MemoryModel(1e9, 1e5), 10e9, 1024, resident=lambda: 4e9)
    assert policy.room_tokens() == pytest.approx(40_000)
    assert policy.passes([9000] * 4) is None  # 36k fits in one pass
    tokens = [30_000, 12_000, 25_000, 9_000, 14_000, 3_000]
    passes = policy.passes(tokens)
    assert passes is not None and len(passes) == 3  # 93k tokens: three passes of at most 40k
    assert sorted(i for p in passes for i in p) == list(range(len(tokens)))
    assert all(sum(tokens[i] for i in p) <= 40_000 for p in passes)
    assert policy.passes([41_000, 1_000]) is None  # a job alone does not fit: recompute
    many = [39_000] * (MAX_PASSES + 1)
    assert policy.passes(many) is None and policy.passes(many[:MAX_PASSES]) is not None
    tight = RecomputePolicy(MemoryModel(1e9, 1e5), 1e9 + 4e9 + 1.25e5 * (MIN_PASS_TOKENS - 1), 1024,
                            resident=lambda: 4e9)
    assert tight.passes([3000, 3000]) is None  # passes under MIN_PASS_TOKENS: recompute instead


def test_a_step_that_fits_without_recompute_only_once_the_device_parks_leave_sends_them_to_the_host() -> None:
    from trainer.admission import MIN_PASS_TOKENS, RecomputePolicy

    parked = [3e9]  # states parked on the device, counted resident

    def release() -> bool:
        moved.append(parked[0])
        parked[0] = 0.0
        return True

    moved: list[float] = []
    policy = RecomputePolicy(MemoryModel(1e9, 1e6), 20e9, 1024, resident=lambda: 10e9 + parked[0],
                             spare=lambda: parked[0], release=release)
    # room: (20e9 - 13e9 - 1e9) / 1.25e6 = 4,800 tokens; 7,200 without the parked states
    assert policy.room_tokens() == pytest.approx(4800) and policy.room_tokens(spare=True) == pytest.approx(7200)
    assert not policy.recompute_tokens(4000) and moved == []  # fits beside them: they stay
    assert policy.recompute_tokens(8000) and moved == []  # would not fit without them either: they stay
    assert policy.passes([3000, 3000, 3000]) is not None and moved == []  # 9k tokens: passes, they stay
    assert not policy.recompute_tokens(6000) and moved == [3e9]  # fits only without them: moved first
    assert policy.room_tokens() == pytest.approx(7200)
    parked[0] = 3e9
    assert policy.passes([3000, 3000]) is None and moved == [3e9, 3e9]  # one pass once they left
    parked[0] = 3e9
    # a step under MIN_PASS_TOKENS recomputes rather than send them off: room 2,400 tokens beside
    # them, 4,800 without
    small = RecomputePolicy(MemoryModel(1e9, 1e6), 17e9, 1024, resident=lambda: 10e9 + parked[0],
                            spare=lambda: parked[0], release=release)
    assert small.recompute_tokens(3000) and moved == [3e9, 3e9]  # they stay
    assert small.passes([1500, 1500]) is None and moved == [3e9, 3e9]  # recompute, they stay
    assert not small.recompute_tokens(MIN_PASS_TOKENS) and moved == [3e9, 3e9, 3e9]  # large enough: moved
    parked[0] = 3e9
    plain = RecomputePolicy(MemoryModel(1e9, 1e6), 20e9, 1024, resident=lambda: 10e9 + parked[0])
    assert plain.recompute_tokens(6000) and plain.passes([3000, 3000]) == [[0], [1]]  # nothing to move


def test_a_step_run_as_passes_equals_the_step_run_as_one(tmp_path) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    from tests.helpers.engine_ref import tiny_model_dir
    from trainer.data import IGNORE, Example
    from trainer.engine import MultiLoraEngine

    rng = torch.Generator().manual_seed(0)
    data = []
    for n in torch.randint(6, 30, (24,), generator=rng).tolist():
        ids = torch.randint(3, 200, (n,), generator=rng).tolist()
        data.append(Example(tuple(ids), tuple([IGNORE] * 2 + ids[2:])))
    results = []
    for split in (None, [[0, 2], [1, 3]]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", tmp_path), dtype=torch.float64)
        eng = MultiLoraEngine(model, data, 0, gradient_checkpointing=False, step_graphs=False)
        seen = []
        eng.split_for = lambda tokens, split=split, seen=seen: seen.append(tokens) or split
        layouts = []  # what each pass launches with: its job count, largest rank, rows per job
        set_layout = eng.slots.set_layout

        def recording(states, offsets, set_layout=set_layout, layouts=layouts, slots=eng.slots):  # noqa: ANN001, ANN202
            set_layout(states, offsets)
            lay = slots.layers[0].layout
            layouts.append((lay.ranks.numel(), lay.r_max, lay.offsets.diff().tolist(), [s.job_id for s in states]))

        eng.slots.set_layout = recording
        for i, (rank, lr) in enumerate([(4, 1e-2), (8, 3e-3), (2, 1e30), (4, 5e-3)]):  # job 2 diverges
            eng.attach(TrainJob(f"j{i}", lora_rank=rank, lora_alpha=2 * rank, learning_rate=lr, batch_size=2,
                                max_steps=3, seed=i))
        start = eng.jobs["j0"].adapter.flat.detach().clone()
        reports = [eng.step() for _ in range(3)]
        assert not torch.equal(start, eng.jobs["j0"].adapter.flat)  # trained
        results.append((reports, {j: s.adapter.flat.detach().clone() for j, s in eng.jobs.items()}, seen, layouts))
    (one, w1, seen1, lay1), (split, w2, seen2, lay2) = results
    # every pass launches the kernels with the whole step's 4 jobs and its largest rank (the
    # specializations one pass compiles), the other pass's jobs holding no rows
    assert len(lay1) == 3 and len(lay2) == 6
    assert all(n == 4 and r_max == 8 for n, r_max, _, _ in lay1 + lay2)
    for (_, _, rows, ids), members in zip(lay2, [[0, 2], [1, 3]] * 3, strict=True):
        assert [i for i, n in enumerate(rows) if n > 0] == members and len(ids) == 2
    assert seen1 == seen2 and len(seen1[0]) == 4  # each job's tokens, asked every step
    for a, b in zip(one, split, strict=True):
        assert a.pass_cells is None and len(b.pass_cells) == 2 and max(b.pass_cells) < a.tokens / (1 - a.padded_fraction)
        assert a.tokens == b.tokens and a.job_tokens == b.job_tokens and a.skipped == b.skipped
        for j in a.losses:
            assert a.losses[j] == pytest.approx(b.losses[j], rel=1e-12, nan_ok=True)
            assert a.grad_norms[j] == pytest.approx(b.grad_norms[j], rel=1e-10, nan_ok=True)
    for j in w1:
        torch.testing.assert_close(w1[j], w2[j], rtol=1e-10, atol=1e-12, equal_nan=True)


def test_the_slope_never_falls_under_its_floor_and_a_stored_slope_of_zero_is_not_reused(tmp_path) -> None:  # noqa: ANN001
    """Steps whose peaks read low at the largest token counts (a buffer resident at a step's start
    and freed during it) would settle the envelope to a slope of 0: admission would then take any
    batch. The slope keeps K1_FLOOR of its start; a stored model without a slope is built again."""
    from trainer.admission import load_profile, store_profile
    from trainer.memory_model import K1_FLOOR

    corr = OnlineCorrection(MemoryModel(1e9, 4e5), head_per_token=0.0, head_chunk=1, settle=3)
    res = 10**10
    for t, x in [(500, 6e8), (1000, 6e8), (4000, 5e8), (8000, 4e8)]:  # more tokens, less excess
        corr.observe(t, True, res, int(res + corr.fixed(t, 0) + x))
    assert envelope(corr._points)[1] == pytest.approx(0.0, abs=1.0)  # under a byte a token
    assert corr.model.k1 == pytest.approx(K1_FLOOR * 4e5) and corr.model.max_total_batch(2e10, 1024) > 0
    path = tmp_path / "profiles.json"
    store_profile(path, "k", MemoryModel(1e9, 0.0))
    assert load_profile(path, "k") is None
    store_profile(path, "k", MemoryModel(1e9, 3e5))
    assert load_profile(path, "k") == MemoryModel(1e9, 3e5)


def test_the_floor_is_the_built_models_and_a_floored_lowering_never_raises_a_prediction() -> None:
    """The floor comes from the model built from the config (`floor_of`), not from a stored start
    that an earlier task lowered, so it never halves task after task; where the envelope falls
    under it, the line is the floor's slope with the least constant above every step, and it
    lowers the model only where that predicts less."""
    from trainer.memory_model import K1_FLOOR

    res = 10**10
    stored = OnlineCorrection(MemoryModel(1e9, 1e5), head_per_token=0.0, head_chunk=1, settle=3, floor_of=8e5)
    for t in (1000, 1500, 2000):  # steps that need nothing per token
        stored.observe(t, True, res, int(res + stored.fixed(t, 0) + 1e8))
    assert stored.model.k1 >= K1_FLOOR * 8e5
    flat = OnlineCorrection(MemoryModel(1e9, 1e6), head_per_token=0.0, head_chunk=1, settle=3)
    before = flat.predict_transient(1000)
    for t in (1000, 1500, 2000):  # a flat 0.95 GB excess: the envelope's slope is 0
        flat.observe(t, True, res, int(res + flat.fixed(t, 0) + 9.5e8))
        assert flat.predict_transient(1000) <= before + 1  # never raised by a lowering
        for u in (1000, 1500, 2000):
            assert flat.extra + flat.model.k1 * u >= 9.5e8 - 1  # every step still covered
    assert flat.model.k1 == pytest.approx(K1_FLOOR * 1e6)


def test_the_mlp_rebuild_takes_downs_input_off_a_step_without_recompute_only() -> None:
    # trainer.fused_blocks.MLP_REBUILD: down_proj's input (the intermediate width a token and layer)
    # is rebuilt in the backward, not kept; a checkpointed step keeps what it kept
    from trainer.memory_model import ACT_BYTES, FUSED_ACTIVATION_SLACK, Shapes, per_token_bytes

    s = Shapes(hidden=4096, intermediate=14336, layers=32, kv=1024, vocab=128256, heads=32)
    kept = per_token_bytes(s, False, 7, 64, fused=True)
    rebuilt = per_token_bytes(s, False, 7, 64, fused=True, rebuild=True)
    assert kept - rebuilt == pytest.approx(s.layers * FUSED_ACTIVATION_SLACK * ACT_BYTES * s.intermediate)
    assert 0.75 < rebuilt / kept < 0.85  # about a fifth of an 8B step's activations
    assert per_token_bytes(s, True, 7, 64, fused=True, rebuild=True) == per_token_bytes(s, True, 7, 64, fused=True)


def test_a_steps_copy_of_the_arena_in_the_compute_dtype_is_counted(tmp_path) -> None:  # noqa: ANN001
    """Float32 adapters under a bfloat16 backbone: each step copies the whole arena (every job's
    region) into bfloat16 (AdapterArena.layout_arenas). Session 39's H200 search (a) left it out:
    its 48-job steps peaked above their prediction. Admission starts a step from what is resident
    plus that copy, each new job's state adds its share of it, the correction counts it as fixed."""
    import contextlib

    from transformers import AutoModelForCausalLM

    from tests.helpers.engine_ref import tiny_model_dir
    from trainer.config import ExecutorConfig
    from trainer.engine import MultiLoraEngine
    from trainer.memory_model import ARENA_SLACK, fixed_transient, state_bytes_per_param
    from trainer.memory_plan import MemoryPlan
    from trainer.sft import Sft
    from trainer.strategy import OneGpu

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", tmp_path), dtype=torch.bfloat16)
    eng = MultiLoraEngine(model, [], 0)
    cfg = ExecutorConfig(model_dir=str(tmp_path), train_file="", output_dir=str(tmp_path), jobs=[])
    plan = MemoryPlan(cfg, eng, torch.device("cpu"), Sft(), OneGpu(), lambda _n: contextlib.nullcontext(),
                      lambda _j: None)
    assert plan.copy_per_param == 2.0
    eng.attach(TrainJob("a", lora_rank=8, batch_size=1))
    arena = eng.slots.arena.numel()
    assert arena >= eng.params_per_rank * 8
    plan.resident_bytes = lambda: 1e9  # what the allocator holds (a GPU's)
    assert plan.step_resident() == pytest.approx(1e9 + 2.0 * arena)
    job = TrainJob("b", lora_rank=16, batch_size=1)
    assert plan.state_bytes(job) == pytest.approx(eng.params_per_rank * 16 * (3 * 4 + 4 + 2) * ARENA_SLACK)
    assert state_bytes_per_param(4, 2) - state_bytes_per_param(4) == pytest.approx(2 * ARENA_SLACK)
    # the correction: a step's fixed part holds the copy of the arena it had. A 1G-element arena's
    # step peaking 2 GB above the rest of the count: predicted as it came with the copy counted (the
    # model unchanged), under-predicted without it (the model raised to cover 2 GB it did not know)
    base = fixed_transient(0.0, 1, 10**9)
    peak = int(5e9 + base + 2e9 + 1e5 * 100)
    corr = OnlineCorrection(MemoryModel(1e9, 1e5), head_per_token=0.0, head_chunk=1, copy_per_param=2.0)
    assert not corr.observe(100, True, 5 * 10**9, peak, 10**9)
    assert corr.trace[-1].predicted == pytest.approx(peak) and corr.trace[-1].adapter_params == 10**9
    blind = OnlineCorrection(MemoryModel(1e9, 1e5), head_per_token=0.0, head_chunk=1)
    assert blind.observe(100, True, 5 * 10**9, peak, 10**9)
    assert blind.trace[-1].predicted < peak - 1.9e9
    # an arena in the compute dtype is read as it is: no copy
    same = MultiLoraEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", tmp_path / "b"),
                                                                dtype=torch.float32), [], 0)
    assert MemoryPlan(cfg, same, torch.device("cpu"), Sft(), OneGpu(), lambda _n: contextlib.nullcontext(),
                      lambda _j: None).copy_per_param == 0.0


def test_an_h200_searchs_steps_with_the_arenas_copy_counted() -> None:
    """Session 39's H200 search (a) (call 2, the code of this test): its warmup's 48-job steps
    with a 3.8G-element arena, then 12 to 1 jobs with 1.1G. Replayed from the analytic model the
    device started from (fused blocks and head, key/value unexpanded, no recompute), the
    arena's copy counted: every step within 8% (the device measured 3.4-7.0%), none under; the
    same steps with the copy left out of the count over-predict the later small steps more."""
    data = json.loads((Path(__file__).parent / "data" / "memory_trace_s39_h200.json").read_text())
    config = LlamaConfig(**data["model"])
    s = Shapes.of(config)

    def replay(copy: float) -> list[float]:
        mm = analytic_model(config, head_chunk=data["head_chunk"], max_rank=data["max_rank"],
                            n_targets=data["targets"], recompute=False, fused=True, fused_head=True,
                            kv_expanded=False)
        corr = OnlineCorrection(mm, head_bytes(s, 1, True), data["head_chunk"], floor_of=mm.k1, copy_per_param=copy)
        steps = data["steps"]
        for i, (cells, _, resident, peak, _, arena) in enumerate(steps):
            # what stayed allocated after a step, read from the next one's start (the first step's AdamW
            # moments for 48 jobs: 28 GB); the device read it at the step's end
            nxt = steps[i + 1][2] if i + 1 < len(steps) else resident
            after = nxt << 20 if nxt - resident > 256 else resident << 20
            corr.observe(cells, False, resident << 20, peak << 20, int(arena * 1e6), after)
        return [(p.predicted - p.peak) / p.peak for p in corr.trace]

    counted = replay(2.0)
    assert min(counted) >= 0 and max(counted) <= 0.08, counted
    assert max(replay(0.0)[8:]) > max(counted[8:])
