"""GPU: the one-GPU SFT default (varlen attention, bf16, flash kernel) on the windowed and
soft-capped families and on those whose layers drop the sequence bounds. The engine trains a job
on CUDA; its validation loss is the model's own loss (PEFT on the exported adapter, float32,
eager, one unpadded row per example), and every attention call took the path the layer needs:
the flash kernel with the layer's own window, the exact per-sequence path under a soft-cap.
(The loss alone cannot show the window: on these tiny models it moves the mean loss by 0.1-1%,
about bf16's error; which window each call got can.) Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("peft")

from tests.helpers.engine_ref import synthetic_rows  # noqa: E402
from tests.unit.test_families import base_model, own_loss  # noqa: E402
from trainer import varlen  # noqa: E402
from trainer.data import parse_record, tokenize_all  # noqa: E402
from trainer.engine import MultiLoraEngine  # noqa: E402
from trainer.export import export_peft  # noqa: E402
from trainer.jobs import TrainJob  # noqa: E402
from trainer.tiny import make_tiny_model  # noqa: E402

# family -> the windows the flash kernel may see (None: a global layer), or "exact" for a
# soft-capped model that must take the exact path; a window the kernel gets as None where a
# batch's longest sequence fits in it
WINDOWED = ("mistral", "starcoder2", "gemma3_text", "olmo3", "cohere2", "exaone4", "ministral")
EXPECTED: dict[str, object] = {**{f: {16, None} for f in WINDOWED},
                               **{f: {None} for f in ("stablelm", "nemotron", "seed_oss",
                                                      "gpt_bigcode")},
                               "gemma2": "exact"}


@pytest.mark.parametrize("family", list(EXPECTED))
def test_varlen_on_cuda_is_the_models_own_loss(family: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    if not varlen.flash_varlen_available():
        pytest.skip("this torch has no flash varlen kernel")
    from peft import PeftModel
    from transformers import AutoTokenizer

    model_dir = make_tiny_model(family, tmp_path / "model", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = tokenize_all(tokenizer, [parse_record(r) for r in synthetic_rows(24, seed=3)], 64)
    assert max(len(e.input_ids) for e in examples[16:]) > 16  # longer than the windows
    model = base_model(model_dir).to("cuda", torch.bfloat16)
    engine = MultiLoraEngine(model, examples[:16], tokenizer.pad_token_id, attention="varlen")
    engine.attach(TrainJob("job", lora_rank=4, lora_alpha=8.0, learning_rate=3e-2, batch_size=4, max_steps=3, seed=0))
    for _ in range(3):
        engine.step()

    windows: list[int | None] = []
    exact: list[int] = []
    flash, per_sequence = varlen._flash, varlen._per_sequence

    def seen_flash(q, k, v, cu, max_len, scaling, window):  # noqa: ANN001, ANN202
        windows.append(window)
        assert int(cu[-1]) == q.shape[2] and len(cu) > 2  # the row's own sequence bounds
        return flash(q, k, v, cu, max_len, scaling, window)

    def seen_exact(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        exact.append(1)
        return per_sequence(*args, **kwargs)

    monkeypatch.setattr(varlen, "_flash", seen_flash)
    monkeypatch.setattr(varlen, "_per_sequence", seen_exact)
    loss = engine.evaluate(examples[16:], batch_size=4)["job"]
    layers = engine.model.config.num_hidden_layers
    if EXPECTED[family] == "exact":
        assert not windows and exact
    else:
        assert not exact and set(windows) <= EXPECTED[family]
        assert len(windows) % layers == 0
        if family in WINDOWED:
            assert 16 in windows

    adapter = export_peft(engine.jobs["job"].adapter, tmp_path / "adapter", list(engine.targets),
                          str(model_dir))
    reference = own_loss(PeftModel.from_pretrained(base_model(model_dir), adapter), examples[16:])
    assert loss == pytest.approx(reference, rel=1e-2)
