"""The Triton kernels (both forms) compiled for Hopper (sm_90) on a machine without a GPU.

The interpreter tests run the kernels' arithmetic but never the compiler; this one runs Triton's
real NVIDIA pipeline ahead of time (ptxas ships in the triton wheel) with the specialisation the
runtime would apply to the benchmark's shapes (unit strides as constants, 16-divisible ints and
pointers marked so), and checks what decides speed: the GEMMs use wgmma and a multi-stage
pipeline, the TMA and persistent variants issue tensor-descriptor copies, nothing spills to local
memory.
Uses triton.compile / ASTSource (internal API): if a Triton upgrade changes them, update _compile.
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
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.fused_lora as fl
import kernels.triton_lora as tlr
from kernels.testing import cubin_local_bytes

target = GPUTarget("cuda", 90, 32)


def _compile(fn, args, consts, warps, stages):
    sig, cx, attrs = {}, dict(consts), {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        v = args[name]
        if isinstance(v, str):                      # a pointer (torch allocations are 16-aligned)
            sig[name] = v
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif v == 1:                                # the runtime turns ints equal to 1 into constants
            sig[name] = "constexpr"
            cx[name] = 1
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs), target=target,
                       options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    local = cubin_local_bytes(k.asm["cubin"], sys.argv[1])
    return {"shared": k.metadata.shared, "wgmma": "wgmma" in ptx, "tma": "cp.async.bulk.tensor" in ptx,
            "local": local, "scalar16": len(re.findall(r"ld\.global(?:\.[a-z]+)*\.[bu]16 ", ptx))}


P = "*bf16"
T, DI, DO, R = 8192, 4096, 14336, 64
base = dict(a_ptr=P, b_ptr=P, c_ptr=P, bias_ptr=P, p_ptr="*fp32", w_ptr=P, woff_ptr="*i64", off_ptr="*i64",
            rank_ptr="*i32", scale_ptr="*fp32", M=T, K=DI, N=8, R_MAX=R, T_BUCKET=T, stride_pm=R, stride_wn=0,
            stride_cn=1, stride_wc=1)
fwd = dict(base, NC=DO, stride_am=DI, stride_ak=1, stride_bk=1, stride_bn=DI, stride_cm=DO, stride_wr=DO)
dxg = dict(base, NC=DI, K=DO, stride_am=DO, stride_ak=1, stride_bk=DI, stride_bn=1, stride_cm=DI, stride_wr=DI)
meta = dict(N_P2=16, ACC=tl.float32, DOT_PREC="tf32", ARENA=True, PREFETCH=False)
res = {}
for name, args in (("fwd", fwd), ("dx", dxg)):
    for cfg in fl._GEMM_CONFIGS[:3]:  # 128x256 in 3 and 4 stages, 256x128
        kw = dict(cfg.kwargs) | fl._gemm_rank_tile(R)
        res[f"gemm {name} {kw['BLOCK_M']}x{kw['BLOCK_N']} s{cfg.num_stages}"] = _compile(
            fl._gemm_lora_jit, args, dict(meta, HAS_BIAS=name == "fwd", **kw), cfg.num_warps, cfg.num_stages)
    no_ak = {k: v for k, v in args.items() if k != "stride_ak"}
    kw = dict(fl._GEMM_CONFIGS[0].kwargs) | fl._gemm_rank_tile(R)
    res[f"gemm tma {name}"] = _compile(fl._gemm_lora_tma_jit, no_ak, dict(meta, HAS_BIAS=False, B_NK=name == "fwd",
                                       NUM_SMS=132, **kw), 8, 3)
    # the default on Hopper: persistent programs over a flattened tile loop (and its +pf form)
    res[f"gemm persist {name}"] = _compile(fl._gemm_lora_persist_jit, no_ak, dict(
        meta, HAS_BIAS=False, B_NK=name == "fwd", NUM_SMS=132, **kw), 8, 3)
    res[f"gemm persist+pf {name}"] = _compile(fl._gemm_lora_persist_jit, no_ak, dict(
        meta, HAS_BIAS=False, B_NK=name == "fwd", NUM_SMS=132, **kw) | {"PREFETCH": True}, 8, 3)
    if name == "fwd":  # with a bias (a biased projection's forward: its stores and its padding's zeros)
        res["gemm persist bias fwd"] = _compile(fl._gemm_lora_persist_jit, no_ak, dict(
            meta, HAS_BIAS=True, B_NK=True, NUM_SMS=132, **kw), 8, 3)
    # the epilogue with a rank tile of 64 (one block for a rank-64 adapter; the kernel takes any)
    res[f"gemm persist r64 {name}"] = _compile(fl._gemm_lora_persist_jit, no_ak, dict(
        meta, HAS_BIAS=False, B_NK=name == "fwd", NUM_SMS=132, **(kw | {"BLOCK_R": 64})), 8, 3)
# the small-step tiles (appended candidates: kernels.fused_lora._SMALL_GEMM), forward, persistent as on Hopper
for cfg in fl._SMALL_GEMM:
    kw = dict(cfg.kwargs) | fl._gemm_rank_tile(R)
    res[f"gemm small {kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}"] = _compile(
        fl._gemm_lora_persist_jit, {k: v for k, v in fwd.items() if k != "stride_ak"},
        dict(meta, HAS_BIAS=False, B_NK=True, NUM_SMS=132, **kw), cfg.num_warps, cfg.num_stages)
no_pf = {k: v for k, v in meta.items() if k != "PREFETCH"}  # kernels without the GEMM epilogue
shr = dict(m_ptr=P, w_ptr=P, p_ptr="*fp32", woff_ptr="*i64", off_ptr="*i64", rank_ptr="*i32", s_ptr="*fp32",
           g_ptr="*fp32", goff_ptr="*i64", scale_ptr="*fp32", N=8, C=DO, R_MAX=R, T_BUCKET=T, stride_mm=DO,
           stride_mc=1, stride_wn=0, stride_wr=DO, stride_wc=1, stride_pm=R, stride_sm=R)
for fuse in (False, True):
    for cfg in (fl._SHRINK_CONFIGS[0], fl._SHRINK_CONFIGS[-1]):  # rank tile 16; rank tile 64, column split
        res[f"shrink fuse_db={fuse} r{cfg.kwargs['BLOCK_R']}"] = _compile(
            fl._shrink_jit, shr, dict(no_pf, FUSE_WGRAD=fuse, **cfg.kwargs), cfg.num_warps, cfg.num_stages)
wg = dict(p_ptr="*fp32", m_ptr=P, g_ptr="*fp32", goff_ptr="*i64", off_ptr="*i64", rank_ptr="*i32",
          scale_ptr="*fp32", N=8, C=DI, R_MAX=R, T_BUCKET=T, stride_pm=R, stride_mm=DI, stride_mc=1, stride_gn=0,
          stride_gr=DI, stride_gc=1)
cfg = fl._SMALL_SHRINK[2]  # 16 column splits
res["shrink small split16"] = _compile(fl._shrink_jit, shr, dict(no_pf, FUSE_WGRAD=True, **cfg.kwargs), cfg.num_warps,
                                       cfg.num_stages)
for cfg in (fl._WGRAD_CONFIGS[0], fl._WGRAD_CONFIGS[-1], fl._SMALL_WGRAD[-1]):
    name = f"wgrad r{cfg.kwargs['BLOCK_R']} chunk{cfg.kwargs['CHUNK']} m{cfg.kwargs['BLOCK_M']}"
    res[name] = _compile(fl._wgrad_jit, wg, dict(no_pf, **cfg.kwargs), cfg.num_warps, cfg.num_stages)
# the composition's kernels (kernels.triton_lora), which share the shrink sweep with the fused form
cmp_args = dict(x_ptr=P, a_ptr=P, b_ptr=P, y_ptr=P, s_ptr="*fp32", dy_ptr=P, dx_ptr=P, da_ptr="*fp32",
                db_ptr="*fp32", off_ptr="*i64", rank_ptr="*i32", scale_ptr="*fp32", aoff_ptr="*i64", boff_ptr="*i64",
                N=8, K=DI, D_OUT=DO, R_MAX=R, T_BUCKET=T, stride_xm=DI, stride_xk=1, stride_an=0, stride_ak=1,
                stride_ar=DI, stride_bn=0, stride_br=DO, stride_bo=1, stride_ym=DO, stride_yn=1, stride_sm=R,
                stride_dym=DO, stride_dyn=1, stride_dxm=DI, stride_dxk=1)
cfg = tlr._FWD_CONFIGS[0]
res["compose fwd"] = _compile(tlr._fwd_jit, cmp_args, dict(no_pf, BLOCK_R=R, **cfg.kwargs), cfg.num_warps,
                              cfg.num_stages)
cfg = tlr._BWD_CONFIGS[0]
res["compose bwd"] = _compile(tlr._bwd_jit, cmp_args, dict(no_pf, BLOCK_R=R, COMPUTE_DX=True, COMPUTE_DA=True,
                              COMPUTE_DB=True, **cfg.kwargs), cfg.num_warps, cfg.num_stages)
# arena offsets the caller vouches are 16-element aligned (ARENA=16): the adapters' rows load as vectors
for mode in (1, 16):
    kw = dict(fl._GEMM_CONFIGS[0].kwargs) | fl._gemm_rank_tile(R)
    res[f"gemm persist arena{mode}"] = _compile(fl._gemm_lora_persist_jit, {k: v for k, v in fwd.items() if k != "stride_ak"},
                                                dict(meta, ARENA=mode, HAS_BIAS=False, B_NK=True, NUM_SMS=132, **kw), 8, 3)
    cfg = fl._SHRINK_CONFIGS[0]
    res[f"shrink arena{mode}"] = _compile(fl._shrink_jit, shr, dict(no_pf, ARENA=mode, FUSE_WGRAD=True, **cfg.kwargs),
                                          cfg.num_warps, cfg.num_stages)
# fp32 inputs run one small config per kernel (`triton_lora.wide_dtype_pruner`): FMA code, no tensor cores
F32 = "*fp32"
f32 = {k: (F32 if v == P else v) for k, v in fwd.items()}
cfg = fl._GEMM_WIDE
res["wide gemm fp32"] = _compile(fl._gemm_lora_persist_jit, {k: v for k, v in f32.items() if k != "stride_ak"},
                                 dict(meta, DOT_PREC="ieee", HAS_BIAS=False, B_NK=True, NUM_SMS=132,
                                      **(cfg.kwargs | fl._gemm_rank_tile(R))), cfg.num_warps, cfg.num_stages)
cfg = fl._SHRINK_WIDE
res["wide shrink fp32"] = _compile(fl._shrink_jit, {k: (F32 if v == P else v) for k, v in shr.items()},
                                   dict(no_pf, DOT_PREC="ieee", FUSE_WGRAD=True, **cfg.kwargs), cfg.num_warps,
                                   cfg.num_stages)
cfg = fl._WGRAD_WIDE
res["wide wgrad fp32"] = _compile(fl._wgrad_jit, {k: (F32 if v == P else v) for k, v in wg.items()},
                                  dict(no_pf, DOT_PREC="ieee", **cfg.kwargs), cfg.num_warps, cfg.num_stages)
print("RESULT" + json.dumps(res))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.path.exists(os.path.join(_BIN, "ptxas")), reason="triton without its NVIDIA ptxas")
def test_kernels_compile_for_hopper() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real compiler, not the interpreter
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-c", _WORKER, _BIN], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    # + persist r64 fwd/dx, shrink r64 x2, wgrad r64, the arena's two modes x2, fp32's small configs
    # + the small-step tiles: 3 GEMMs, a shrink of 16 column splits, a weight gradient of 256-row chunks
    # + the persistent GEMM's forward with a bias (dX has none: its compile is "gemm persist dx")
    assert len(res) == 17 + 2 + 2 + 1 + 4 + 3 + 5 + 1
    # unknown arena offsets: the adapters' bf16 rows load one element at a time; vouched-for
    # 16-element offsets: none does (16-byte vectors)
    assert res["gemm persist arena1"]["scalar16"] > 0 and res["shrink arena1"]["scalar16"] > 0
    assert res["gemm persist arena16"]["scalar16"] == 0 and res["shrink arena16"]["scalar16"] == 0
    for name, r in res.items():
        assert r["local"] in (0, None), f"{name} spills to local memory: {r}"
        if name.startswith("gemm"):
            assert r["wgmma"], f"{name} does not use wgmma: {r}"
            assert r["shared"] >= 2 * 128 * 64 * 2 * 2, f"{name} is not pipelined (shared {r['shared']} B)"
            assert r["shared"] <= 227 * 1024, f"{name} needs more shared memory than an H100 SM has: {r}"
    assert res["gemm tma fwd"]["tma"] and res["gemm tma dx"]["tma"]
    assert all(res[f"gemm persist{pf} {d}"]["tma"] for pf in ("", "+pf") for d in ("fwd", "dx"))
    assert res["gemm persist bias fwd"]["tma"]
    assert not res["gemm fwd 128x256 s3"]["tma"]
