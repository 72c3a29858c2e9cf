"""The backbone read onto the GPU through pinned staging buffers (trainer.fast_load) is the model
`from_pretrained` gives, bit for bit, with chunks smaller than its tensors. Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from trainer.fast_load import load_to_device  # noqa: E402
from trainer.tiny import make_tiny_model  # noqa: E402


@pytest.mark.parametrize("stage_bytes", [4096, 32 << 20])
def test_staged_load_on_cuda_equals_from_pretrained(stage_bytes: int, tmp_path) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model("llama", tmp_path / "m", seed=6)
    want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    got = load_to_device(str(model_dir), torch.device("cuda"), torch.bfloat16, threads=4, stage_bytes=stage_bytes)
    assert got is not None
    ws, gs = want.state_dict(), got.state_dict()
    assert set(ws) == set(gs)
    for k in ws:
        assert gs[k].device.type == "cuda"
        torch.testing.assert_close(gs[k], ws[k], rtol=0, atol=0, msg=k)
