"""Packed steps in bucketed shapes (trainer.packing.pack_step with ShapeBuckets) and the engine's
batched update (trainer.jobs.multi_adamw), on CPU: the layout is exact (every sequence once,
positions restarting, pure-padding rows only after the last job's), the step's loss and gradients
equal those of the same samples run unpacked one per row (float64, SFT and DPO), and the update
of all jobs at once equals torch's AdamW job by job, bit for bit."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir
from trainer.data import IGNORE, Example, parse_record, tokenize_all
from trainer.dpo import DpoEngine
from trainer.engine import MultiLoraEngine
from trainer.jobs import TrainJob, multi_adamw
from trainer.packing import ShapeBuckets, bucket_up, pack_step
from trainer.pairs import tokenize_pairs

pytestmark = pytest.mark.usefixtures("one_thread")

# coarse buckets: pure-padding rows and several sequences per row in the tiny steps below
COARSE = ShapeBuckets(length_per_octave=2, rows_per_octave=2, min_length=32)


def random_examples(rng: random.Random, n: int, lo: int, hi: int) -> list[Example]:
    out = []
    for _ in range(n):
        ids = tuple(rng.randrange(4, 300) for _ in range(rng.randint(lo, hi)))
        cut = rng.randint(0, len(ids) - 2)
        out.append(Example(ids, (IGNORE,) * cut + ids[cut:]))
    return out


def test_bucket_sizes() -> None:
    assert [bucket_up(n, 4) for n in (1, 5, 8, 9, 11, 17, 88, 96, 97)] == [1, 5, 8, 10, 12, 20, 96, 96, 112]
    for per in (1, 2, 4, 8):
        sizes = {bucket_up(n, per) for n in range(1, 5000)}
        for n in range(1, 5000):
            b = bucket_up(n, per)
            assert n <= b < n * (1 + 1 / per) + 1 and bucket_up(b, per) == b
        assert len([s for s in sizes if 1024 <= s < 2048]) == per  # `per` sizes per doubling
    assert ShapeBuckets().lengths(100, 2048) == [128, 192, 256, 384, 512, 768, 1024, 1536, 2048]


@pytest.mark.parametrize("seed", range(6))
def test_bucketed_layout_is_exact(seed: int) -> None:
    rng = random.Random(seed)
    per_job = [random_examples(rng, rng.choice((1, 2, 3, 7, 16)), 3, rng.choice((20, 90, 300)))
               for _ in range(rng.randint(1, 6))]
    buckets = [COARSE, ShapeBuckets()][seed % 2]
    longest = max(len(e.input_ids) for s in per_job for e in s)
    cap = sum(map(len, per_job)) * max(longest, buckets.min_length)
    b = pack_step(per_job, pad_id=0, buckets=buckets, max_cells=cap)
    rows, length = b.input_ids.shape
    assert length == buckets.length(length) >= longest and rows * length <= cap
    assert rows == buckets.rows(rows) or buckets.rows(rows) * length > cap  # as packed at the cap
    assert b.row_offsets[0] == 0 and b.row_offsets[-1] == rows and len(b.row_offsets) == len(per_job) + 1
    assert b.real_tokens == sum(len(e.input_ids) for s in per_job for e in s)
    flat = [e for s in per_job for e in s]
    seen = set()
    for r in range(rows):
        job = max(j for j in range(len(per_job)) if b.row_offsets[j] <= r)
        c = 0
        while c < length and int(b.seq_index[r, c]) >= 0:
            k = int(b.seq_index[r, c])
            ex, n = flat[k], len(flat[k].input_ids)
            assert k not in seen and sum(map(len, per_job[:job])) <= k < sum(map(len, per_job[: job + 1]))
            seen.add(k)  # a sequence is contiguous, in its own job's rows, positions from 0
            assert b.input_ids[r, c : c + n].tolist() == list(ex.input_ids)
            assert b.position_ids[r, c : c + n].tolist() == list(range(n))
            assert b.targets[r, c : c + n].tolist() == [*ex.labels[1:], IGNORE]
            c += n
        # then only padding: its own block (positions from 0), nothing trained
        assert (b.seq_index[r, c:] == -1).all() and (b.input_ids[r, c:] == 0).all()
        assert b.position_ids[r, c:].tolist() == list(range(length - c)) and (b.targets[r, c:] == IGNORE).all()
    assert seen == set(range(len(flat)))
    # unpacked: one sequence per row, positions running on through the padding (plain causal)
    u = pack_step(per_job, pad_id=0, pack=False)
    assert u.input_ids.shape[0] == len(flat)
    assert (u.position_ids == torch.arange(u.input_ids.shape[1])).all()


def test_bucketed_shapes_stay_within_admitted_cells() -> None:
    # 5 sequences of 48: free to, one row of 256 holds them in the fewest cells; admitted for
    # 5 x 48 cells, 5 rows of 48 (the row bucket, 6, would exceed it)
    per_job = [[Example(tuple(range(4, 52)), tuple(range(4, 52)))] * 5]
    assert tuple(pack_step(per_job, 0, buckets=COARSE).input_ids.shape) == (1, 256)
    b = pack_step(per_job, 0, buckets=COARSE, max_cells=5 * 48)
    assert tuple(b.input_ids.shape) == (5, 48)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN201
    return tiny_model_dir("llama", tmp_path_factory.mktemp("packing"))


def engine(cls, model_dir, examples, pad_id: int, pack: bool, attention: str = "rows"):  # noqa: ANN001, ANN201
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    return cls(model, examples, pad_id, adapter_dtype=torch.float64, pack=pack, shape_buckets=COARSE,
               attention=attention)


def step_and_grads(eng: MultiLoraEngine):  # noqa: ANN201
    rep = eng.step()
    grads = {j: eng.slots.grad_arena[slice(*eng.slots.regions[j])].clone() for j in eng.jobs}
    return rep, grads


def compare_packed_with_unpacked(cls, model_dir, examples, pad_id: int, jobs: list[TrainJob],  # noqa: ANN001
                                 prepare=None, steps: int = 3, attention: str = "rows") -> None:  # noqa: ANN001
    engines = {pack: engine(cls, model_dir, examples, pad_id, pack, attention if pack else "rows")
               for pack in (True, False)}
    for eng in engines.values():
        for spec in jobs:
            eng.attach(copy.deepcopy(spec))
        if prepare is not None:
            prepare(eng)
    packed, plain = engines[True], engines[False]
    pad_rows = []
    for _ in range(steps):
        per_job = [[packed.train_examples[i] for i in copy.deepcopy(s.stream).next_indices(s.batch_size)]
                   for s in packed.jobs.values()]
        if cls is DpoEngine:
            per_job = [[e for p in pairs for e in (p.chosen, p.rejected)] for pairs in per_job]
        layout = packed.pack_batch(per_job)
        if attention == "varlen":  # one row, every job's sequences, a padding tail
            assert layout.input_ids.shape[0] == 1 and len(layout.cu_seqlens) >= len(per_job) + 1
            pad_rows.append(layout.cu_seqlens[-1] > layout.real_tokens)
            rep_a, grads_a = step_and_grads(packed)
            rep_b, grads_b = step_and_grads(plain)
            check_step(packed, rep_a, rep_b, grads_a, grads_b)
            continue
        multi = [(layout.seq_index[r] >= 0).any() and len(set(layout.seq_index[r].tolist()) - {-1}) > 1
                 for r in range(layout.input_ids.shape[0])]
        assert any(multi), "some row must hold several sequences"
        pad_rows.append(bool((layout.seq_index[layout.row_offsets[-2]:] == -1).all(dim=1).any()))
        rep_a, grads_a = step_and_grads(packed)
        rep_b, grads_b = step_and_grads(plain)
        check_step(packed, rep_a, rep_b, grads_a, grads_b)
    assert any(pad_rows), "a step with padding cells after the last job's (the bucket)"
    for j in packed.jobs:
        torch.testing.assert_close(packed.jobs[j].adapter.flat, plain.jobs[j].adapter.flat, rtol=1e-9, atol=1e-12)
    # evaluation packs the same way: the same held-out numbers
    held_out = list(examples[-6:])
    got, want = packed.evaluate_metrics(held_out, batch_size=3), plain.evaluate_metrics(held_out, batch_size=3)
    for j in packed.jobs:
        for k, v in want[j].items():
            assert got[j][k] == pytest.approx(v, rel=1e-10, abs=1e-12)


def check_step(packed, rep_a, rep_b, grads_a, grads_b) -> None:  # noqa: ANN001
    for j in packed.jobs:
        assert rep_a.losses[j] == pytest.approx(rep_b.losses[j], rel=1e-11, abs=1e-13)
        assert rep_a.grad_norms[j] == pytest.approx(rep_b.grad_norms[j], rel=1e-10)
        assert grads_a[j].abs().max() > 0
        torch.testing.assert_close(grads_a[j], grads_b[j], rtol=1e-9, atol=1e-13)
        for k, v in rep_a.metrics.get(j, {}).items():
            assert v == pytest.approx(rep_b.metrics[j][k], rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("attention", ["rows", "varlen"])
def test_packed_sft_step_equals_unpacked_rows(model_dir, attention: str) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = tokenize_all(tok, [parse_record(r) for r in synthetic_rows(40, seed=5)], 48)
    jobs = [TrainJob(f"j{i}", lora_rank=r, lora_alpha=2.0 * r, learning_rate=1e-2, batch_size=b, seed=20 + i, max_steps=4)
            for i, (r, b) in enumerate([(2, 1), (4, 5), (8, 11)])]
    compare_packed_with_unpacked(MultiLoraEngine, model_dir, examples, tok.pad_token_id, jobs,
                                 attention=attention)


@pytest.mark.parametrize("attention", ["rows", "varlen"])
def test_packed_dpo_step_equals_unpacked_rows(model_dir, attention: str) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    from tests.unit.test_dpo import preference_rows, randomize_b

    tok = AutoTokenizer.from_pretrained(model_dir)
    pairs = tokenize_pairs(tok, [parse_record(r) for r in preference_rows(30, seed=3)], 40)
    jobs = [TrainJob(f"d{i}", lora_rank=r, lora_alpha=2.0 * r, learning_rate=1e-2, batch_size=b, beta=beta, seed=30 + i,
                    max_steps=4, max_grad_norm=None)
            for i, (r, b, beta) in enumerate([(2, 1, 0.1), (4, 3, 0.5), (8, 6, 2.0)])]
    compare_packed_with_unpacked(DpoEngine, model_dir, pairs, tok.pad_token_id, jobs, prepare=randomize_b,
                                 attention=attention)


@pytest.mark.parametrize("chunk", [None, 800])
def test_multi_adamw_equals_torch_adamw_job_by_job_bit_for_bit(chunk, monkeypatch) -> None:  # noqa: ANN001
    if chunk is not None:  # groups of at most 800 elements (the 1000-element job alone): the same
        monkeypatch.setattr("trainer.jobs.ADAMW_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    hyper = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
             dict(lr=3e-4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
             dict(lr=1.0, betas=(0.5, 0.9), eps=1e-3, weight_decay=0.01)]
    mine = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (5, 1000, 77)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    opts = [torch.optim.AdamW([p], foreach=False, **h) for p, h in zip(mine, hyper, strict=True)]
    refs = [torch.optim.AdamW([p], foreach=False, **h) for p, h in zip(ref, hyper, strict=True)]
    for step in range(5):
        grads = [torch.randn(p.shape, generator=g) * 10 ** (step - 2) for p in mine]
        # not every job steps every time (a skipped job's state stays as it was)
        run = [i for i in range(3) if (i + step) % 4]
        multi_adamw([opts[i] for i in run], [mine[i] for i in run], [grads[i] for i in run])
        for i in run:
            ref[i].grad = grads[i].clone()
            refs[i].step()
        for i in range(3):
            assert torch.equal(mine[i], ref[i])
            for k, v in refs[i].state[ref[i]].items():
                assert torch.equal(opts[i].state[mine[i]][k], v)
    # the state round-trips through torch's state_dict (the checkpoint format)
    fresh = torch.optim.AdamW([torch.nn.Parameter(mine[1].detach().clone())], **hyper[1])
    fresh.load_state_dict(opts[1].state_dict())
    assert torch.equal(next(iter(fresh.state.values()))["exp_avg"], opts[1].state[mine[1]]["exp_avg"])


def test_varlen_nan_job_in_the_same_row_leaves_other_jobs_bit_identical(model_dir) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = tokenize_all(tok, [parse_record(r) for r in synthetic_rows(30, seed=6)], 48)
    runs = []
    for poison in (False, True):
        eng = engine(MultiLoraEngine, model_dir, examples, tok.pad_token_id, True, "varlen")
        for i, b in enumerate((2, 3)):
            eng.attach(TrainJob(f"j{i}", lora_rank=4, lora_alpha=8, learning_rate=1e-2, batch_size=b, seed=i, max_steps=3))
        eng.attach(TrainJob("bad", lora_rank=2, lora_alpha=4, learning_rate=1e-2, batch_size=2, seed=9, max_steps=3))
        if poison:
            with torch.no_grad():
                eng.jobs["bad"].adapter.lora_a[0].fill_(float("nan"))
        runs.append((eng, [eng.step() for _ in range(3)]))
    (sane, r_sane), (broken, r_broken) = runs
    assert all(r.skipped["bad"] for r in r_broken) and not any(r.skipped["bad"] for r in r_sane)
    for j in ("j0", "j1"):
        assert [r.losses[j] for r in r_sane] == [r.losses[j] for r in r_broken]
        assert torch.equal(sane.jobs[j].adapter.flat, broken.jobs[j].adapter.flat)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash varlen attention needs CUDA")
def test_flash_varlen_attention_equals_causal_attention_per_sequence() -> None:
    from trainer.varlen import _per_sequence, varlen_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    bounds = [0, 7, 130, 131, 600, 1024]  # a 1-token sequence, uneven lengths, GQA 8/2 heads
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    leaves = [torch.randn(1, h, 1024, 64, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
              for h in (8, 2, 2)]
    refs = [t.detach().float().requires_grad_(True) for t in leaves]
    out, _ = varlen_attention(None, *leaves, None, scaling=0.125, cu_seq_lens_q=cu, max_length_q=469)
    ref = _per_sequence(*refs, bounds, 0.125)
    grad = torch.randn(ref.shape, device="cuda", generator=g)
    out.backward(grad.to(out.dtype))
    ref.backward(grad)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b).norm() / b.norm())

    assert rel(out, ref) < 1e-2
    for t, r in zip(leaves, refs, strict=True):
        assert rel(t.grad, r.grad) < 2e-2
