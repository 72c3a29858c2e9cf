"""The multi-LoRA engine on CPU against single-job PEFT runs (tiny random Llama and Qwen2):
equivalence, NaN isolation, attach/detach, resume from a checkpoint, and the PEFT export."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir, train_alone_peft
from trainer.checkpoint import job_state_dict, restore_job
from trainer.checkpoint_files import load_checkpoint, save_checkpoint
from trainer.data import parse_record, tokenize_all
from trainer.engine import MultiLoraEngine
from trainer.export import export_peft
from trainer.jobs import TrainJob, lr_factor

# 4 jobs: different ranks, learning rates, batch sizes (and warmup/schedules)
SPECS = [(2, 1e-3, 1, "linear"), (4, 5e-3, 2, "cosine"), (8, 2e-3, 3, "constant"), (16, 1e-2, 4, "linear")]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory):  # noqa: ANN201
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("engine")
    out = {}
    for fam in ("llama", "qwen2", "mistral"):
        d = tiny_model_dir(fam, root)
        tok = AutoTokenizer.from_pretrained(d)
        ex = tokenize_all(tok, [parse_record(r) for r in synthetic_rows(40, seed=3)], 48)
        out[fam] = (d, tok, ex)
    return out


def specs(steps: int = 20) -> list[TrainJob]:
    return [TrainJob(f"j{i}", lora_rank=r, lora_alpha=2.0 * r, learning_rate=lr, batch_size=b, schedule=sch, warmup_steps=3,
                    seed=10 + i, max_steps=steps) for i, (r, lr, b, sch) in enumerate(SPECS)]


def make_engine(world, fam: str = "llama") -> MultiLoraEngine:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    d, tok, ex = world[fam]
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    return MultiLoraEngine(model, ex, tok.pad_token_id)


def run_steps(eng: MultiLoraEngine, n: int, hist: dict[str, list[float]]) -> None:
    for _ in range(n):
        for j, v in eng.step().losses.items():
            hist.setdefault(j, []).append(v)


@pytest.mark.parametrize("fam", ["llama", "qwen2"])
def test_jobs_trained_together_equal_each_trained_alone_with_peft(world, fam) -> None:  # noqa: ANN001
    d, tok, ex = world[fam]
    eng = make_engine(world, fam)
    inits = {}
    for s in specs():
        st = eng.attach(s)
        inits[s.job_id] = {k: v.clone() for k, v in st.adapter.peft_state_dict().items()}
    hist: dict[str, list[float]] = {}
    pads = []
    for _ in range(20):
        rep = eng.step()
        pads.append(rep.padded_fraction)
        for j, v in rep.losses.items():
            hist.setdefault(j, []).append(v)
    assert max(pads) < 0.5  # packing keeps padding well below one-sequence-per-row
    for s in specs():
        ref_losses, ref_w = train_alone_peft(d, s, inits[s.job_id], ex, 20, tok.pad_token_id)
        assert len(hist[s.job_id]) == 20
        assert ref_losses[-1] != ref_losses[0]  # it trained
        assert max(abs(a - b) for a, b in zip(ref_losses, hist[s.job_id], strict=True)) < 2e-5
        mine = eng.jobs[s.job_id].adapter.peft_state_dict()
        assert set(mine) == set(ref_w) and len(mine) == 2 * 7 * 2
        for k, v in ref_w.items():
            # AdamW normalises each element's step, so an element whose gradient is near zero
            # carries float32 rounding of the two paths up to a few 1e-5 after 20 steps (seen
            # with transformers 5.24): the whole tensor agrees to 1e-4 in norm
            assert ((mine[k] - v).norm() / v.norm().clamp(min=1e-12)).item() < 1e-4, k
            torch.testing.assert_close(mine[k], v, atol=1e-4, rtol=1e-3)
        assert any(v.abs().max() > 0 for k, v in mine.items() if "lora_B" in k)


def test_nan_job_leaves_other_jobs_bit_identical(world) -> None:  # noqa: ANN001
    runs = {}
    for bad_lr in (1e-3, 1e30):
        eng = make_engine(world)
        for s in specs(8)[:3]:
            eng.attach(s)
        eng.attach(TrainJob("bad", lora_rank=4, lora_alpha=8, learning_rate=bad_lr, batch_size=2, seed=9, max_steps=8,
                           max_grad_norm=None))
        reports = [eng.step() for _ in range(8)]
        runs[bad_lr] = (eng, reports)
    sane, broken = runs[1e-3], runs[1e30]
    assert not any(r.skipped["bad"] for r in sane[1])
    assert any(math.isnan(r.losses["bad"]) and r.skipped["bad"] for r in broken[1])
    assert broken[0].jobs["bad"].skipped_steps > 0
    for j in ("j0", "j1", "j2"):
        assert [r.losses[j] for r in sane[1]] == [r.losses[j] for r in broken[1]]
        a = sane[0].jobs[j].adapter.state_dict()
        b = broken[0].jobs[j].adapter.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    # and a job with a finite loss but a non-finite gradient is skipped without touching others
    eng = make_engine(world)
    for s in specs(3)[:2]:
        eng.attach(s)
    before = eng.jobs["j1"].adapter.lora_a[0].clone()
    with torch.no_grad():
        eng.jobs["j1"].adapter.lora_b[0].fill_(float("inf"))
    rep = eng.step()
    assert rep.skipped["j1"] and not rep.skipped["j0"] and math.isfinite(rep.losses["j0"])
    assert torch.equal(eng.jobs["j1"].adapter.lora_a[0], before)


def test_attach_detach_and_resume_match_uninterrupted_run(world, tmp_path) -> None:  # noqa: ANN001
    sp = {s.job_id: s for s in specs(12)}
    # uninterrupted: all four together from step 0
    eng = make_engine(world)
    for s in sp.values():
        eng.attach(s)
    ref: dict[str, list[float]] = {}
    run_steps(eng, 12, ref)
    ref_w = {j: s.adapter.state_dict() for j, s in eng.jobs.items()}

    # interrupted: j2 attaches late, j1 is parked to CPU and comes back, and the executor is
    # "killed" at some point and resumed from a checkpoint on a fresh model
    eng = make_engine(world)
    got: dict[str, list[float]] = {}
    for j in ("j0", "j1", "j3"):
        eng.attach(sp[j])
    run_steps(eng, 3, got)
    eng.attach(sp["j2"])
    run_steps(eng, 2, got)
    parked = eng.detach("j1", park_device="cpu")
    run_steps(eng, 2, got)
    eng.attach(parked)
    run_steps(eng, 2, got)
    path = save_checkpoint(tmp_path / "state.pt", {"jobs": [job_state_dict(s) for s in eng.jobs.values()]})
    del eng
    eng = make_engine(world)
    for d in load_checkpoint(path)["jobs"]:
        eng.attach(restore_job(eng, d))
    while any(not s.done for s in eng.jobs.values()):
        run_steps(eng, 1, got)
    for j in sp:
        assert len(got[j]) == 12
        torch.testing.assert_close(torch.tensor(got[j]), torch.tensor(ref[j]), atol=1e-6, rtol=1e-6)
        w = eng.jobs[j].adapter.state_dict()
        for k in w:
            torch.testing.assert_close(w[k], ref_w[j][k], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fam", ["llama", "qwen2", "mistral"])
def test_export_loads_in_peft_with_same_logits(world, tmp_path, fam) -> None:  # noqa: ANN001
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    d, tok, ex = world[fam]
    eng = make_engine(world, fam)
    for s in specs(4)[1:3]:
        eng.attach(s)
    run_steps(eng, 4, {})
    together = eng.evaluate(ex[:6], batch_size=3)
    grouped = eng.evaluate(ex[:6], batch_size=3, max_sequences=3)  # one job per forward
    assert set(together) == {"j1", "j2"} and together["j1"] != together["j2"]
    for j in together:
        assert together[j] == pytest.approx(grouped[j], rel=1e-6)
    ids = torch.tensor([list(ex[0].input_ids[:20]), list(ex[1].input_ids[:20])])
    for j in ("j1", "j2"):
        out = export_peft(eng.jobs[j].adapter, tmp_path / j, list(eng.targets), str(d))
        base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        plain = base(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(base, out).eval()
        with torch.no_grad():
            theirs = peft_model(input_ids=ids).logits
        mine = eng.evaluation.logits(j, ids)
        assert (mine - plain).abs().max() > 1e-4  # the adapter changes the logits
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_lr_schedule_shapes() -> None:
    assert lr_factor(0, 4, 20) == 0.0 and lr_factor(2, 4, 20) == 0.5 and lr_factor(4, 4, 20) == 1.0
    assert lr_factor(20, 4, 20) == 0.0 and lr_factor(12, 4, 20) == pytest.approx(0.5)
    assert lr_factor(12, 4, 20, "cosine") == pytest.approx(0.5)
    assert lr_factor(19, 0, 20, "constant") == 1.0
    with pytest.raises(ValueError):
        lr_factor(5, 0, 10, "bogus")


def test_arena_regions_views_growth_and_parking(world) -> None:  # noqa: ANN001
    """Attached jobs' weights are disjoint views of the engine's arena; growth keeps every weight;
    a detached job owns its storage again; its freed region is reused first."""
    eng = make_engine(world)
    sp = specs(4)

    def check() -> None:
        spans = sorted(eng.slots.regions.values())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
        base, size = eng.slots.arena.data_ptr(), eng.slots.arena.numel() * eng.slots.arena.element_size()
        for j, (lo, hi) in eng.slots.regions.items():
            flat = eng.jobs[j].adapter.flat
            assert flat.data_ptr() == base + lo * eng.slots.arena.element_size() and flat.numel() == hi - lo
            assert base <= flat.data_ptr() < base + size

    eng.attach(sp[0])
    eng.attach(sp[1])
    check()
    # a step's layout says whether every block offset is 16-element aligned (the fused kernels'
    # vector loads rely on it), from the offsets the layers really get
    eng.slots.set_layout([eng.jobs["j0"], eng.jobs["j1"]], [0, 0, 0])
    offs = [v for layer in eng.layer_list for v in torch.cat([layer.a_off, layer.b_off]).tolist()]
    assert eng.layer_list[0].layout.aligned == all(v % 16 == 0 for v in offs)
    eng.slots.clear_layout()
    before = {j: s.adapter.flat.detach().clone() for j, s in eng.jobs.items()}
    cap = eng.slots.arena.numel()
    eng.attach(sp[3])  # rank 16: does not fit, the arena grows
    assert eng.slots.arena.numel() > cap
    check()
    for j, w in before.items():
        assert torch.equal(eng.jobs[j].adapter.flat.detach(), w)
    eng.step()
    lo0 = eng.slots.regions["j0"][0]
    parked = eng.detach("j0")
    kept = parked.adapter.flat.detach().clone()
    eng.slots.arena.fill_(7.0)  # the arena is not the parked job's storage any more
    assert torch.equal(parked.adapter.flat.detach(), kept)
    eng.attach(sp[2].__class__(**{**sp[2].__dict__, "lora_rank": 2}))  # smaller: fits j0's old gap
    assert eng.slots.regions["j2"][0] == lo0
    check()
    kept1 = eng.jobs["j1"].adapter.flat.detach().clone()
    on_host = eng.detach("j1", park_device="cpu")  # parked on the host: its own storage too
    eng.slots.arena.fill_(9.0)
    assert torch.equal(on_host.adapter.flat.detach(), kept1)
    eng.attach(on_host)
    assert torch.equal(eng.jobs["j1"].adapter.flat.detach(), kept1)
    check()


def test_a_checkpoint_written_before_train_job_took_the_contracts_names_still_loads(tmp_path) -> None:  # noqa: ANN001
    """A task paused across an upgrade: its state.pt pickles queued jobs as trainer.jobs.JobSpec
    with the fields rank, alpha, lr, and job states' specs as dicts of those names."""
    import dataclasses

    from trainer import jobs as jobs_mod
    from trainer.checkpoint import spec_from_dict
    from trainer.checkpoint_files import load_checkpoint, save_checkpoint

    @dataclasses.dataclass
    class JobSpec:  # the class as it was, under its old module and name
        job_id: str
        rank: int
        alpha: float
        lr: float
        batch_size: int

    JobSpec.__module__, JobSpec.__qualname__ = "trainer.jobs", "JobSpec"
    jobs_mod.JobSpec = JobSpec
    try:
        save_checkpoint(tmp_path / "state.pt", {"queue": [{"fresh": JobSpec("q", 8, 16.0, 2e-4, 2)}]})
    finally:
        del jobs_mod.JobSpec
    fresh = load_checkpoint(tmp_path / "state.pt")["queue"][0]["fresh"]
    assert isinstance(fresh, jobs_mod.TrainJob)
    assert (fresh.job_id, fresh.lora_rank, fresh.lora_alpha, fresh.learning_rate, fresh.batch_size) == \
        ("q", 8, 16.0, 2e-4, 2)
    old = spec_from_dict({"job_id": "a", "rank": 4, "alpha": 8.0, "lr": 1e-3, "batch_size": 1})
    assert (old.lora_rank, old.lora_alpha, old.learning_rate) == (4, 8.0, 1e-3)


def test_a_waiting_job_parks_on_the_device_only_while_its_reserve_stays_free(world) -> None:  # noqa: ANN001
    from trainer.arena import PARK_RESERVE, park_target, state_bytes

    gib = 1 << 30
    assert park_target(2 * gib, 30 * gib, 80 * gib) is None  # 28 GiB left: above 15% of 80
    assert park_target(2 * gib, 13 * gib, 80 * gib) == "cpu"  # 11 GiB left: under 12 GiB
    assert park_target(0, int(PARK_RESERVE * 80 * gib), 80 * gib) is None
    d, tok, ex = world["llama"]
    from transformers import AutoModelForCausalLM

    eng = MultiLoraEngine(AutoModelForCausalLM.from_pretrained(d), ex, tok.pad_token_id)
    s = eng.attach(TrainJob("p", lora_rank=4, lora_alpha=8, batch_size=2, max_steps=3))
    before = state_bytes(s)
    assert before == s.adapter.flat.numel() * 4  # no optimizer moments before the first step
    eng.step()
    assert state_bytes(s) == 3 * before  # the adapter and AdamW's two moments
    assert eng.slots.park_target("p") == "cpu"  # a CPU engine has no device memory to park in


def test_the_park_reserve_is_read_from_the_environment_and_refused_outside_0_to_1() -> None:
    from trainer.arena import DEFAULT_PARK_RESERVE, _park_reserve

    assert _park_reserve(None) == _park_reserve("") == DEFAULT_PARK_RESERVE == 0.15
    assert _park_reserve("0.5") == 0.5 and _park_reserve("0") == 0.0
    for bad in ("1", "-0.1", "half", "nan"):
        with pytest.raises(ValueError, match="LORAPLEX_PARK_RESERVE"):
            _park_reserve(bad)
