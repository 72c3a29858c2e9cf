"""Parking a job on the host from a GPU: the copies go into pinned memory without waiting (the
pool's, or pinned on the spot where the pool may not grow); the parked state, its checkpoint and
its resumed weights and moments equal the job's at the park, although the arena region it came
from is overwritten at once; a park that finds the pool empty grows it by a registered chunk.
Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir  # noqa: E402
from trainer.checkpoint import job_state_dict  # noqa: E402
from trainer.data import parse_record, tokenize_all  # noqa: E402
from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402


@pytest.mark.parametrize("pooled", [False, True])
def test_park_on_host_async_then_resume(tmp_path, monkeypatch, pooled: bool) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.host_pool import POOL

    if pooled:  # memory pinned ahead of time (trainer.host_pool): the park takes slices of it
        POOL.reserve(64 << 20)
        POOL.wait()
    else:  # a pool that may not grow: the park pins on its own (cudaHostAlloc), as past the limit
        monkeypatch.setattr(POOL, "grow_limit", POOL.pinned_bytes)
    served = POOL.served

    d = tiny_model_dir("llama", tmp_path)
    tok = AutoTokenizer.from_pretrained(d)
    ex = tokenize_all(tok, [parse_record(r) for r in synthetic_rows(30)], 64)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda()
    eng = MultiLoraEngine(model, ex, tok.pad_token_id, backend="auto")
    for i, r in enumerate((4, 8)):
        eng.attach(TrainJob(f"j{i}", lora_rank=r, lora_alpha=2 * r, learning_rate=1e-2, batch_size=2, seed=i, max_steps=6))
    for _ in range(3):
        eng.step()
    st = eng.jobs["j0"]
    want_w = st.adapter.flat.detach().clone()
    want_m = {k: v.clone() for k, v in st.optimizer.state[st.adapter.flat].items() if torch.is_tensor(v)}
    parked = eng.detach("j0", park_device="cpu")
    assert POOL.served - served == (3 if pooled else 0)  # the weights and both moments
    eng.slots.arena.fill_(3.0)  # queued after the park's copies: they read the region first
    assert parked.host_copy is not None  # not waited for yet
    ck = job_state_dict(parked)  # waits for them
    assert parked.host_copy is None
    w = parked.adapter.flat.detach()
    assert w.device.type == "cpu" and w.is_pinned()
    torch.testing.assert_close(w, want_w.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(ck["adapter"]["flat"], want_w.cpu(), rtol=0, atol=0)
    eng.step()  # j1 alone meanwhile
    eng.attach(parked)
    back = eng.jobs["j0"]
    torch.testing.assert_close(back.adapter.flat.detach(), want_w, rtol=0, atol=0)
    for k, v in back.optimizer.state[back.adapter.flat].items():
        if torch.is_tensor(v) and v.dim() > 0:
            assert v.is_cuda
            torch.testing.assert_close(v, want_m[k], rtol=0, atol=0)
    report = eng.step()
    assert all(torch.isfinite(torch.tensor(x)) for x in report.losses.values())
    POOL.release()


def test_a_park_into_an_empty_pool_grows_it_by_registered_memory(tmp_path) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer import host_pool
    from trainer.host_pool import POOL

    POOL.release()
    grown, served = POOL.grown, POOL.served
    d = tiny_model_dir("llama", tmp_path)
    tok = AutoTokenizer.from_pretrained(d)
    ex = tokenize_all(tok, [parse_record(r) for r in synthetic_rows(30)], 64)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda()
    eng = MultiLoraEngine(model, ex, tok.pad_token_id, backend="auto")
    eng.attach(TrainJob("j0", lora_rank=8, lora_alpha=16, learning_rate=1e-2, batch_size=2, seed=0, max_steps=6))
    eng.step()
    want = eng.jobs["j0"].adapter.flat.detach().clone()
    parked = eng.detach("j0", park_device="cpu")
    parked.settle()
    assert POOL.grown == grown + 1 and POOL.served == served + 3
    ptr = parked.adapter.flat.data_ptr()
    chunk = next(c for c in POOL._chunks if c.data_ptr() <= ptr < c.data_ptr() + c.numel())  # a pool slice
    assert parked.adapter.flat.is_pinned() and chunk.data_ptr() in host_pool._REGISTERED  # registered
    torch.testing.assert_close(parked.adapter.flat, want.cpu(), rtol=0, atol=0)
