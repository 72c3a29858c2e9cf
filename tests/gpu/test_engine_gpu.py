"""The engine on CUDA through the Triton kernels: jobs trained together match each trained alone
with PEFT, and a diverging job leaves the others finite and unchanged. Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir, train_alone_peft  # noqa: E402
from trainer.data import parse_record, tokenize_all  # noqa: E402
from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402

SPECS = [(2, 1e-3, 1), (8, 5e-3, 2), (16, 2e-3, 3)]


def _engine(model_dir, examples, tok, specs):  # noqa: ANN001, ANN202
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    eng = MultiLoraEngine(model, examples, tok.pad_token_id, backend="auto")
    for s in specs:
        eng.attach(s)
    return eng


def test_engine_matches_peft_on_cuda(tmp_path) -> None:
    from transformers import AutoTokenizer

    d = tiny_model_dir("llama", tmp_path)
    tok = AutoTokenizer.from_pretrained(d)
    ex = tokenize_all(tok, [parse_record(r) for r in synthetic_rows(30)], 64)
    specs = [TrainJob(f"j{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=lr, batch_size=b, seed=i, max_steps=8)
             for i, (r, lr, b) in enumerate(SPECS)]
    eng = _engine(d, ex, tok, specs)
    inits = {j: {k: v.detach().cpu().clone() for k, v in s.adapter.peft_state_dict().items()}
             for j, s in eng.jobs.items()}
    hist = {s.job_id: [] for s in specs}
    for _ in range(8):
        for j, v in eng.step().losses.items():
            hist[j].append(v)
    for s in specs:
        ref, w = train_alone_peft(d, s, inits[s.job_id], ex, 8, tok.pad_token_id)
        # Triton may use TF32 for fp32 dots: compare at TF32 tolerance
        assert max(abs(a - b) for a, b in zip(ref, hist[s.job_id], strict=True)) < 2e-2
        mine = eng.jobs[s.job_id].adapter.peft_state_dict()
        for k, v in w.items():
            assert torch.allclose(mine[k].cpu(), v, atol=2e-3, rtol=2e-2), k


def test_nan_job_does_not_touch_others_on_cuda(tmp_path) -> None:
    from transformers import AutoTokenizer

    d = tiny_model_dir("llama", tmp_path)
    tok = AutoTokenizer.from_pretrained(d)
    ex = tokenize_all(tok, [parse_record(r) for r in synthetic_rows(30)], 64)
    runs = {}
    # the healthy run twice: atomic adds in the kernels' weight-gradient sums may reorder float
    # additions between runs; the NaN run must differ from the healthy one by no more than that
    for name, bad_lr in (("healthy", 1e-3), ("healthy_again", 1e-3), ("nan", 1e30)):
        specs = [TrainJob(f"j{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=lr, batch_size=b, seed=i, max_steps=6)
                 for i, (r, lr, b) in enumerate(SPECS)]
        specs.append(TrainJob("bad", lora_rank=4, lora_alpha=8, learning_rate=bad_lr, batch_size=2, seed=9,
                             max_steps=6, max_grad_norm=None))
        eng = _engine(d, ex, tok, specs)
        skipped = 0
        for _ in range(6):
            skipped += eng.step().skipped["bad"]
        runs[name] = ({j: s.adapter.peft_state_dict() for j, s in eng.jobs.items()}, skipped)
    assert runs["nan"][1] > 0 and runs["healthy"][1] == 0
    healthy, again, nan = (runs[k][0] for k in ("healthy", "healthy_again", "nan"))
    noise = max(float((again[j][k] - healthy[j][k]).abs().max()) for j in ("j0", "j1", "j2")
                for k in healthy[j])
    for j in ("j0", "j1", "j2"):
        for k, v in healthy[j].items():
            w = nan[j][k]
            assert torch.isfinite(w).all()
            diff = float((w - v).abs().max())
            # one healthy repeat samples the float-order noise once; after 6 AdamW steps (which
            # normalise tiny gradient differences) another ordering can land a few times above
            # it. A leak from the 1e30-lr job would be non-finite or of the weights' own size.
            assert diff <= max(8 * noise, 1e-6 + 1e-4 * float(v.abs().max())), (j, k, diff, noise)
    print(f"nan isolation on cuda: run-to-run noise {noise:.3e}")


def test_adapter_init_is_drawn_on_the_device_and_reproducible() -> None:
    """A job's adapter on a GPU is drawn there (no host tensor), the same for the same seed,
    PEFT's init: A within kaiming_uniform(a=sqrt(5))'s bound 1/sqrt(d_in), B = 0."""
    import math

    from trainer.multilora import JobAdapter

    shapes = {"l0.q": (256, 256), "l0.down": (512, 256)}
    one = JobAdapter(shapes, 16, 32.0, seed=5, device="cuda")
    two = JobAdapter(shapes, 16, 32.0, seed=5, device="cuda")
    other = JobAdapter(shapes, 16, 32.0, seed=6, device="cuda")
    assert one.flat.device.type == "cuda"
    assert torch.equal(one.flat, two.flat) and not torch.equal(one.flat, other.flat)
    for (d_in, _), a, b in zip(one.shapes, one.lora_a, one.lora_b, strict=True):
        assert a.abs().max().item() <= 1 / math.sqrt(d_in) + 1e-7
        assert a.std().item() > 0.5 / math.sqrt(3 * d_in)  # drawn, not zeros
        assert not b.any()


def test_a_step_run_as_passes_matches_one_pass_through_the_kernels(tmp_path) -> None:
    # the search's 57k-token steps run as passes without recompute (engine.split_for): the first pass
    # zeroes the gradient arena, the later ones add their own jobs' regions through the Triton kernels.
    # One step's losses and gradient sums (Adam over several steps would magnify the kernels' atomic
    # reorderings of tiny gradients: the healthy-run-twice test above sees those too)
    from transformers import AutoTokenizer

    d = tiny_model_dir("llama", tmp_path)
    tok = AutoTokenizer.from_pretrained(d)
    ex = tokenize_all(tok, [parse_record(r) for r in synthetic_rows(30)], 64)
    runs = []
    for split in (None, [[0, 2], [1]]):
        specs = [TrainJob(f"j{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=lr, batch_size=b, seed=i,
                          max_steps=4) for i, (r, lr, b) in enumerate(SPECS)]
        eng = _engine(d, ex, tok, specs)
        eng.step_graphs = None
        eng.split_for = lambda tokens, split=split: split
        report = eng.step()
        grads = {j: eng.slots.grad_arena[slice(*eng.slots.regions[j])].detach().cpu().clone() for j in eng.jobs}
        runs.append((report, grads))
    (one, g1), (split, g2) = runs
    assert one.pass_cells is None and split.pass_cells is not None
    for j in g1:
        assert abs(one.losses[j] - split.losses[j]) < 1e-4 * max(1.0, abs(one.losses[j])), j
        assert g1[j].abs().sum() > 0 and g2[j].abs().sum() > 0, j  # the later pass's job kept its gradient
        assert (g1[j] - g2[j]).norm() <= 1e-3 * g1[j].norm(), j
