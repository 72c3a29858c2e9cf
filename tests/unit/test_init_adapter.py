"""A job started from an uploaded PEFT adapter (TrainJob.init_adapter) begins where PEFT's own
PeftModel.from_pretrained(base, adapter_dir) is: the same loss on the same batch at step 0."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine_ref import padded_batch, synthetic_rows, tiny_model_dir
from trainer.data import JobDataStream, parse_record, tokenize_all
from trainer.engine import MultiLoraEngine
from trainer.export import export_peft
from trainer.jobs import TrainJob
from trainer.multilora import JobAdapter

pytestmark = pytest.mark.usefixtures("one_thread")
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.mark.parametrize("targets", [TARGETS, None])
def test_job_from_adapter_starts_at_peft_loss(tmp_path, targets) -> None:  # noqa: ANN001
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tiny_model_dir("llama", tmp_path)
    tok = AutoTokenizer.from_pretrained(d)
    ex = tokenize_all(tok, [parse_record(r) for r in synthetic_rows(16, seed=3)], 48)
    base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    names = targets or sorted({n.rsplit(".", 1)[-1] for n, m in base.named_modules()
                               if isinstance(m, torch.nn.Linear) and n != "lm_head"})
    shapes = {n: (m.in_features, m.out_features) for n, m in base.named_modules()
              if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in names}
    src = JobAdapter(shapes, 4, 8.0, seed=3)
    with torch.no_grad():  # trained-looking weights (a fresh B is 0)
        src.flat.copy_(torch.randn(src.flat.shape, generator=torch.Generator().manual_seed(5)) * 0.05)
    out = export_peft(src, tmp_path / "a", names, str(d))

    eng = MultiLoraEngine(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), ex,
                          tok.pad_token_id)
    spec = TrainJob("j0", lora_rank=4, lora_alpha=8.0, learning_rate=1e-3, batch_size=2, seed=11, max_steps=3,
                   init_adapter=str(out))
    eng.attach(spec)
    loss0 = eng.step().losses["j0"]

    ref = PeftModel.from_pretrained(base, str(out)).eval()
    batch = padded_batch([ex[i] for i in JobDataStream(len(ex), spec.seed).next_indices(2)],
                         tok.pad_token_id)
    with torch.no_grad():
        want = float(ref(**batch, use_cache=False).loss)
        with ref.disable_adapter():
            plain = float(ref(**batch, use_cache=False).loss)
    assert abs(want - plain) > 1e-4  # the adapter moves the loss: a fresh start would not match
    assert abs(loss0 - want) < 2e-5, (loss0, want)
