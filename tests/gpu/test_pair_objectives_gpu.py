"""The pair objectives on CUDA: DPO's and ORPO's loss of a step (the objective's `losses`, what a
CUDA-graph capture would run) never waits for the device, and ORPO trains on the GPU."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from tests.helpers.engine_ref import tiny_model_dir  # noqa: E402
from tests.unit.test_orpo import preference_rows  # noqa: E402
from trainer.data import parse_record  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402
from trainer.objectives import objective_for  # noqa: E402
from trainer.pairs import tokenize_pairs  # noqa: E402


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_pair_loss_never_syncs_and_trains(method: str, tmp_path) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tiny_model_dir("llama", tmp_path)
    tok = AutoTokenizer.from_pretrained(d)
    pairs = tokenize_pairs(tok, [parse_record(r) for r in preference_rows(16, seed=5)], 40)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda()
    eng = objective_for(method).engine_class(model, pairs, tok.pad_token_id)
    # the product's attention on CUDA (attention "auto"): in "rows" mode the model's own mask code
    # reads the device (transformers' packed-sequence check), and a step is never captured there
    eng.set_attention("varlen")
    for i, b in enumerate((2, 4)):
        eng.attach(TrainJob(f"j{i}", lora_rank=4, lora_alpha=8, learning_rate=1e-2, batch_size=b, seed=i,
                            max_steps=20, epochs=20))
    first = eng.step()
    states = list(eng.jobs.values())
    per_job = [pairs[: s.spec.batch_size] for s in states]
    eng.objective.prepare(eng, per_job)  # DPO: its reference pass (a host read) comes before
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _, losses, numbers = eng.objective.losses(eng, states, per_job)
        torch.stack(losses).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        eng.slots.clear_layout()
    assert len(numbers) == 2 and all(n.shape == (3,) for n in numbers)
    for _ in range(15):
        last = eng.step()
    assert all(math.isfinite(v) and v < first.losses[j] for j, v in last.losses.items()), (first.losses, last.losses)
