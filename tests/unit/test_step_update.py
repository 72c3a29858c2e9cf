"""Unit: a step's update with its skip and clip decided on the device (trainer.step_update,
$LORAPLEX_DEVICE_UPDATE=1) equals the host's decisions (trainer.jobs.update_jobs, the default) job by
job: the same jobs skip (a non-finite loss or gradient norm), the others clip by their own
max_grad_norm and take the same AdamW step, and the step counts, skip counts, schedules and last
losses agree. The device path reads no value on the host while it launches the updates.
torch's fused AdamW has a CPU kernel, so both paths run the fused kernel here (as on CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer import jobs, step_update
from trainer.jobs import JobRun, TrainJob

SHAPES = {"q_proj": (32, 32), "v_proj": (32, 16)}


def _runs() -> list[JobRun]:
    specs = [TrainJob("a", lora_rank=4, learning_rate=1e-2, max_steps=10, seed=1, warmup_steps=2),
             TrainJob("b", lora_rank=8, learning_rate=3e-3, max_steps=10, seed=2, max_grad_norm=0.5),
             TrainJob("c", lora_rank=4, learning_rate=1e-3, max_steps=10, seed=3, max_grad_norm=None),
             TrainJob("d", lora_rank=8, learning_rate=2e-2, max_steps=10, seed=4, max_grad_norm=100.0)]
    runs = [JobRun.new(s, SHAPES, torch.float32, torch.device("cpu"), 64) for s in specs]
    for r in runs:  # LoRA's B starts at zero: make every weight move
        torch.nn.init.normal_(r.adapter.flat, std=0.05, generator=torch.Generator().manual_seed(r.spec.seed))
    return runs


def _step(runs: list[JobRun], grads: list[torch.Tensor], losses: list[float], on_device: bool, width: int = 1
          ) -> tuple[list[float], list[bool]]:
    """One step's sync and update: each job's `width` numbers (its loss, then a metric), then the norms."""
    norms = torch._foreach_norm(grads)
    rows = [[loss, *(0.25 * k for k in range(1, width))] for loss in losses]
    numbers = torch.cat([torch.tensor(rows, dtype=torch.float32).reshape(-1), torch.stack(norms)])
    return step_update.sync_and_update(runs, numbers, width, [g.clone() for g in grads], on_device=on_device)


@pytest.mark.parametrize("width", [1, 2])
def test_device_decisions_equal_the_host_s(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    monkeypatch.setattr(jobs, "_use_fused", lambda p: True)  # the host's path on its CUDA kernel, as on the device
    host, dev = _runs(), _runs()
    gen = torch.Generator().manual_seed(0)
    # job c skips its first step (no AdamW state after it either way); a, b and d skip later ones
    plan = [[1.0, 2.0, math.nan, 4.0], [math.nan, 1.5, 2.5, 3.5], [1.0, math.inf, 2.0, 3.0], [0.5, 0.7, 0.9, 1.1]]
    for step, losses in enumerate(plan):
        grads = [torch.randn(r.adapter.flat.numel(), generator=gen) * (3.0 if step % 2 else 0.2) for r in host]
        if step == 3:
            grads[3][5] = math.nan  # a non-finite gradient norm skips job d
        _, want_skip = _step(host, grads, losses, on_device=False, width=width)
        _, got_skip = _step(dev, grads, losses, on_device=True, width=width)
        assert got_skip == want_skip
        if step == 0:
            assert not dev[2].optimizer.state[dev[2].adapter.flat]
            assert not host[2].optimizer.state[host[2].adapter.flat]
    assert [r.skipped_steps for r in dev] == [r.skipped_steps for r in host] == [1, 1, 1, 1]
    for h, d in zip(host, dev, strict=True):
        assert d.step == h.step == 4
        assert d.optimizer.param_groups[0]["lr"] == h.optimizer.param_groups[0]["lr"]
        assert math.isnan(d.last_loss) == math.isnan(h.last_loss) and (math.isnan(h.last_loss) or d.last_loss == h.last_loss)
        hs, ds = h.optimizer.state[h.adapter.flat], d.optimizer.state[d.adapter.flat]
        assert float(ds["step"]) == float(hs["step"]) == 4 - h.skipped_steps
        assert torch.allclose(d.adapter.flat, h.adapter.flat, rtol=1e-6, atol=1e-7), h.job_id
        assert torch.allclose(ds["exp_avg"], hs["exp_avg"], rtol=1e-6, atol=1e-9), h.job_id
        assert torch.allclose(ds["exp_avg_sq"], hs["exp_avg_sq"], rtol=1e-6, atol=1e-12), h.job_id
    assert not torch.equal(dev[1].adapter.flat, _runs()[1].adapter.flat)  # they moved


def test_a_clipped_job_moves_less_and_a_skipped_job_not_at_all() -> None:
    runs = _runs()
    before = [r.adapter.flat.clone() for r in runs]
    grads = [torch.full((r.adapter.flat.numel(),), 1.0 if r.job_id == "d" else 10.0) for r in runs]
    _step(runs, grads, [1.0, 1.0, math.nan, 1.0], on_device=True)
    assert torch.equal(runs[2].adapter.flat, before[2])  # skipped its first step: its weights stay, no state
    assert not runs[2].optimizer.state[runs[2].adapter.flat]
    assert runs[2].step == 1 and runs[2].skipped_steps == 1  # its schedule moved on, as the host's does
    # b (norm ~300) clips to 0.5 and d (norm ~30, limit 100) does not: a first moment is a tenth of the
    # gradient the update saw
    m_b = runs[1].optimizer.state[runs[1].adapter.flat]["exp_avg"]
    norm_b = float(torch.linalg.vector_norm(grads[1]))
    assert norm_b > 100
    assert torch.allclose(m_b, torch.full_like(m_b, 0.1 * 10.0 * 0.5 / (norm_b + 1e-6)), rtol=1e-5)
    m_d = runs[3].optimizer.state[runs[3].adapter.flat]["exp_avg"]
    assert float(torch.linalg.vector_norm(grads[3])) < 100
    assert torch.allclose(m_d, torch.full_like(m_d, 0.1), rtol=1e-6)


class OnDevice(torch.Tensor):
    """A tensor whose values (and those of every tensor made from it) may not come to the host."""

    READS = (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
             torch.Tensor.__int__, torch.Tensor.__index__)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if func in cls.READS:
            raise AssertionError(f"a device value read on the host: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_device_path_reads_no_loss_or_norm_on_the_host_while_it_launches() -> None:
    runs = _runs()
    grads = [torch.randn(r.adapter.flat.numel()) for r in runs]
    norms = torch.stack(torch._foreach_norm(grads)).as_subclass(OnDevice)
    losses = torch.tensor([1.0, math.nan, 2.0, 3.0]).as_subclass(OnDevice)
    with pytest.raises(AssertionError, match="host"):
        bool(losses[0] > 0)  # the guard works
    step_update.update_on_device(runs, losses, norms, grads)
    assert [r.step for r in runs] == [1, 1, 1, 1]
    assert float(runs[1].optimizer.state[runs[1].adapter.flat]["step"]) == 1  # a skip settles after the sync
    assert torch.count_nonzero(runs[1].optimizer.state[runs[1].adapter.flat]["exp_avg"]) == 0  # it skipped
    assert torch.count_nonzero(runs[0].optimizer.state[runs[0].adapter.flat]["exp_avg"]) > 0
