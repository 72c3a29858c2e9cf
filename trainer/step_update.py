"""A training step's one sync and every job's update (issue 40: "decide on the device, with no host
sync: the non-finite skip, per-job gradient clipping, the learning-rate schedule, and AdamW over
every job's slice").

`sync_and_update(states, numbers, width, grads)`: `numbers` holds, on the device, each job's `width`
numbers (its loss first) and then every job's gradient norm. The host needs them for the step's
report, and each job's update needs its loss and norm for two decisions: skip (a non-finite loss or
norm) and clip (by max_grad_norm).

- Host decisions (`update_jobs`, the default): the numbers come to the host, the host decides, then
  it launches the updates. The device idles from the end of the step's backward until the updates
  are launched.
- Device decisions (`$LORAPLEX_DEVICE_UPDATE=1`): each job's update is torch's fused AdamW kernel
  with `found_inf` (1 where its loss or norm is non-finite: the kernel leaves the job's weights and
  moments as they were) and `grad_scale` (max(1, (norm + 1e-6) / max_grad_norm): clip_grads_with_norm_'s
  factor, inverted). It is launched before the sync, behind a copy of the numbers to pinned memory,
  so the host reads them while the updates run. The learning rates and bias corrections come from
  the host's counts, as before. Each count advances for every job at launch; after the sync, a
  skipped job's count is taken back and its skip counted (a skipped first step leaves no AdamW state,
  as the host's decisions do). The weights and moments are those of the host's decisions on CUDA,
  within float32 rounding of the clip factor; the update is always torch's fused kernel (on the CPU
  too, where the host's path is the foreach one, bit for bit torch.optim.AdamW: ~1e-8 apart), and
  every job with a max_grad_norm passes its scale (the kernel then writes the unscaled gradient back).
  The counts advance before the sync: a sync that raises leaves a skipped job's counts advanced.

Off by default until a device run measures it (bench/device_session.sh s51_b).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import torch

from trainer.host_pool import POOL
from trainer.jobs import JobRun, adamw_states, advance, as_param_dtype, note_step, update_jobs

DEVICE_UPDATE = os.environ.get("LORAPLEX_DEVICE_UPDATE", "0") == "1"


def sync_and_update(states: Sequence[JobRun], numbers: torch.Tensor, width: int,
                    grads: Sequence[torch.Tensor], on_device: bool | None = None,
                    then: Callable[[], object] | None = None) -> tuple[list[float], list[bool]]:
    """The step's numbers on the host (one sync) and every job's update done: the numbers as a list
    and which jobs skipped theirs. `on_device`: decide on the device (default $LORAPLEX_DEVICE_UPDATE).
    `then`: called once the updates are queued, before the sync (trainer.step_pipeline: the next step
    launched); the updates are then decided on the device."""
    n = len(states)
    if then is None and not (DEVICE_UPDATE if on_device is None else on_device):
        if numbers.is_cuda:  # the wait on an event, then the copy: a copy's own wait is the driver's, not ours
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(numbers.device))
            with POOL.device_wait():
                done.synchronize()
        values = numbers.tolist()
        return values, update_jobs(states, values[0:n * width:width], values[n * width:], grads)
    if numbers.is_cuda:
        host = torch.empty(numbers.shape, dtype=numbers.dtype, pin_memory=True)
        host.copy_(numbers, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(numbers.device))  # the numbers' device, whichever is current
    else:
        host, ready = numbers.clone(), None
    update_on_device(states, numbers[0:n * width:width], numbers[n * width:], grads)
    if then is not None:
        then()
    if ready is not None:
        with POOL.device_wait():
            ready.synchronize()
    values = host.tolist()
    skipped = []
    for s, loss, norm in zip(states, values[0:n * width:width], values[n * width:], strict=True):
        skip = note_step(s, loss, norm)
        if skip:  # the kernel left it as it was: so does the host's count
            st = s.optimizer.state[s.adapter.flat]
            st["step"] -= 1
            if float(st["step"]) == 0:  # its first step: no state, as the host's decisions leave it
                del s.optimizer.state[s.adapter.flat]
        skipped.append(skip)
    return values, skipped


@torch.no_grad()
def update_on_device(states: Sequence[JobRun], losses: torch.Tensor, norms: torch.Tensor,
                     grads: Sequence[torch.Tensor]) -> None:
    """Every job's AdamW update launched with its skip and clip decided on the device (see the module
    docstring), then every job's schedule and step count; nothing here waits for the device."""
    if not states:
        return
    params = [s.adapter.flat for s in states]
    st, hyper = adamw_states([s.optimizer for s in states], params)
    limits = [s.spec.max_grad_norm if s.spec.max_grad_norm is not None else math.inf for s in states]
    host = torch.tensor([h[5] for h in hyper] + limits, dtype=torch.float32, pin_memory=params[0].is_cuda)
    vals = host.to(params[0].device, non_blocking=True)  # the steps and limits in one copy
    n = len(states)
    bad = (~(torch.isfinite(losses) & torch.isfinite(norms))).to(torch.float32)
    scales = torch.clamp((norms.to(torch.float32) + 1e-6) / vals[n:], min=1.0)  # no limit: inf -> 1
    for i, (p, g, h) in enumerate(zip(params, grads, hyper, strict=True)):
        torch._fused_adamw_([p], [as_param_dtype(g, p)], [st[i]["exp_avg"]],
                            [st[i]["exp_avg_sq"]], [], [vals[i]], lr=h[0], beta1=h[1], beta2=h[2],
                            weight_decay=h[4], eps=h[3], amsgrad=False, maximize=False,
                            grad_scale=scales[i] if states[i].spec.max_grad_norm is not None else None,
                            found_inf=bad[i])
    advance(states)
