"""GPU: the fused cross-entropy (kernels.cross_entropy) at the 8B head's shape, bf16, against the
float32 path the engine took before (losses, argmax hits, the logits' gradient rounded to bf16),
and the chunked head (trainer.head) with it against the head's torch path: per-token losses and
hidden-state gradients of a training chunk, losses and hits of an evaluation."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.cross_entropy import cross_entropy_reference, cross_entropy_rows
from trainer.head import token_losses, token_losses_and_hits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

VOCAB, HIDDEN = 128256, 4096


def test_fused_cross_entropy_matches_the_float32_path() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(1024, VOCAB, generator=g, device="cuda") * 3).to(torch.bfloat16)
    t = torch.randint(0, VOCAB, (1024,), generator=g, device="cuda")
    t[::97] = -100
    t[5] = int(x[5].float().argmax())  # a hit
    losses, hits = cross_entropy_rows(x.clone(), t, hits=True)
    ref, ref_hits, ref_g = cross_entropy_reference(x, t, grad=True)
    torch.testing.assert_close(losses, ref, rtol=1e-5, atol=1e-5)
    assert hits[5] == 1.0 and int((hits != ref_hits).sum()) == 0
    grad = x.clone()
    cross_entropy_rows(grad, t, grad=True)
    diff = (grad.float() - ref_g.float()).abs()
    assert diff.max().item() <= 2 ** -8 * ref_g.float().abs().max().item()  # one bf16 rounding at most
    assert grad[::97].abs().max().item() == 0.0  # ignored rows: no gradient


class _Head:
    def __init__(self, lin: nn.Linear, fused: bool) -> None:
        self.lin, self.fused = lin, fused

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h).float()

    def plain_weight(self, h: torch.Tensor) -> torch.Tensor | None:
        return self.lin.weight if self.fused else None


def test_the_head_with_the_fused_kernel_equals_its_torch_path() -> None:
    torch.manual_seed(1)
    lin = nn.Linear(HIDDEN, VOCAB, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    nn.init.normal_(lin.weight, std=0.02)
    h = torch.randn(3000, HIDDEN, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, VOCAB, (3000,), device="cuda")
    w = torch.rand(3000, device="cuda")
    got = {}
    for fused in (True, False):
        hh = h.clone().requires_grad_(True)
        losses = token_losses(_Head(lin, fused), hh, t, 2048)
        (losses * w).sum().backward()
        got[fused] = (losses.detach(), hh.grad, *token_losses_and_hits(_Head(lin, fused), h, t, 2048))
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[True][2], got[False][2], rtol=1e-5, atol=1e-5)
    assert int((got[True][3] != got[False][3]).sum()) == 0
    scale = got[False][1].float().abs().max().item()
    assert (got[True][1].float() - got[False][1].float()).abs().max().item() <= 1e-2 * scale


_FIRST_HITS_CALL = """
import sys, time, torch
from kernels.cross_entropy import cross_entropy_rows
from trainer.head import load_hits_kernel
dev = torch.device("cuda")
x, t = torch.randn(64, 4096, device=dev).to(torch.bfloat16), torch.randint(0, 4096, (64,), device=dev)
cross_entropy_rows(x.clone(), t, grad=True)  # the training variant: loaded either way
if sys.argv[1] == "1":
    load_hits_kernel(dev, torch.bfloat16)
torch.cuda.synchronize()
torch.cuda._sleep(2_000_000_000)  # ~1 s of queued device work (an evaluation's forwards)
queued = torch.cuda.Event()
queued.record()
cross_entropy_rows(x, t, hits=True)
print(int(not queued.query()))
"""


@pytest.mark.parametrize("preloaded", [1, 0])
def test_the_evaluations_first_hits_call_waits_for_the_device_only_without_the_preload(preloaded: int) -> None:
    """trainer.head.load_hits_kernel (the engine's construction calls it): in a fresh process, the first
    evaluation-variant call returns while the device still runs earlier work; without it, its module's
    first load waits for that work (what session 54's probe found at a task's first evaluation)."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", _FIRST_HITS_CALL, str(preloaded)], capture_output=True, text=True,
                         timeout=300, check=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip().splitlines()[-1] == str(preloaded), out.stderr[-2000:]
