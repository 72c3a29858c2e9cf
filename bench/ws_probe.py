"""Does `tl.range(..., warp_specialize=True)` change a Hopper (sm_90) kernel? (issue 40, session 68)

Compiles one persistent TMA matmul (bf16, 128 x 256 x 64 tiles, the shape of the fused GEMM's main loop) for
sm_90 on this machine (no GPU: Triton's own ptxas), with the loop's warp_specialize off and on, and prints what
a warp-specialized kernel would show: `setmaxnreg` (the partitions' register split), wgmma count, and whether the
two PTX texts differ once the debug lines are stripped. Triton 3.6 (the GPU image's) routes sm_90 to its Hopper
warp-specialization pass; in session 68 the PTX came out the same at 4 and 8 warps, so a warp-specialized Hopper
GEMM needs Gluon's explicit partitions. Run it under the Triton to check (e.g. PYTHONPATH=<an unpacked 3.6 wheel>).

    python3 bench/ws_probe.py [--warps 8] [--stages 3]
"""

from __future__ import annotations

import argparse
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _mm_persistent(a_ptr, b_ptr, c_ptr, M, N, K, NUM_SMS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WS: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    n_m = tl.cdiv(M, BLOCK_M)
    tiles = n_m * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=True, warp_specialize=WS):
        pm = tile % n_m
        pn = tile // n_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(tl.cdiv(K, BLOCK_K)):
            acc = tl.dot(a_desc.load([pm * BLOCK_M, kk * BLOCK_K]), b_desc.load([pn * BLOCK_N, kk * BLOCK_K]).T, acc)
        c_desc.store([pm * BLOCK_M, pn * BLOCK_N], acc.to(tl.bfloat16))


def compile_ptx(ws: bool, warps: int, stages: int) -> str:
    names = _mm_persistent.arg_names
    consts = {"NUM_SMS": 132, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "WS": ws}
    sig = {n: ("constexpr" if n in consts else "*bf16" if n.endswith("_ptr") else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in consts and n != "M"}
    src = ASTSource(fn=_mm_persistent, signature=sig, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    return kernel.asm["ptx"]


def _code(ptx: str) -> list[str]:
    return [line for line in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|//)", line)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--stages", type=int, default=3)
    args = ap.parse_args()
    ptx = {ws: compile_ptx(ws, args.warps, args.stages) for ws in (False, True)}
    print(f"triton {triton.__version__}, sm_90, {args.warps} warps, {args.stages} stages")
    for ws, text in ptx.items():
        print(f"warp_specialize={ws}: setmaxnreg {text.count('setmaxnreg')}, "
              f"wgmma {len(re.findall(r'wgmma.mma_async', text))}, lines {len(_code(text))}")
    print("PTX the same without debug lines:", _code(ptx[False]) == _code(ptx[True]))


if __name__ == "__main__":
    main()
