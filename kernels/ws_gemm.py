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

VARIANTS = {
    # name: (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, consumer warps, consumers)
    "coop": (128, 256, 64, 3, 8, 1),
    "pingpong": (128, 128, 64, 4, 4, 2),
    "pingpong_n256": (64, 256, 64, 4, 4, 2),
}


@gluon.jit
def _tile_mn(tile, num_m, num_n, GROUP_M: gl.constexpr):
    """Grouped order: GROUP_M row tiles in a row share their B tiles through L2."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m


@gluon.jit
def _walk(m_live_ptr, NC, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    m_live = gl.load(m_live_ptr)
    num_m = gl.cdiv(m_live, BLOCK_M)
    num_n = gl.cdiv(NC, BLOCK_N)
    return num_m, num_n, num_m * num_n, gl.cdiv(K, BLOCK_K)


@gluon.jit
def _producer(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, m_live_ptr, NC, K,
              NUM_SMS, B_NK_ARG, GROUP_M, CONSUMERS):
    """One warp: every tile's K steps in the program's walk order, each into the next ring stage once
    its consumer released it."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = c_bufs.type.shape[2]
    B_NK: gl.constexpr = b_bufs.type.shape[2] == BLOCK_K  # constexprs do not cross warp_specialize's arguments
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    num_m, num_n, tiles, k_steps = _walk(m_live_ptr, NC, K, BLOCK_M, BLOCK_N, BLOCK_K)
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
            tma.async_copy_global_to_shared(a_desc, [m0, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
            if B_NK:
                tma.async_copy_global_to_shared(b_desc, [n0, ki * BLOCK_K], ready.index(s), b_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(b_desc, [ki * BLOCK_K, n0], ready.index(s), b_bufs.index(s))
            c += 1


@gluon.jit
def _consume(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, m_live_ptr, NC, K,
             NUM_SMS, B_NK_ARG, GROUP_M, CONSUMERS, WHICH: gl.constexpr):
    """The tiles WHICH, WHICH + CONSUMERS, ... of the program's walk: the main loop on the ring (one
    wgmma in flight; a stage is released once the wgmma after it has been issued and the one reading
    it retired), then the tile through shared memory to a TMA store left in flight."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = c_bufs.type.shape[2]
    B_NK: gl.constexpr = b_bufs.type.shape[2] == BLOCK_K  # constexprs do not cross warp_specialize's arguments
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    c_buf = c_bufs.index(WHICH)
    num_m, num_n, tiles, k_steps = _walk(m_live_ptr, NC, K, BLOCK_M, BLOCK_N, BLOCK_K)
    local = WHICH
    mine = 0
    for tile in range(gl.program_id(0) + WHICH * NUM_SMS, tiles, NUM_SMS * CONSUMERS):
        pm, pn = _tile_mn(tile, num_m, num_n, GROUP_M)
        c = local * k_steps
        # two consumers share the ring: this main loop starts once the other's (the walk's tile before) has
        # taken its last stage, so no wait below runs a whole ring phase ahead (an mbarrier tells phases by parity)
        mbarrier.wait(turn.index(WHICH), (mine + WHICH + 1) & 1, pred=(CONSUMERS > 1) & (mine + WHICH > 0))
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
        c_buf.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [pm * BLOCK_M, pn * BLOCK_N], c_buf)
        local += CONSUMERS
        mine += 1
    tma.store_wait(0)


@gluon.jit
def _consume_first(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, m_live_ptr, NC, K, NUM_SMS,
                   B_NK, GROUP_M, CONSUMERS):
    """The first consumer: the default partition (the kernel's num_warps)."""
    _consume(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, m_live_ptr, NC, K, NUM_SMS, B_NK,
             GROUP_M, CONSUMERS, 0)


@gluon.jit
def _consume_other(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, m_live_ptr, NC, K, NUM_SMS,
                   B_NK, GROUP_M, CONSUMERS):
    """The second consumer (a worker partition: one warpgroup)."""
    _consume(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, m_live_ptr, NC, K, NUM_SMS, B_NK,
             GROUP_M, CONSUMERS, 1)


@gluon.jit
def _ws_gemm_jit(a_ptr, b_ptr, c_ptr, m_live_ptr, M, NC, K, stride_am, stride_b, stride_cm,
                 B_NK: gl.constexpr, NUM_SMS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr,
                 PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
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
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    args = (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, turn, m_live_ptr, NC, K, NUM_SMS, B_NK,
            GROUP_M, CONSUMERS)
    if CONSUMERS == 1:
        gl.warp_specialize([(_consume_first, args), (_producer, args)], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consume_first, args), (_consume_other, args), (_producer, args)],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def ws_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, b_nk: bool, m_live: torch.Tensor,
            variant: str = "coop", group_m: int = 8, num_sms: int | None = None) -> torch.Tensor:
    """out[:m_live] = a[:m_live] @ (b.T if b_nk else b); a [M, K], b [NC, K] or [K, NC], unit last strides,
    16-byte aligned rows; m_live a one-element int32 device tensor."""
    bm, bn, bk, stages, warps, consumers = VARIANTS[variant]
    m, k = a.shape
    nc = b.shape[0] if b_nk else b.shape[1]
    sms = num_sms or _num_sms(a.device)
    grid = (min(sms, triton.cdiv(m, bm) * triton.cdiv(nc, bn)),)
    from kernels.fused_lora import _scratch

    triton.set_allocator(_scratch)  # the descriptors' global scratch (a context variable: set in the launching thread)
    _ws_gemm_jit[grid](a, b, out, m_live, m, nc, k, a.stride(0), b.stride(0), out.stride(0),
                       B_NK=b_nk, NUM_SMS=grid[0], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages,
                       GROUP_M=group_m, CONSUMERS=consumers, PRODUCER_REGS=40, CONSUMER_REGS=232,
                       num_warps=warps, maxnreg=168)
    return out
