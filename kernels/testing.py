"""Checking helpers for the multi-LoRA operator: random cases and a float64 oracle.

Shared by the CPU tests, the GPU test and bench/lora_op.py so that all three check the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

GRAD_NAMES = ("y", "dx", "dA", "dB")


@dataclass
class Case:
    """One random problem: operator inputs plus the upstream gradient dy."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scales: torch.Tensor
    ranks: torch.Tensor
    offsets: torch.Tensor
    dy: torch.Tensor
    seed: int

    def describe(self) -> str:
        counts = (self.offsets[1:] - self.offsets[:-1]).tolist()
        return (f"seed={self.seed} dtype={self.x.dtype} d_in={self.x.shape[1]} d_out={self.weight.shape[0]} "
                f"r_max={self.lora_a.shape[2]} ranks={self.ranks.tolist()} counts={counts}")


def make_case(
    counts: Sequence[int],
    ranks: Sequence[int],
    d_in: int,
    d_out: int,
    r_max: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int | None = None,
    bias: bool = True,
    nan_padding: bool = True,
    pad_rows: int = 0,
) -> Case:
    """Random inputs, scaled so that the LoRA term is as large as the base term (errors show).

    With `nan_padding` the padded rank region of A and B is filled with NaN: a kernel that reads
    it instead of masking it produces NaN everywhere downstream. `pad_rows` rows follow the last
    adapter's (offsets[N] < T: padding no adapter owns), their upstream gradient zero as a step's
    padding gets it (its targets are ignored).
    """
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
    # Draw on the target device (fast for benchmark-sized cases); the seed still reproduces a case.
    gen = torch.Generator(device=device).manual_seed(seed)
    n = len(counts)
    r_max = r_max or max(ranks)
    t = int(sum(counts)) + pad_rows

    def rnd(*shape: int, std: float = 1.0) -> torch.Tensor:
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        return (torch.randn(*shape, generator=gen, dtype=wide, device=device) * std).to(dtype)

    a = rnd(n, d_in, r_max, std=d_in**-0.5)
    b = rnd(n, r_max, d_out, std=max(ranks) ** -0.5 if ranks else 1.0)
    if nan_padding:
        for i, r in enumerate(ranks):
            a[i, :, r:] = float("nan")
            b[i, r:, :] = float("nan")
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(list(counts), dtype=torch.int64).cumsum(0)
    case = Case(
        x=rnd(t, d_in),
        weight=rnd(d_out, d_in, std=d_in**-0.5),
        bias=rnd(d_out) if bias else None,
        lora_a=a,
        lora_b=b,
        scales=0.5 + torch.rand(n, generator=gen, device=device),
        ranks=torch.tensor(list(ranks), dtype=torch.int32).to(device),
        offsets=offsets.to(device),
        dy=rnd(t, d_out),
        seed=seed,
    )
    case.dy[t - pad_rows :] = 0
    return case


def oracle_fp64(case: Case, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """float64 y, dx, dA, dB by slicing each adapter to its rank (independent of the masking code)."""
    f = dict(dtype=torch.float64, device=device)
    # detach + clone: .to() returns the case's own tensor when it is already fp64 on `device`.
    x = case.x.detach().to(**f).clone().requires_grad_()
    a = case.lora_a.detach().to(**f).nan_to_num(0.0).requires_grad_()
    b = case.lora_b.detach().to(**f).nan_to_num(0.0).requires_grad_()
    w = case.weight.to(**f)
    y = x @ w.T
    if case.bias is not None:
        y = y + case.bias.to(**f)
    bounds = case.offsets.tolist()
    deltas = []
    for i, r in enumerate(case.ranks.tolist()):
        xi = x[bounds[i]:bounds[i + 1]]
        deltas.append(float(case.scales[i]) * (xi @ a[i, :, :r]) @ b[i, :r, :])
    if deltas:  # rows past the last adapter's (padding): the base output only
        deltas.append(torch.zeros(x.shape[0] - bounds[-1], y.shape[1], **f))
        y = y + torch.cat(deltas, 0)
    y.backward(case.dy.to(**f))
    return {"y": y.detach(), "dx": x.grad, "dA": a.grad, "dB": b.grad}


def run_op(case: Case, op: Callable[..., torch.Tensor], **kw: object) -> dict[str, torch.Tensor]:
    """Forward + backward of `op` (multilora_linear signature) on fresh leaf copies of the case."""
    x = case.x.detach().clone().requires_grad_()
    a = case.lora_a.detach().clone().requires_grad_()
    b = case.lora_b.detach().clone().requires_grad_()
    y = op(x, case.weight, case.bias, a, b, case.scales, case.ranks, case.offsets, **kw)
    y.backward(case.dy)
    return {"y": y.detach(), "dx": x.grad, "dA": a.grad, "dB": b.grad}


def rel_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """||got - want|| / ||want|| per output, in float64; NaN anywhere gives inf."""
    out = {}
    for k in GRAD_NAMES:
        g, w = got[k].detach().to(torch.float64).cpu(), want[k].detach().to(torch.float64).cpu()
        if g.shape != w.shape:
            raise AssertionError(f"{k}: shape {tuple(g.shape)} != {tuple(w.shape)}")
        if not torch.isfinite(g).all():
            out[k] = float("inf")
            continue
        denom = w.norm().item()
        out[k] = (g - w).norm().item() / denom if denom > 0 else g.norm().item()
    return out


def padding_grad_nonzero(got: dict[str, torch.Tensor], ranks: torch.Tensor) -> int:
    """Count of entries in the padded rank region of dA/dB that are not exactly zero."""
    bad = 0
    for i, r in enumerate(ranks.tolist()):
        bad += int((got["dA"][i, :, r:] != 0).sum()) + int((got["dB"][i, r:, :] != 0).sum())
    return bad


def empty_adapter_grad_nonzero(got: dict[str, torch.Tensor], offsets: torch.Tensor) -> int:
    """Count of nonzero dA/dB entries of adapters that own no rows this step."""
    counts = (offsets[1:] - offsets[:-1]).tolist()
    return sum(int((got["dA"][i] != 0).sum()) + int((got["dB"][i] != 0).sum()) for i, c in enumerate(counts) if c == 0)


def run_arena(case: Case, op: Callable[..., torch.Tensor], x_grad: bool = True, **kw: object
              ) -> tuple[dict[str, torch.Tensor], int]:
    """Forward + backward of an arena operator (multilora_linear_arena signature) on the case.

    The adapters go into one arena in shuffled order with NaN-filled gaps between them (a read
    outside an adapter's own block poisons y); the gradient arena starts with random prior sums
    (backward must add to them, not overwrite). Returns the outputs in the stacked layout of
    `run_op` (dA [N, d_in, r_max], dB [N, r_max, d_out], zero padding) and the count of gradient
    arena entries outside every adapter's blocks that changed. With aligned=True (passed on to the
    operator) every block starts at a multiple of 16 elements."""
    n, d_in, r_max = case.lora_a.shape
    d_out = case.lora_b.shape[2]
    dev, dtype = case.x.device, case.x.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    gen = torch.Generator().manual_seed(case.seed)
    ranks = case.ranks.tolist()
    order = torch.randperm(n, generator=gen).tolist()
    align = 16 if kw.get("aligned") else 1  # aligned=True: every block starts at a multiple of 16 elements
    pieces, a_off, b_off, pos = [], [0] * n, [0] * n, 0

    def gap(size: int) -> None:
        nonlocal pos
        size += -(pos + size) % align
        pieces.append(torch.full((size,), float("nan"), dtype=dtype, device=dev))
        pos += size

    for i in order:
        gap(int(torch.randint(0, 5, (), generator=gen)))
        r = ranks[i]
        a_off[i] = pos
        pieces.append(case.lora_a[i, :, :r].t().reshape(-1))
        pos += r * d_in
        gap(0)
        b_off[i] = pos
        pieces.append(case.lora_b[i, :r, :].reshape(-1))
        pos += r * d_out
    arena = torch.cat(pieces).contiguous()
    prior = torch.randn(arena.shape, generator=gen, dtype=acc).to(dev)
    grad = prior.clone()
    x = case.x.detach().clone().requires_grad_(x_grad)
    token = torch.zeros((), device=dev, requires_grad=True)
    ao = torch.tensor(a_off, dtype=torch.int64, device=dev)
    bo = torch.tensor(b_off, dtype=torch.int64, device=dev)
    y = op(x, case.weight, case.bias, arena, grad, ao, bo, case.scales, case.ranks, case.offsets, r_max, token, **kw)
    y.backward(case.dy)
    delta = grad - prior
    da = torch.zeros(n, d_in, r_max, dtype=acc, device=dev)
    db = torch.zeros(n, r_max, d_out, dtype=acc, device=dev)
    touched = torch.zeros(arena.shape, dtype=torch.bool, device=dev)
    for i, r in enumerate(ranks):
        da[i, :, :r] = delta[a_off[i] : a_off[i] + r * d_in].view(r, d_in).t()
        db[i, :r, :] = delta[b_off[i] : b_off[i] + r * d_out].view(r, d_out)
        touched[a_off[i] : a_off[i] + r * d_in] = True
        touched[b_off[i] : b_off[i] + r * d_out] = True
    stray = int((delta[~touched] != 0).sum())
    out = {"y": y.detach(), "dx": x.grad if x_grad else None, "dA": da, "dB": db}
    return out, stray


def cubin_local_bytes(cubin: bytes, bin_dir: str) -> int | None:
    """The local memory (spills, stack) a compiled kernel uses, by the cuobjdump in `bin_dir` (Triton's NVIDIA
    binaries), or None where that tool is missing: the sm_90 compile tests' check that nothing spills."""
    import os
    import re
    import subprocess
    import tempfile

    tool = os.path.join(bin_dir, "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"LOCAL:(\d+)", out)
    return int(m.group(1)) if m else None
