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


def _run(fused: bool | None, monkeypatch, steps: int = 5) -> list[torch.Tensor]:  # noqa: ANN001
    """`steps` steps of three jobs; fused None: torch.optim.AdamW(fused=True), each job's own."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(n, generator=gen, device="cuda") for n in (1 << 20, 37, 3 << 18)]
    opts = [torch.optim.AdamW([torch.nn.Parameter(p)] if fused is None else [p], foreach=False,
                              fused=fused is None, **kw) for p, kw in zip(params, SETTINGS, strict=True)]
    monkeypatch.setattr(jobs, "FUSED_ADAMW", bool(fused))
    for step in range(steps):
        grads = [torch.randn(p.numel(), generator=gen, device="cuda") * (step + 1) for p in params]
        if fused is None:
            for opt, g in zip(opts, grads, strict=True):
                opt.param_groups[0]["params"][0].grad = g
                opt.step()
            params = [opt.param_groups[0]["params"][0].detach() for opt in opts]
        else:
            jobs.multi_adamw(opts, params, grads, [1.0] * len(params))
    torch.cuda.synchronize()
    return [p.detach().clone() for p in params]


def test_the_fused_update_on_cuda_equals_the_foreach_one_and_torchs_fused_adamw(monkeypatch) -> None:  # noqa: ANN001
    calls: list[int] = []
    each = jobs._fused_each
    monkeypatch.setattr(jobs, "_fused_each", lambda *a: calls.append(len(a[0])) or each(*a))
    fused = _run(True, monkeypatch)
    assert calls == [3] * 5  # the fused path ran, every job each step
    foreach = _run(False, monkeypatch)
    torchs = _run(None, monkeypatch)
    start = _run(None, monkeypatch, steps=0)
    for f, r, t, p0 in zip(fused, foreach, torchs, start, strict=True):
        moved = float((t - p0).abs().max())
        ulp = torch.finfo(torch.float32).eps * float(t.abs().max())  # float32 rounding at these values
        vs_torch, vs_foreach = float((f - t).abs().max()), float((f - r).abs().max())
        # torch's own fused AdamW, the same kernel: equal but for float32 rounding
        assert vs_torch <= 4 * ulp + 1e-6 * moved, (vs_torch, vs_foreach, moved, ulp)
        # the foreach passes round in another order: apart by far less than the update itself
        assert vs_foreach <= 64 * ulp + 1e-4 * moved, (vs_torch, vs_foreach, moved, ulp)
    assert len(calls) == 5  # the foreach run did not take the fused path
