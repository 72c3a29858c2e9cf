"""Staged LoRA: a small training step's LoRA passes as cuBLAS GEMMs over every job at once (issue 40; off by default,
on with LORAPLEX_LORA_STAGE=1 until a device run shows the step faster).

A replayed 2-job step of ~1,450 tokens at 32 layers of the Llama-3.1-8B shape spent ~18 ms of ~110 in the fused
operator's own LoRA kernels (shrinks, store passes, weight gradients: small kernels bound by their chains of
dependent loads, not by their ~2 ms of bytes). Here every target linear of such a step keeps its jobs' factors
stacked in two buffers of its own, A_all [R, d_in] and B_all [R, d_out] (job slot i's rank rows at
[i * tile, i * tile + r_i), R = slots * tile, the step's rank tile), and a mask M [T, R] holds each row's own job's
scaling in its job's columns and zero elsewhere (built once a forward, on the device, from the layout's offsets,
ranks and scalings, so a graph replay rebuilds it for the step it serves). Then, all cuBLAS:

- forward: y = x W^T (+ b); S = (x A_all^T) * M; y += S B_all;
- backward: dX = dY W; dS = (dY B_all^T) * M; dX += dS A_all; dA_all = dS^T x and dB_all = S^T dY into float32
  buffers of the linear's own (cuBLAS's bf16 -> fp32 GEMM on CUDA).

Every row pays for every job's ranks (R columns, not its own r): at a 2-job step's R of 128 that is a few percent
of a 4096-wide GEMM's work and less than the fused passes' latency; at 8 jobs it is not, so a step stages only where
R <= CAP. Around the step, two multi-tensor launches move the factors: `stage_in` copies each job's blocks from the
arena into the linears' stacked buffers before the forward (the arena changes at every update; the copy casts an
arena of another dtype, and writes through `.data`, so factors a capture saved keep their autograd version),
`flush` adds the float32 gradient rows into the gradient arena after the backward (before the norms read it).
Both run eagerly, on views cached per layout, outside any graph: a graph reused for another job set reads the same
buffers. The mask applies as a where, so a job's non-finite products stay out of its step-mates' rows; its
non-finite rows or factors would not (the GEMMs sum over every row and rank row), so a set holding a job that ever
skipped a step runs the arena operator (`AdapterArena._stage_tile`).

bench/lora_concat.py measured the design on one layer's seven linears (H200, a 2-job step's 1,440 rows, as a CUDA
graph): 2.22 ms a layer against the fused operator's 2.34 (`stage`; bench/results/session61_h200.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.nn import functional as F  # noqa: N812

STAGE = os.environ.get("LORAPLEX_LORA_STAGE", "0") == "1"
CAP = int(os.environ.get("LORAPLEX_LORA_STAGE_CAP", "128"))  # the most stacked rank rows (job slots x rank tile)


def rank_tile(r_max: int) -> int:
    """A job slot's rows in the stacked factors: the largest rank rounded up to a power of two, at least 16."""
    return max(16, 1 << (max(r_max, 1) - 1).bit_length())


@dataclass
class StageBuffers:
    """One linear's stacked factors and its float32 gradient buffers (CAP rows each)."""

    a: torch.Tensor     # [CAP, d_in], the compute dtype
    b: torch.Tensor     # [CAP, d_out]
    da: torch.Tensor    # [CAP, d_in] float32: the step's dA_all
    db: torch.Tensor    # [CAP, d_out] float32

    @classmethod
    def make(cls, d_in: int, d_out: int, dtype: torch.dtype, device: torch.device) -> StageBuffers:
        grad = torch.float64 if dtype == torch.float64 else torch.float32
        return cls(torch.zeros(CAP, d_in, dtype=dtype, device=device), torch.zeros(CAP, d_out, dtype=dtype, device=device),
                   torch.zeros(CAP, d_in, dtype=grad, device=device), torch.zeros(CAP, d_out, dtype=grad, device=device))


@dataclass
class StagePlan:
    """A step layout's staging: its job slots and rank tile, its mask (made by the forward's first staged linear),
    and which linears' backward has run (the first overwrites its gradient buffers, a later one adds)."""

    slots: int
    tile: int
    graph: bool = False  # a graph's step: its flush adds every linear's gradients (the body's own plan is not seen)
    mask: torch.Tensor | None = None
    hit: torch.Tensor | None = None  # the mask's nonzero cells (bool)
    seen: set[int] = field(default_factory=set)

    @property
    def rows(self) -> int:
        return self.slots * self.tile

    def mask_for(self, rows: int, offsets: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
        """M [rows, R] (float32; float64 for float64): row t's job's scaling in that job's own rank columns, zero
        elsewhere (rows past the last job's: zero). Device ops only, no sync. The scaling multiplies in M's
        precision and the product is rounded once, as PEFT's bf16 product is (a bf16 M would round the scaling)."""
        if self.mask is None or self.mask.shape[0] != rows:
            dev = offsets.device
            t = torch.arange(rows, device=dev, dtype=offsets.dtype)
            job = torch.searchsorted(offsets[1:].contiguous(), t, right=True)  # slots past the last: no job
            cols = torch.arange(self.rows, device=dev)
            col_job = torch.div(cols, self.tile, rounding_mode="floor")
            live = (cols - col_job * self.tile) < ranks.to(cols.dtype)[col_job]
            wide = torch.float64 if dtype == torch.float64 else torch.float32
            scale = torch.cat([scales.to(wide), scales.new_zeros(1, dtype=wide)])[job]
            self.hit = (job[:, None] == col_job[None, :]) & live[None, :]
            self.mask = self.hit.to(wide) * scale[:, None]
        return self.mask


def masked(product: torch.Tensor, mask: torch.Tensor, hit: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """product * M in M's precision, rounded to `dtype`, exactly zero outside each row's own job's columns: a where,
    not a multiply, so another job's non-finite values (0 * NaN) stay out of this job's rows."""
    return torch.where(hit, product * mask, 0.0).to(dtype)


def wide_mm_available(device: torch.device) -> bool:
    """Whether this torch has cuBLAS's bf16 -> fp32 GEMM (torch.mm's out_dtype) on `device`: probed once, on tiny
    tensors, where the stacked buffers are made (outside any step and any capture)."""
    if device.type != "cuda":
        return False
    a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


WIDE_MM: list[bool] = [False]  # set by Stager (wide_mm_available)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool) -> None:
    """out (float32) = or += a @ b, a and b in the compute dtype: accumulated and stored in float32 by cuBLAS where
    torch has it (torch.mm's out_dtype, CUDA), else the product in a's dtype then widened."""
    if WIDE_MM[0] and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        if add:
            out.add_(torch.mm(a, b, out_dtype=out.dtype))
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
        return
    out.add_(a @ b) if add else out.copy_(a @ b)


class StagedLoraFn(torch.autograd.Function):
    """y = x W^T (+ b) + ((x A_all^T) * M) B_all; the factors' gradients into the linear's buffers (see the module
    docstring). `token` (requires grad) makes the backward reach a layer whose input needs none."""

    @staticmethod
    def forward(ctx, x, weight, bias, a_all, b_all, mask, bufs, plan, key, token):  # noqa: ANN001, D102
        y = F.linear(x, weight, bias)
        s = masked(x @ a_all.t(), mask, plan.hit, x.dtype)
        y.addmm_(s, b_all)
        ctx.save_for_backward(x, weight, a_all, b_all, mask, plan.hit, s)
        ctx.bufs, ctx.plan, ctx.key = bufs, plan, key
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, D102
        x, weight, a_all, b_all, mask, hit, s = ctx.saved_tensors
        bufs, plan, r = ctx.bufs, ctx.plan, a_all.shape[0]
        dy = dy.contiguous()
        ds = masked(dy @ b_all.t(), mask, hit, dy.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy @ weight
            dx.addmm_(ds, a_all)
        add = ctx.key in plan.seen  # a linear called twice in one forward: the second adds
        plan.seen.add(ctx.key)
        _mm_into(bufs.da[:r], ds.t(), x, add)
        _mm_into(bufs.db[:r], s.t(), dy, add)
        return dx, None, None, None, None, None, None, None, None, None


def staged_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bufs: StageBuffers,
                  plan: StagePlan, key: int, offsets: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
                  token: torch.Tensor) -> torch.Tensor:
    """One linear's staged forward over x [T, d_in] (see the module docstring)."""
    r = plan.rows
    mask = plan.mask_for(x.shape[0], offsets, ranks, scales, x.dtype)
    return StagedLoraFn.apply(x, weight, bias, bufs.a[:r], bufs.b[:r], mask, bufs, plan, key, token)


class _Views(NamedTuple):
    """A layout's copy lists: the stacked rows and the arena blocks they copy from, the gradient arena blocks and the
    gradient rows added into them, and each gradient pair's layer (Stager.flush keeps the layers whose backward ran)."""

    key: tuple
    dst: list[torch.Tensor]
    src: list[torch.Tensor]
    grad_dst: list[torch.Tensor]
    grad_src: list[torch.Tensor]
    owner: list[int]


class Stager:
    """The arena's side of staging for one engine's layers: the buffers, and the per-layout views that `stage_in`
    and `flush` move between (rebuilt where the layout changes)."""

    def __init__(self, layers: Sequence, dtype: torch.dtype, device: torch.device) -> None:  # noqa: ANN001
        self.layers = list(layers)
        self.bufs = [StageBuffers.make(m.in_features, m.out_features, dtype, device) for m in self.layers]
        for k, (m, bufs) in enumerate(zip(self.layers, self.bufs, strict=True)):
            m.stage_bufs, m.stage_index = bufs, k
        WIDE_MM[0] = wide_mm_available(device)
        self._views: _Views | None = None
        self.pending: StagePlan | None = None  # a step staged and not yet flushed

    def serves(self, slots: int, r_max: int, grad: bool) -> bool:
        """Whether a step of these job slots and largest rank stages (on, training, R within CAP and the buffers)."""
        rows = slots * rank_tile(r_max)
        return STAGE and grad and rows <= CAP and rows <= self.bufs[0].a.shape[0] if self.bufs else False

    def stage_in(self, plan: StagePlan, arena: torch.Tensor, grad_arena: torch.Tensor, ints: Sequence[int],
                 ranks: Sequence[int]) -> None:
        """Copy every job's factors from the arena into the stacked buffers (ints: the layout's A then B element
        offsets, layer-major, jobs in slot order: AdapterArena.layout_offsets). One multi-tensor copy, which casts
        an arena of another dtype as it copies. The copies write through `.data`: a staged step's saved factors
        (a capture's on a thread among them) keep their autograd version."""
        n, n_layers = len(ranks), len(self.layers)
        key = (arena.data_ptr(), grad_arena.data_ptr(), plan.tile, tuple(ints), tuple(ranks))
        if self._views is None or self._views.key != key:
            dst, src, gdst, gsrc, owner = [], [], [], [], []
            for k, (m, bufs) in enumerate(zip(self.layers, self.bufs, strict=True)):
                bufs.a.data.zero_()  # rows no job owns stay zero (finite: the mask's where keeps them out anyway)
                bufs.b.data.zero_()
                for i, r in enumerate(ranks):
                    lo = i * plan.tile
                    a_off, b_off = ints[k * n + i], ints[n_layers * n + k * n + i]
                    for buf, grad, off, width in ((bufs.a.data, bufs.da, a_off, m.in_features),
                                                  (bufs.b.data, bufs.db, b_off, m.out_features)):
                        dst.append(buf[lo:lo + r])
                        src.append(arena[off:off + r * width].view(r, width))
                        gdst.append(grad_arena[off:off + r * width].view(r, width))
                        gsrc.append(grad[lo:lo + r])
                        owner.append(k)
            self._views = _Views(key, dst, src, gdst, gsrc, owner)
        torch._foreach_copy_(self._views.dst, self._views.src)
        self.pending = plan

    def flush(self) -> None:
        """Add the staged step's gradient rows into the gradient arena (one multi-tensor add), once: every linear's
        after a graph's body, the linears whose backward ran after an eager one (a forward that stopped short)."""
        plan, self.pending = self.pending, None
        if plan is None or self._views is None:
            return
        gdst, gsrc, owner = self._views.grad_dst, self._views.grad_src, self._views.owner
        if not plan.graph and len(plan.seen) < len(self.layers):
            keep = [j for j, k in enumerate(owner) if k in plan.seen]
            gdst, gsrc = [gdst[j] for j in keep], [gsrc[j] for j in keep]
        if gdst:
            torch._foreach_add_(gdst, gsrc)
