"""A warp-specialised persistent GEMM for Hopper, written in Gluon (Triton's explicit-layout dialect).

Why: the persistent fused GEMM + LoRA (`kernels.fused_lora._gemm_lora_persist_jit`) runs 575-605 TFLOP/s at the
200-step task's 1,536-row keys where cuBLAS runs 725-777 (bench/results/session57_h200.md). Triton 3.6 gives
Hopper no warp specialisation of its own (bench/results/session68_h200.md, `bench/ws_probe.py`), so its main loop
and epilogue take turns on the same warps. Here they do not:

- one producer warp issues every TMA load into a ring of STAGES shared-memory stages (mbarriers `ready` /
  `empty`), running ahead across tiles, epilogues included;
- "coop": one consumer partition of two warpgroups computes each 128 x 256 tile (wgmma, one in flight) and stores
  it by TMA from shared memory, the store left in flight under the next tile's main loop;
- "pingpong": two consumer partitions of one warpgroup each take every other tile of the program's walk (128 x 128
  tiles), so one's epilogue runs while the other's main loop keeps the tensor cores busy.

The walk covers the row tiles of the first `m_live` rows (a device scalar: one CUDA graph serves every step of
its shape, as the persistent kernel's walk does); the others are not written. B is [NC, K] (nn.Linear's weight,
forward: B_NK) or [K, NC] (the dX GEMM). Only the default partition may hold tensors; the workers get scalars,
descriptors and shared memory.

Measured against cuBLAS and the Triton kernel by `bench/ws_gemm_bench.py`; the LoRA epilogue is not here yet.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.devices import capability, sm_count, tma_scratch

# Triton 3.6 (the GPU image) names the TMA copies async_copy_*; 3.9 (this repo's CPU pin) removed those names for
# async_load / async_store
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

VARIANTS = {
    # name: (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, consumer warps, consumers)
    "coop": (128, 256, 64, 3, 8, 1),
    "pingpong": (128, 128, 64, 4, 4, 2),
    "pingpong_n256": (64, 256, 64, 4, 4, 2),
    "pingpong_s5": (128, 128, 64, 5, 4, 2),
    "pingpong_pf": (128, 128, 64, 4, 4, 2),
}
# variants whose consumers load the tile's first LoRA block (its first adapter's first rank block) before the main
# loop, so its latency hides there and not in the SM's last epilogue (session 70, H200: GPU tests pass; task even)
PREFETCHING = frozenset({"pingpong_pf"})


@gluon.jit
def _tile_mn(tile, num_m, num_n, GROUP_M):
    """Grouped order: GROUP_M row tiles in a row share their B tiles through L2."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m


@gluon.jit
def _walk(walk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """(row tiles, column tiles, live tiles, K steps, row tiles in all) of the walk over the live rows."""
    m_live_ptr, M, NC, K, NUM_SMS, GROUP_M, CONSUMERS = walk
    m_live = gl.minimum(gl.load(m_live_ptr).to(gl.int32), M)
    num_m = gl.cdiv(m_live, BLOCK_M)
    num_n = gl.cdiv(NC, BLOCK_N)
    return num_m, num_n, num_m * num_n, gl.cdiv(K, BLOCK_K), gl.cdiv(M, BLOCK_M)


@gluon.jit
def _producer(descs, ring, walk, lora, spec):
    """One warp: every tile's K steps in the program's walk order, each into the next ring stage once
    its consumer released it."""
    a_desc, b_desc, c_desc = descs
    a_bufs, b_bufs, c_bufs, ready, empty, turn = ring
    m_live_ptr, M, NC, K, NUM_SMS, GROUP_M, CONSUMERS = walk
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = c_bufs.type.shape[2]
    B_NK: gl.constexpr = b_bufs.type.shape[2] == BLOCK_K  # constexprs do not cross warp_specialize's arguments
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    num_m, num_n, tiles, k_steps, all_m = _walk(walk, BLOCK_M, BLOCK_N, BLOCK_K)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    c = 0
    for tile in range(gl.program_id(0), tiles, NUM_SMS):
        pm, pn = _tile_mn(tile, num_m, num_n, GROUP_M)
        m0 = pm * BLOCK_M
        n0 = pn * BLOCK_N
        for ki in range(k_steps):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            _tma_load(a_desc, [m0, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
            if B_NK:
                _tma_load(b_desc, [n0, ki * BLOCK_K], ready.index(s), b_bufs.index(s))
            else:
                _tma_load(b_desc, [ki * BLOCK_K, n0], ready.index(s), b_bufs.index(s))
            c += 1


@gluon.jit
def _lora_block(i, r0, m0, n0, NC, lora, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr):
    """Adapter i's rank block r0 of the tile's LoRA term: (s_i P[rows_i, r0:r0+BLOCK_R] as the wgmma's A operand in
    registers, W_i[r0:r0+BLOCK_R, cols] to be stored for its B operand); the P rows of other adapters and the
    ranks past r_i load as zeros (an i of no rows in the tile gives zeros)."""
    p_ptr, w_ptr, woff_ptr, off_ptr, rank_ptr, scale_ptr, bias_ptr, N, R_MAX, stride_pm, stride_wr = lora
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_N, 16])  # the consumers' accumulator
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
    rm = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, p_layout))
    rr = r0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, p_layout))
    wr = r0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, w_layout))
    wn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, w_layout))
    lo = gl.load(off_ptr + i).to(gl.int32)
    hi = gl.load(off_ptr + i + 1).to(gl.int32)
    rank = gl.minimum(gl.load(rank_ptr + i).to(gl.int32), R_MAX)
    sc = gl.load(scale_ptr + i).to(gl.float32)
    wo = gl.load(woff_ptr + i).to(gl.int64)
    pt = gl.load(p_ptr + rm.to(gl.int64)[:, None] * stride_pm + rr[None, :],
                 mask=((rm >= lo) & (rm < hi))[:, None] & (rr < rank)[None, :], other=0.0)
    wt = gl.load(w_ptr + wo + wr.to(gl.int64)[:, None] * stride_wr + wn[None, :],
                 mask=(wr < rank)[:, None] & (wn < NC)[None, :], other=0.0)
    return (pt * sc).to(w_ptr.dtype.element_ty), wt


@gluon.jit
def _lora_first(m0, lora, BLOCK_M: gl.constexpr):
    """The first adapter whose rows meet the row tile at m0 with a rank above zero (N where none does)."""
    p_ptr, w_ptr, woff_ptr, off_ptr, rank_ptr, scale_ptr, bias_ptr, N, R_MAX, stride_pm, stride_wr = lora
    first = N
    for j in range(N):
        i = N - 1 - j
        lo = gl.load(off_ptr + i)
        hi = gl.load(off_ptr + i + 1)
        if (hi > m0) & (lo < m0 + BLOCK_M) & (gl.load(rank_ptr + i) > 0):
            first = i
    return first


@gluon.jit
def _lora_term(acc, m0, n0, NC, w_tile, lora, skip, BLOCK_R: gl.constexpr):
    """acc + s_i P[rows_i, :r_i] @ W_i[:, cols] for every adapter i whose rows meet the tile (its rank blocks
    of BLOCK_R, `_lora_block`) but adapter `skip`'s first block (added already from a prefetch; N: none): W_i's
    block is stored into `w_tile` (shared memory the tile's store does not hold now) as the wgmma's B operand."""
    p_ptr, w_ptr, woff_ptr, off_ptr, rank_ptr, scale_ptr, bias_ptr, N, R_MAX, stride_pm, stride_wr = lora
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    for i in range(N):
        lo = gl.load(off_ptr + i).to(gl.int32)
        hi = gl.load(off_ptr + i + 1).to(gl.int32)
        rank = gl.minimum(gl.load(rank_ptr + i).to(gl.int32), R_MAX)
        if (hi > m0) & (lo < m0 + BLOCK_M) & (rank > 0):
            for r0 in range(gl.where(i == skip, BLOCK_R, 0), rank, BLOCK_R):
                pt, wt = _lora_block(i, r0, m0, n0, NC, lora, BLOCK_M, BLOCK_N, BLOCK_R)
                w_tile.store(wt)
                fence_async_shared()
                acc = warpgroup_mma(pt, w_tile, acc)
    return acc


@gluon.jit
def _consume(descs, ring, walk, lora, spec, WHICH: gl.constexpr):
    """The tiles WHICH, WHICH + CONSUMERS, ... of the program's walk: the main loop on the ring (one
    wgmma in flight; a stage is released once the wgmma after it has been issued and the one reading
    it retired), the LoRA term and bias, then the tile through shared memory to a TMA store left in
    flight. Then the row tiles past the live rows, stored as zeros."""
    a_desc, b_desc, c_desc = descs
    a_bufs, b_bufs, c_bufs, ready, empty, turn = ring
    m_live_ptr, M, NC, K, NUM_SMS, GROUP_M, CONSUMERS = walk
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = c_bufs.type.shape[2]
    B_NK: gl.constexpr = b_bufs.type.shape[2] == BLOCK_K  # constexprs do not cross warp_specialize's arguments
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    HAS_BIAS: gl.constexpr = spec.type.shape[0] % 3 == 2  # the spec's rows: (1 + HAS_BIAS) * (1 + 3 * PREFETCH)
    PREFETCH: gl.constexpr = spec.type.shape[0] > 2
    BLOCK_R: gl.constexpr = spec.type.shape[1]  # 1: no LoRA term
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    c_buf = c_bufs.index(WHICH)
    num_m, num_n, tiles, k_steps, all_m = _walk(walk, BLOCK_M, BLOCK_N, BLOCK_K)
    local = WHICH
    mine = 0
    for tile in range(gl.program_id(0) + WHICH * NUM_SMS, tiles, NUM_SMS * CONSUMERS):
        pm, pn = _tile_mn(tile, num_m, num_n, GROUP_M)
        c = local * k_steps
        # two consumers share the ring: this main loop starts once the other's (the walk's tile before) has
        # taken its last stage, so no wait below runs a whole ring phase ahead (an mbarrier tells phases by parity)
        mbarrier.wait(turn.index(WHICH), (mine + WHICH + 1) & 1, pred=(CONSUMERS > 1) & (mine + WHICH > 0))
        skip = lora[7]  # N: no block prefetched
        if PREFETCH and BLOCK_R > 1:
            skip = _lora_first(pm * BLOCK_M, lora, BLOCK_M)
            first = gl.maximum(gl.minimum(skip, lora[7] - 1), 0)
            pre_p, pre_w = _lora_block(first, 0, pm * BLOCK_M, pn * BLOCK_N, NC, lora, BLOCK_M, BLOCK_N, BLOCK_R)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        for ki in range(k_steps):
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            if B_NK:
                b = b_bufs.index(s).permute((1, 0))
            else:
                b = b_bufs.index(s)
            acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1, pred=ki > 0)
            c += 1
        mbarrier.arrive(turn.index(1 - WHICH), count=1, pred=CONSUMERS > 1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1)
        tma.store_wait(0)  # the last tile's store has left c_buf
        if BLOCK_R > 1:
            w_tile = c_buf.slice(0, BLOCK_R, dim=0)
            if PREFETCH:
                if skip < lora[7]:
                    w_tile.store(pre_w)
                    fence_async_shared()
                    acc = warpgroup_mma(pre_p, w_tile, acc)
            acc = _lora_term(acc, pm * BLOCK_M, pn * BLOCK_N, NC, w_tile, lora, skip, BLOCK_R)
        if HAS_BIAS:
            bias_ptr = lora[6]
            cols = pn * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            acc = acc + gl.load(bias_ptr + cols, mask=cols < NC, other=0.0).to(gl.float32)[None, :]
        c_buf.store(acc.to(c_desc.dtype))
        fence_async_shared()
        _tma_store(c_desc, [pm * BLOCK_M, pn * BLOCK_N], c_buf)
        local += CONSUMERS
        mine += 1
    dead = (all_m - num_m) * num_n
    first = gl.program_id(0) + WHICH * NUM_SMS
    if first < dead:  # padding no adapter owns: zeros (what the persistent kernel stores there)
        tma.store_wait(0)
        c_buf.store(gl.zeros([BLOCK_M, BLOCK_N], c_desc.dtype, acc_layout))
        fence_async_shared()
        for pad in range(first, dead, NUM_SMS * CONSUMERS):
            _tma_store(c_desc, [(num_m + pad // num_n) * BLOCK_M, (pad % num_n) * BLOCK_N], c_buf)
    tma.store_wait(0)


@gluon.jit
def _consume_first(descs, ring, walk, lora, spec):
    """The first consumer: the default partition (the kernel's num_warps)."""
    _consume(descs, ring, walk, lora, spec, 0)


@gluon.jit
def _consume_other(descs, ring, walk, lora, spec):
    """The second consumer (a worker partition: one warpgroup)."""
    _consume(descs, ring, walk, lora, spec, 1)


@gluon.jit
def _ws_gemm_jit(a_ptr, b_ptr, c_ptr, bias_ptr, p_ptr, w_ptr, woff_ptr, off_ptr, rank_ptr, scale_ptr, m_live_ptr,
                 M, NC, K, N, R_MAX, stride_am, stride_b, stride_cm, stride_pm, stride_wr,
                 B_NK: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_R: gl.constexpr, PREFETCH: gl.constexpr,
                 NUM_SMS: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                 GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                 CONSUMER_REGS: gl.constexpr):
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    if B_NK:
        b_block: gl.constexpr = [BLOCK_N, BLOCK_K]
        b_shape = [NC, K]
    else:
        b_block: gl.constexpr = [BLOCK_K, BLOCK_N]
        b_shape = [K, NC]
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(b_block, dtype)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], c_ptr.dtype.element_ty)
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K], a_layout)
    b_desc = tma.make_tensor_descriptor(b_ptr, b_shape, [stride_b, 1], b_block, b_layout)
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, NC], [stride_cm, 1], [BLOCK_M, BLOCK_N], c_layout)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_block, b_layout)
    c_bufs = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [CONSUMERS, BLOCK_M, BLOCK_N], c_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # the partitions' constants, carried by a shape (constexprs do not cross warp_specialize's arguments)
    spec = gl.allocate_shared_memory(gl.int8, [(1 + HAS_BIAS) * (1 + 3 * PREFETCH), BLOCK_R],
                                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    descs = (a_desc, b_desc, c_desc)
    ring = (a_bufs, b_bufs, c_bufs, ready, empty, turn)
    walk = (m_live_ptr, M, NC, K, NUM_SMS, GROUP_M, CONSUMERS)
    lora = (p_ptr, w_ptr, woff_ptr, off_ptr, rank_ptr, scale_ptr, bias_ptr, N, R_MAX, stride_pm, stride_wr)
    args = (descs, ring, walk, lora, spec)
    if CONSUMERS == 1:
        gl.warp_specialize([(_consume_first, args), (_producer, args)], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consume_first, args), (_consume_other, args), (_producer, args)],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def serves(device: torch.device) -> bool:
    """Whether this kernel runs on `device`: sm_90 (Hopper's wgmma and TMA; Blackwell has neither wgmma)."""
    return capability(device) == (9, 0)


def ws_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, b_nk: bool, m_live: torch.Tensor,
            variant: str = "coop", bias: torch.Tensor | None = None, lora: tuple | None = None,
            group_m: int = 8, num_sms: int | None = None) -> torch.Tensor:
    """out[:m_live] = a[:m_live] @ (b.T if b_nk else b) (+ bias) (+ the LoRA term), the rows past m_live's row
    tiles zero; a [M, K], b [NC, K] or [K, NC], unit last strides, 16-byte aligned rows; m_live a one-element
    integer device tensor. lora = (p [M, >= r_max] fp32, w arena, woff [N], offsets [N + 1], ranks [N], scales [N],
    r_max, block_r): adapter i adds scales[i] p[offsets[i]:offsets[i+1], :r_i] @ W_i, W_i the [r_i, NC] rows of the
    arena at woff[i]."""
    bm, bn, bk, stages, warps, consumers = VARIANTS[variant]
    m, k = a.shape
    nc = b.shape[0] if b_nk else b.shape[1]
    grid = (num_sms or sm_count(a.device),)  # one program an SM whatever the rows: one compile a shape class
    if lora is None:
        p = w = woff = offsets = ranks = scales = out
        n = r_max = stride_pm = 0
        block_r = 1
    else:
        p, w, woff, offsets, ranks, scales, r_max, block_r = lora
        n, stride_pm = ranks.numel(), p.stride(0)
    triton.set_allocator(tma_scratch)  # the descriptors' scratch (a context variable: set in the launching thread)
    _ws_gemm_jit[grid](a, b, out, bias if bias is not None else out, p, w, woff, offsets, ranks, scales, m_live,
                       m, nc, k, n, r_max, a.stride(0), b.stride(0), out.stride(0), stride_pm, nc,
                       B_NK=b_nk, HAS_BIAS=bias is not None, BLOCK_R=block_r, PREFETCH=variant in PREFETCHING,
                       NUM_SMS=grid[0], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, GROUP_M=group_m,
                       CONSUMERS=consumers, PRODUCER_REGS=40, CONSUMER_REGS=232, num_warps=warps, maxnreg=168)
    return out
