"""Unit: the jobs' AdamW as torch's fused kernel, one call per job (trainer.jobs._fused_each, what
runs on CUDA), equals the foreach path (what runs on CPU, bit for bit torch.optim.AdamW) within
float32 rounding, job by job, with each job's own lr, betas, eps, weight decay, step count and
gradient clipping (the fused kernel's gradient scale).
torch's fused AdamW has a CPU kernel too, so the fused path runs here on CPU."""

from __future__ import annotations

import torch

from trainer import jobs


def _jobs(seed: int) -> tuple[list[torch.optim.Optimizer], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    settings = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
                dict(lr=3e-4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
                dict(lr=1e-1, betas=(0.95, 0.9999), eps=1e-8, weight_decay=0.01)]
    params = [torch.randn(n, generator=gen) for n in (1000, 37, 4096)]
    opts = [torch.optim.AdamW([p], foreach=False, **kw) for p, kw in zip(params, settings, strict=True)]
    return opts, params


def test_the_fused_update_equals_the_foreach_update_job_by_job(monkeypatch) -> None:  # noqa: ANN001
    ref_opts, ref = _jobs(0)
    opts, params = _jobs(0)
    gen = torch.Generator().manual_seed(1)
    fused_calls: list[int] = []
    each = jobs._fused_each
    monkeypatch.setattr(jobs, "_fused_each", lambda *a: fused_calls.append(len(a[0])) or each(*a))
    for step in range(5):
        grads = [torch.randn(p.numel(), generator=gen) * (step + 1) for p in params]
        clips = [0.5, 1.0, 0.25] if step % 2 else [1.0, 0.3, 1.0]  # clipping factors, 1: none
        jobs.multi_adamw(ref_opts, ref, [g.clone() for g in grads], clips)  # the CPU: the foreach path
        with monkeypatch.context() as m:
            m.setattr(jobs, "_use_fused", lambda p: True)
            # the second job starts a step late: its own step count drives its bias correction
            live = [0, 2] if step == 0 else [0, 1, 2]
            jobs.multi_adamw([opts[i] for i in live], [params[i] for i in live], [grads[i] for i in live],
                             [clips[i] for i in live])
        if step == 0:  # the reference does the same
            ref_opts[1].state.clear()
            ref[1].copy_(_jobs(0)[1][1])
    assert fused_calls == [2, 3, 3, 3, 3]
    for i, (p, r) in enumerate(zip(params, ref, strict=True)):
        assert torch.allclose(p, r, rtol=1e-5, atol=1e-6), i
        st, rst = opts[i].state[p], ref_opts[i].state[r]
        assert float(st["step"]) == float(rst["step"]) == (4.0 if i == 1 else 5.0)
        assert torch.allclose(st["exp_avg_sq"], rst["exp_avg_sq"], rtol=1e-5, atol=1e-12)
    assert not torch.equal(params[0], _jobs(0)[1][0])  # it moved
    assert not jobs._use_fused(torch.zeros(1))  # on the CPU the engine keeps the foreach path
