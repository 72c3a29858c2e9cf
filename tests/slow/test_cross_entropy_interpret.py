"""The fused cross-entropy kernel (kernels.cross_entropy) on CPU, run by Triton's interpreter in a
subprocess, against what the engine computed before (`F.cross_entropy` on a float32 copy of the
logits, its autograd gradient rounded to the logits' dtype): losses, argmax hits (ties resolved to
the first maximal column, as torch.argmax), the gradient written over the logits, ignored targets
(loss, hit and gradient 0), a non-finite row staying non-finite, one block and several (the
vocabulary across BLOCK's edge), bfloat16 and float32. Then the head (trainer.head) with it: a
chunked step's per-token losses and hidden-state gradients, and an evaluation's losses and hits,
equal to the head's torch path."""
from __future__ import annotations

import pytest

from tests.helpers.interpreted import run_interpreted

pytest.importorskip("triton")

_WORKER = r"""
from kernels.cross_entropy import BLOCK, cross_entropy_reference, cross_entropy_rows
def check(rows, vocab, dtype, scale=4.0):
    x = (torch.randn(rows, vocab) * scale).to(dtype)
    t = torch.randint(0, vocab, (rows,))
    t[1] = -100  # an ignored target
    t[2] = vocab - 1  # the last column (the last block's edge)
    x[3, 5] = x[3, 9] = x[3].max() + 1  # a tie for the argmax: the first column wins
    t[3] = 5
    x[4, 7] = x[4].max() + 1
    t[4] = 7  # a hit
    losses, hits = cross_entropy_rows(x.clone(), t, hits=True)
    ref, ref_hits, _ = cross_entropy_reference(x, t)
    g = x.clone()
    losses_g, none = cross_entropy_rows(g, t, grad=True)
    _, _, ref_g = cross_entropy_reference(x, t, grad=True)
    bad = x.clone()
    bad[0, 3] = float("nan")
    t_bad = t.clone()
    t_bad[0] = int(x[0].float().argmax())  # the largest finite logit: torch's argmax is the NaN's column
    nan_loss, nan_hits = cross_entropy_rows(bad, t_bad, hits=True)
    return {"loss": rel(losses, ref), "loss_grad_pass": rel(losses_g, ref), "hits_equal": bool((hits == ref_hits).all()),
            "hits": hits[3:5].tolist(), "ignored": [losses[1].item(), hits[1].item(), g[1].abs().max().item()],
            "grad": rel(g.float(), ref_g.float()), "grad_dtype": str(g.dtype), "none": none is None,
            # per element against its own size: the onehot's column cannot hide the softmax's small ones
            "grad_elem": ((g.double() - ref_g.double()).abs() / (ref_g.double().abs() + 1e-30)).max().item(),
            "nan_row": [bool(torch.isnan(nan_loss[0])), bool(torch.isfinite(nan_loss[1:]).all()), nan_hits[0].item()]}
for rows, vocab, dtype in ((16, 300, torch.float32), (9, BLOCK + 37, torch.float32), (16, 300, torch.bfloat16),
                           (6, 2 * BLOCK, torch.bfloat16)):
    out[f"{rows}x{vocab} {dtype}"] = check(rows, vocab, dtype)
empty, _ = cross_entropy_rows(torch.zeros(0, 50), torch.zeros(0, dtype=torch.long))
out["empty"] = list(empty.shape)
# the head with it (a plain head: weight only), against the head's torch path
from torch import nn
from trainer.head import token_losses, token_losses_and_hits
class Head:
    def __init__(self, lin, fused):
        self.lin, self.fused = lin, fused
    def __call__(self, h):
        return self.lin(h).float()
    def plain_weight(self, h):
        return self.lin.weight if self.fused else None
lin = nn.Linear(32, 300, bias=False).requires_grad_(False)
h = torch.randn(50, 32)
t = torch.randint(0, 300, (50,))
t[7] = -100
w = torch.rand(50)
res = {}
for fused in (True, False):
    hh = h.clone().requires_grad_(True)
    losses = token_losses(Head(lin, fused), hh, t, 16)
    (losses * w).sum().backward()
    ev_losses, ev_hits = token_losses_and_hits(Head(lin, fused), h, t, 16)
    res[fused] = (losses.detach(), hh.grad, ev_losses, ev_hits, token_losses(Head(lin, fused), h, t, 16))
out["head"] = {"loss": rel(res[True][0], res[False][0]), "grad_h": rel(res[True][1], res[False][1]),
               "eval_loss": rel(res[True][2], res[False][2]), "eval_hits": bool((res[True][3] == res[False][3]).all()),
               "no_grad_loss": rel(res[True][4], res[False][4])}
"""


def test_fused_cross_entropy_equals_torchs() -> None:
    out = run_interpreted(_WORKER)
    assert out.pop("empty") == [0]
    head = out.pop("head")
    assert head["loss"] < 1e-6 and head["eval_loss"] < 1e-6 and head["no_grad_loss"] < 1e-6, head
    assert head["grad_h"] < 1e-5 and head["eval_hits"], head
    for name, r in out.items():
        bf16 = "bfloat16" in name
        assert r["loss"] < 1e-6 and r["loss_grad_pass"] < 1e-6, (name, r)
        assert r["hits_equal"] and r["hits"] == [1.0, 1.0], (name, r)
        assert r["ignored"] == [0.0, 0.0, 0.0], (name, r)
        # float32: exact up to exp's rounding; bfloat16: the same float32 value rounded once more
        assert r["grad"] < (6e-3 if bf16 else 1e-5), (name, r)
        # bf16: one rounding of two float32 values that differ in their last bits, so at most two ulps apart
        # (an ulp is 2^-8..2^-7 of a value); measured one ulp (1/129)
        assert r["grad_elem"] <= (2 ** -6 if bf16 else 1e-4), (name, r)
        assert r["grad_dtype"] == ("torch.bfloat16" if bf16 else "torch.float32") and r["none"], (name, r)
        assert r["nan_row"] == [True, True, 0.0], (name, r)
