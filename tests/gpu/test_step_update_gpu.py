"""The step's update with its skip and clip decided on the device (trainer.step_update) on CUDA:
the same outcome as the host's decisions job by job (a first-step skip included), with the numbers
read back while the updates run (the pinned copy and its event), and the updates' launch asks the
device for nothing (CUDA's sync debug mode). Skipped without CUDA."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from trainer import step_update  # noqa: E402
from trainer.jobs import JobRun, TrainJob  # noqa: E402

SHAPES = {"q_proj": (256, 256), "v_proj": (256, 64)}


def _runs() -> list[JobRun]:
    specs = [TrainJob("a", lora_rank=8, learning_rate=1e-2, max_steps=10, seed=1),
             TrainJob("b", lora_rank=16, learning_rate=3e-3, max_steps=10, seed=2, max_grad_norm=0.5),
             TrainJob("c", lora_rank=8, learning_rate=1e-3, max_steps=10, seed=3, max_grad_norm=None)]
    runs = [JobRun.new(s, SHAPES, torch.float32, torch.device("cuda"), 64) for s in specs]
    for r in runs:
        torch.nn.init.normal_(r.adapter.flat, std=0.05)
    return runs


def test_device_decisions_equal_the_host_s_on_cuda() -> None:
    torch.manual_seed(0)
    host, dev = _runs(), _runs()
    for h, d in zip(host, dev, strict=True):
        d.adapter.flat.data.copy_(h.adapter.flat.data)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step, losses in enumerate([[1.0, math.nan, 3.0], [math.nan, 1.0, 2.0], [1.0, 1.0, math.inf], [0.5, 0.6, 0.7]]):
        grads = [torch.randn(r.adapter.flat.numel(), device="cuda", generator=gen) * (5.0 if step % 2 else 0.1)
                 for r in host]
        out = []
        for runs, on_device in ((host, False), (dev, True)):
            norms = torch._foreach_norm(grads)
            numbers = torch.cat([torch.tensor(losses, device="cuda"), torch.stack(norms)])
            out.append(step_update.sync_and_update(runs, numbers, 1, [g.clone() for g in grads], on_device=on_device))
        assert out[0][1] == out[1][1]
    torch.cuda.synchronize()
    assert [r.skipped_steps for r in dev] == [r.skipped_steps for r in host] == [1, 1, 1]
    for h, d in zip(host, dev, strict=True):
        assert torch.allclose(d.adapter.flat, h.adapter.flat, rtol=1e-5, atol=1e-6), h.job_id
        hs, ds = h.optimizer.state[h.adapter.flat], d.optimizer.state[d.adapter.flat]
        assert float(ds["step"]) == float(hs["step"]) == 3
        assert torch.allclose(ds["exp_avg"], hs["exp_avg"], rtol=1e-5, atol=1e-9), h.job_id
        assert torch.allclose(ds["exp_avg_sq"], hs["exp_avg_sq"], rtol=1e-5, atol=1e-12), h.job_id


def test_the_device_update_launches_without_a_sync() -> None:
    runs = _runs()
    grads = [torch.randn(r.adapter.flat.numel(), device="cuda") for r in runs]
    norms = torch.stack(torch._foreach_norm(grads))
    losses = torch.tensor([1.0, math.nan, 2.0], device="cuda")
    step_update.update_on_device(runs, losses, norms, grads)  # warm: states made, pinned blocks cached
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step_update.update_on_device(runs, losses, norms, grads)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert [r.step for r in runs] == [2, 2, 2]
