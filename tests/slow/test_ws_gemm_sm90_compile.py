"""The warp-specialised Gluon GEMM (kernels/ws_gemm.py) compiled for Hopper (sm_90) on a machine without a GPU.

Gluon has no interpreter, so this is the CPU's evidence that every variant still builds with the installed Triton
(the GPU image's 3.6 names the TMA copies differently from 3.9: the module picks either), in the form that decides
its speed: separate partitions with their own register budgets (setmaxnreg), TMA loads and stores, wgmma, the
LoRA term's extra wgmmas, shared memory within an SM's 227 KiB, nothing spilled to local memory. Its numbers come
from the device (tests/gpu/test_ws_gemm_gpu.py, bench/ws_gemm_bench.py). Uses triton.compile with the Gluon AST
source (internal API): if a Triton upgrade changes it, update the worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

_WORKER = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kernels import ws_gemm as W
from kernels.testing import cubin_local_bytes

PTRS = dict(p_ptr="*fp32", woff_ptr="*i64", off_ptr="*i64", rank_ptr="*i64", scale_ptr="*fp32", m_live_ptr="*i64")
res = {}
for variant, (bm, bn, bk, stages, warps, consumers) in W.VARIANTS.items():
    for b_nk, block_r, bias in ((True, 1, False), (False, 32, True), (True, 16, False)):
        consts = dict(B_NK=b_nk, HAS_BIAS=bias, BLOCK_R=block_r, PREFETCH=variant in W.PREFETCHING, NUM_SMS=132,
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, GROUP_M=8, CONSUMERS=consumers,
                      PRODUCER_REGS=40, CONSUMER_REGS=232)
        sig, attrs = {}, {}
        for i, name in enumerate(W._ws_gemm_jit.arg_names):
            if name in consts:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = PTRS.get(name, "*bf16")
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[name] = "i32"
                if name not in ("M", "N", "R_MAX"):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        k = triton.compile(GluonASTSource(fn=W._ws_gemm_jit, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "maxnreg": 168})
        ptx = k.asm["ptx"]
        local = cubin_local_bytes(k.asm["cubin"], sys.argv[1])
        res[f"{variant} b_nk={b_nk} r={block_r} bias={bias}"] = dict(
            shared=k.metadata.shared, wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
            setmaxnreg=len(re.findall(r"setmaxnreg", ptx)), tma_load="cp.async.bulk.tensor.2d.shared" in ptx,
            tma_store="cp.async.bulk.tensor.2d.global.shared" in ptx, local=local, consumers=consumers, bm=bm,
            warps=warps)
print("RESULT" + json.dumps(res))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.path.exists(os.path.join(_BIN, "ptxas")), reason="triton without its NVIDIA ptxas")
def test_every_variant_compiles_for_hopper_warp_specialised() -> None:
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-c", _WORKER, _BIN], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    from kernels import ws_gemm

    assert len(res) == 3 * len(ws_gemm.VARIANTS)
    for name, r in res.items():
        assert r["local"] in (0, None), f"{name} spills to local memory: {r}"
        assert r["setmaxnreg"] > 0, f"{name} has no partitions of their own register budget: {r}"
        assert r["tma_load"] and r["tma_store"], f"{name} does not load and store by TMA: {r}"
        assert r["shared"] <= 227 * 1024, f"{name} needs more shared memory than an H100 SM has: {r}"
        # a main loop step (BLOCK_K 64: four k16 steps) in each consumer's code: one m64 wgmma per warpgroup's 64
        # rows, a consumer of two warpgroups issuing the same instructions for its two halves
        main = 4 * (r["bm"] // 64) * r["consumers"] // (r["warps"] // 4)
        assert r["wgmma"] >= main, f"{name}: {r['wgmma']} wgmma instructions, expected at least {main}"
    for variant in ws_gemm.VARIANTS:  # the LoRA term adds its own wgmmas (A from registers)
        assert res[f"{variant} b_nk=False r=32 bias=True"]["wgmma"] > res[f"{variant} b_nk=True r=1 bias=False"]["wgmma"]
