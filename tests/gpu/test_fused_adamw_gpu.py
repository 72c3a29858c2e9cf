"""The jobs' AdamW on CUDA runs torch's fused kernel per job (trainer.jobs._fused_each): over five
steps of three jobs with their own lr, betas, eps, weight decay and step counts, it equals the
foreach path ($LORAPLEX_FUSED_ADAMW=0, bit for bit torch.optim.AdamW(foreach=False)) within float32
rounding, and both equal torch.optim.AdamW(fused=True) run per job. Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from trainer import jobs  # noqa: E402

SETTINGS = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
            dict(lr=3e-4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
            dict(lr=1e-1, betas=(0.95, 0.9999), eps=1e-8, weight_decay=0.01)]


def _run(fused: bool | None, monkeypatch) -> list[torch.Tensor]:  # noqa: ANN001
    """Five steps of three jobs; fused None: torch.optim.AdamW(fused=True), each job's own."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(n, generator=gen, device="cuda") for n in (1 << 20, 37, 3 << 18)]
    opts = [torch.optim.AdamW([torch.nn.Parameter(p)] if fused is None else [p], foreach=False,
                              fused=fused is None, **kw) for p, kw in zip(params, SETTINGS, strict=True)]
    monkeypatch.setattr(jobs, "FUSED_ADAMW", bool(fused))
    for step in range(5):
        grads = [torch.randn(p.numel(), generator=gen, device="cuda") * (step + 1) for p in params]
        if fused is None:
            for opt, g in zip(opts, grads, strict=True):
                opt.param_groups[0]["params"][0].grad = g
                opt.step()
            params = [opt.param_groups[0]["params"][0].detach() for opt in opts]
        else:
            jobs.multi_adamw(opts, params, grads, [1.0] * len(params))
    torch.cuda.synchronize()
    return params


def test_the_fused_update_on_cuda_equals_the_foreach_one_and_torchs_fused_adamw(monkeypatch) -> None:  # noqa: ANN001
    calls: list[int] = []
    each = jobs._fused_each
    monkeypatch.setattr(jobs, "_fused_each", lambda *a: calls.append(len(a[0])) or each(*a))
    fused = _run(True, monkeypatch)
    assert calls == [3] * 5  # the fused path ran, every job each step
    foreach = _run(False, monkeypatch)
    torchs = _run(None, monkeypatch)
    for f, r, t in zip(fused, foreach, torchs, strict=True):
        assert torch.allclose(f, r, rtol=1e-5, atol=1e-6)
        assert torch.allclose(f, t, rtol=1e-6, atol=1e-7)
    assert len(calls) == 5  # the foreach run did not take the fused path
