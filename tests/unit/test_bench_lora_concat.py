"""Unit: bench/lora_concat.py's LoRA forms (the probe behind session 61's staged LoRA, taken out in session 62) compute what they claim on the CPU:
each form's y, dX, dA and dB against the script's own float64 reference, so its device table compares forms that
agree. The timing itself needs CUDA graphs (a device run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import lora_concat as lc  # noqa: E402


@pytest.mark.parametrize(("d_in", "d_out"), [(24, 40), (40, 16)])
def test_every_concat_form_matches_the_float64_reference(monkeypatch, d_in: int, d_out: int) -> None:  # noqa: ANN001
    monkeypatch.setattr(lc, "DEV", "cpu")
    monkeypatch.setattr(lc, "CAP", 32)
    counts, ranks, scales = [5, 11], [4, 8], [2.0, 2.0]
    g = torch.Generator().manual_seed(0)
    layer = lc.Layer(d_in, d_out, counts, ranks, g)
    x = torch.randn(16, d_in, generator=g).to(torch.bfloat16)
    dy = torch.randn(16, d_out, generator=g).to(torch.bfloat16)
    ref = lc.reference(layer, x, dy, counts, ranks, scales)
    mask = lc.mask_of(counts, ranks, scales, 16)
    for form in ("concat", "concat+copies", "rows", "rows+foreach", "stage"):
        layer.grad.zero_()
        layer.ga.zero_()
        layer.gb.zero_()
        y, dx = lc.run(form, [layer], [x], [dy], mask, {})[0]
        if form in ("concat", "rows"):
            da, db = layer.ga, layer.gb
        else:  # through the gradient arena at the jobs' blocks
            da = layer.grad[layer.idx_a].view(layer.r, d_in)
            db = layer.grad[layer.idx_b].view(layer.r, d_out)
        for got, key in ((y, "y"), (dx, "dx"), (da, "dA"), (db, "dB")):
            assert lc.rel(got, ref[key]) < 1e-2, (form, key)  # bf16 operands
