"""Sibling groups of the fused multi-LoRA operator: linears that read one input (an attention's q/k/v, a gated
MLP's gate/up) as one autograd node (issue 40; on with $LORAPLEX_LORA_GROUPS=1, off until measured on a device).

Per sibling s (same input X, each its own base weight W_s and adapters' A_s, B_s in the arena):

  forward   S_s = X A_{s,i}^T          one `_shrink_group` launch for every sibling (grid axis 2)
            Y_s = X W_s^T + s_i S_s B_s^T   the fused GEMM per sibling (kernels.fused_lora._gemm_launch)
  backward  dS_s = dY_s B_s, dB_s         the one-pass shrink per sibling (it reads its own dY_s)
            dA_s += s_i dS_s^T X          one `_wgrad_group` launch for every sibling (on the dA side stream)
            dX = sum_s dY_s W_s + dS_s A_s   the fused GEMM per sibling, summed in place

So a q/k/v group launches one forward shrink and one dA pass where the layers alone launch three of each
(each ~20-25 us at a 2-job step's ~1.4k rows, bench/results/session57_h200.md). Numbers
equal the layers' own (the same kernels' programs, per sibling). The kernels run the plain kernels' programs
(`_shrink_jit`, `_wgrad_jit`) once per sibling, on the configuration the plain kernel's table gives for the
call's key. Their sources differ from the shipped archive's, so until a device grows their cubins into it they
compile in a task: off by default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fused_lora import (
    _PRUNE,
    _SHRINK_CONFIGS,
    _WGRAD_CONFIGS,
    _arena_mode,
    _arena_rank_major,
    _Ctx,
    _gemm_launch,
    _shrink,
    _shrink_jit,
    _shrink_launch,
    _side_stream,
    _wgrad,
    _wgrad_jit,
    _wgrad_launch,
)
from kernels.triton_lora import _acc_torch, _check_arena
from kernels.tuned import Tuned


# Each runs the plain kernel's program once per sibling (grid axis 2): sibling s reads its adapters' offsets at
# woff_ptr + s * N (the layers' offset rows: consecutive rows of one [layers, N] tensor, or a stack of them) and
# its own slice of P at p_ptr + s * stride_ps.
@triton.jit(do_not_specialize=["N", "stride_ps"],
            do_not_specialize_on_alignment=["woff_ptr", "off_ptr", "rank_ptr", "scale_ptr", "goff_ptr"])
def _shrink_group_jit(
    m_ptr, w_ptr, p_ptr, woff_ptr, off_ptr, rank_ptr,
    s_ptr, g_ptr, goff_ptr, scale_ptr,
    N, C, R_MAX, T_BUCKET,
    stride_mm, stride_mc, stride_wn, stride_wr, stride_wc, stride_pm, stride_sm, stride_ps,
    N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, ARENA: tl.constexpr,
    FUSE_WGRAD: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_C: tl.constexpr,
):
    """`_shrink_jit` (no FUSE_WGRAD) for sibling program_id(2): P[s] = M @ W_{s,i}^T."""
    sib = tl.program_id(2)
    _shrink_jit(m_ptr, w_ptr, p_ptr + sib * stride_ps, woff_ptr + sib * N, off_ptr, rank_ptr, s_ptr, g_ptr, goff_ptr,
                scale_ptr, N, C, R_MAX, T_BUCKET, stride_mm, stride_mc, stride_wn, stride_wr, stride_wc, stride_pm,
                stride_sm, N_P2, ACC, DOT_PREC, ARENA, FUSE_WGRAD, BLOCK_R, BLOCK_M, BLOCK_K, SPLIT_C)


@triton.jit(do_not_specialize=["N", "stride_ps"],
            do_not_specialize_on_alignment=["goff_ptr", "off_ptr", "rank_ptr", "scale_ptr"])
def _wgrad_group_jit(
    p_ptr, m_ptr, g_ptr, goff_ptr, off_ptr, rank_ptr, scale_ptr,
    N, C, R_MAX, T_BUCKET,
    stride_pm, stride_mm, stride_mc, stride_gn, stride_gr, stride_gc, stride_ps,
    N_P2: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr, ARENA: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    """`_wgrad_jit` for sibling program_id(2): G_{s,i} += s_i P[s]^T M (dA of siblings that share M = X)."""
    sib = tl.program_id(2)
    _wgrad_jit(p_ptr + sib * stride_ps, m_ptr, g_ptr, goff_ptr + sib * N, off_ptr, rank_ptr, scale_ptr, N, C, R_MAX,
               T_BUCKET, stride_pm, stride_mm, stride_mc, stride_gn, stride_gr, stride_gc, N_P2, ACC, DOT_PREC, ARENA,
               BLOCK_R, BLOCK_M, BLOCK_N, CHUNK)


_shrink_group = Tuned("shrink_group", _shrink_group_jit, _SHRINK_CONFIGS, ["T_BUCKET", "C", "R_MAX"], _PRUNE["shrink"])
_wgrad_group = Tuned("wgrad_group", _wgrad_group_jit, _WGRAD_CONFIGS, ["T_BUCKET", "C", "R_MAX"], _PRUNE["wgrad"],
                     restore=("g_ptr",))


def _shrink_group_launch(c: _Ctx, m, w, w_strides, woffs, p, arena: int) -> None:  # noqa: ANN001
    """p[s][rows_i, :r_i] = m[rows_i] @ W_{s,i}^T for every sibling s (woffs [S, N], p [S, T, R])."""
    sibs = p.shape[0]
    args = (m, w, p, woffs, c.offsets, c.ranks, p, p, woffs, c.scales, c.n, m.shape[1], c.r_max, c.t_bucket,
            m.stride(0), m.stride(1), *w_strides, p.stride(1), p.stride(1))
    meta = dict(N_P2=c.n_p2, ACC=c.acc, DOT_PREC=c.prec, ARENA=arena, FUSE_WGRAD=False)
    cfg = _shrink.choose(lambda k: (c.items(k["BLOCK_M"], k["BLOCK_R"]), k["SPLIT_C"]), args, meta)
    _shrink_group.run_config(cfg, lambda k: (c.items(k["BLOCK_M"], k["BLOCK_R"]), k["SPLIT_C"], sibs),
                             (*args, p.stride(0)), meta)


def _wgrad_group_launch(c: _Ctx, p, m, g, g_strides, goffs, arena: int) -> None:  # noqa: ANN001
    """g_{s,i}[:r_i, :] += s_i p[s][rows_i, :r_i]^T m[rows_i] for every sibling s (goffs [S, N])."""
    cols, sibs = m.shape[1], p.shape[0]
    args = (p, m, g, goffs, c.offsets, c.ranks, c.scales, c.n, cols, c.r_max, c.t_bucket, p.stride(1), m.stride(0),
            m.stride(1), *g_strides)
    meta = dict(N_P2=c.n_p2, ACC=c.acc, DOT_PREC=c.prec, ARENA=arena)
    cfg = _wgrad.choose(lambda k: (c.items(k["CHUNK"], k["BLOCK_R"]), triton.cdiv(cols, k["BLOCK_N"])), args, meta)
    _wgrad_group.run_config(cfg, lambda k: (c.items(k["CHUNK"], k["BLOCK_R"]), triton.cdiv(cols, k["BLOCK_N"]), sibs),
                            (*args, p.stride(0)), meta)


class FusedGroupArenaFn(torch.autograd.Function):
    """Sibling linears over one input on the fused kernels, arena form: one output per sibling; gradients added
    into grad_arena at the adapters' offsets (a_offs, b_offs: [S, N], row s sibling s's)."""

    @staticmethod
    def forward(ctx, x, arena, grad_arena, a_offs, b_offs, scales, ranks, offsets, r_max, token, onepass, aligned,  # noqa: D102
                *wb):
        sibs = a_offs.shape[0]
        weights, biases = wb[:sibs], wb[sibs:]
        d_in = x.shape[1]
        c = _Ctx(x, scales.shape[0], r_max, offsets, ranks, scales)
        mode = min(_arena_mode(aligned, arena, grad_arena, d_in, w.shape[0]) for w in weights)
        s_all = torch.empty((sibs, c.t, c.r_max), dtype=_acc_torch(x.dtype), device=x.device)
        if c.t == 0 or c.n == 0:
            ys = [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
        else:
            _shrink_group_launch(c, x, arena, _arena_rank_major(d_in), a_offs, s_all, mode)
            ys = [_gemm_launch(c, x, w.t(), b, s_all[s], arena, _arena_rank_major(w.shape[0]), b_offs[s], mode,
                               x.dtype, None) for s, (w, b) in enumerate(zip(weights, biases, strict=True))]
        ctx.save_for_backward(x, arena, a_offs, b_offs, scales, ranks, offsets, s_all, *weights)
        ctx.grad_arena, ctx.r_max, ctx.onepass, ctx.mode = grad_arena, r_max, onepass, mode
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):  # noqa: D102
        x, arena, a_offs, b_offs, scales, ranks, offsets, s_all, *weights = ctx.saved_tensors
        g, mode, need_x = ctx.grad_arena, ctx.mode, ctx.needs_input_grad[0]
        c = _Ctx(x, scales.shape[0], ctx.r_max, offsets, ranks, scales)
        dys = [torch.zeros((c.t, w.shape[0]), dtype=x.dtype, device=x.device) if dy is None else dy.contiguous()
               for dy, w in zip(dys, weights, strict=True)]
        if c.t == 0 or c.n == 0:
            dx = sum(dy @ w for dy, w in zip(dys, weights, strict=True)) if need_x else None
            return (dx,) + (None,) * (11 + 2 * len(weights))
        sa = _arena_rank_major(x.shape[1])
        ds_all = torch.empty_like(s_all)
        for s, (dy, w) in enumerate(zip(dys, weights, strict=True)):  # dS_s and dB_s: each its own dY_s
            sb = _arena_rank_major(w.shape[0])
            _shrink_launch(c, dy, arena, sb, b_offs[s], ds_all[s], mode,
                           wgrad=(s_all[s], g, b_offs[s]) if ctx.onepass else None)
            if not ctx.onepass:
                _wgrad_launch(c, s_all[s], dy, g, sb, b_offs[s], mode)
        # dA beside the dX GEMMs (kernels.fused_lora.DA_SIDE_STREAM), joined before the call returns; in line where
        # there is no side stream (torch.cuda.stream(None) changes nothing)
        side = _side_stream(x.device) if need_x else None
        main = torch.cuda.current_stream(x.device) if side is not None else None
        if side is not None:
            side.wait_stream(main)
        try:
            with torch.cuda.stream(side):
                _wgrad_group_launch(c, ds_all, x, g, sa, a_offs, mode)
            dx = None
            if need_x:
                for s, (dy, w) in enumerate(zip(dys, weights, strict=True)):
                    part = _gemm_launch(c, dy, w, None, ds_all[s], arena, sa, a_offs[s], mode, dy.dtype, None)
                    dx = part if dx is None else dx.add_(part)
        finally:
            if side is not None:
                main.wait_stream(side)
        return (dx,) + (None,) * (11 + 2 * len(weights))


def multilora_group_arena_fused(x, weights, biases, arena, grad_arena, a_offs, b_offs, scales, ranks, offsets,  # noqa: ANN001
                                r_max, token, onepass: bool = True, aligned: bool = False) -> tuple[torch.Tensor, ...]:
    """Sibling linears over one input `x` [T, d_in] (the fused arena form of each, `multilora_linear_arena_fused`,
    as one autograd node): weights / biases one per sibling; a_offs, b_offs [S, N] (row s: sibling s's adapters'
    offsets). Returns each sibling's output."""
    for w in weights:
        _check_arena(x, w, arena, grad_arena)
    if (len(weights) != a_offs.shape[0] or len(biases) != len(weights) or b_offs.shape != a_offs.shape
            or a_offs.dim() != 2 or a_offs.shape[1] != scales.shape[0]):
        raise ValueError(f"{len(weights)} weights, {len(biases)} biases, offsets {tuple(a_offs.shape)} / "
                         f"{tuple(b_offs.shape)}, {scales.shape[0]} adapters: one row of offsets per sibling, one "
                         "offset per adapter, one bias (or None) per sibling")
    a_offs, b_offs = a_offs.contiguous(), b_offs.contiguous()  # the kernels read row s at s * N
    return FusedGroupArenaFn.apply(x, arena, grad_arena, a_offs, b_offs, scales, ranks, offsets, r_max, token,
                                   onepass, bool(aligned), *weights, *biases)
