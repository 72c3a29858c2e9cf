"""The fused Triton form of the multi-LoRA operator (kernels.fused_lora) on CPU, under Triton's
interpreter (TRITON_INTERPRET=1): forward and backward vs the fp64 oracle, stacked and arena forms,
mixed and non-power-of-two ranks, empty segments, gradients added to prior sums, the per-adapter
rank work list, and the form dispatch (fused / compose / auto from measured timings).

Each test starts a subprocess so the interpreter flag never leaks into other tests' triton use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_WORKER = r"""
import json, random, sys, torch
from kernels import multilora_linear, multilora_linear_arena
from kernels.fused_lora import multilora_linear_arena_fused, multilora_linear_fused
from kernels.testing import (make_case, oracle_fp64, run_op, run_arena, rel_errors, padding_grad_nonzero,
                             empty_adapter_grad_nonzero)
random.seed()
out = []


def record(name, c, got, stray=0, dtype=None):
    want = oracle_fp64(c)
    if got.get("dx") is None:
        got = {**got, "dx": want["dx"]}
    out.append({"case": name + " " + c.describe(), "dtype": str(dtype or c.x.dtype), "errs": rel_errors(got, want),
                "pad_nonzero": padding_grad_nonzero(got, c.ranks),
                "empty_nonzero": empty_adapter_grad_nonzero(got, c.offsets), "stray": stray})


cases = [
    # counts, ranks, d_in, d_out, dtype, bias, onepass
    ([5, 0, 17, 33, 1], [8, 16, 64, 8, 16], 40, 24, torch.float32, True, True),
    ([37], [16], 24, 40, torch.float64, False, False),
    ([9, 20, 0, 3], [24, 40, 8, 17], 30, 35, torch.float64, True, True),      # ranks not powers of two
    ([0, 0, 9, 0], [64, 8, 16, 8], 33, 17, torch.float32, True, False),
    ([0, 0, 0], [8, 16, 64], 21, 13, torch.float64, False, True),              # T = 0
    ([random.choice([0, 1, 2, 5, 19]) for _ in range(8)], [random.choice([8, 16, 24, 64]) for _ in range(8)],
     20, 36, torch.float64, True, True),
]
core = sys.argv[1] == "core"  # the second tile setting reruns only the first operator cases
for counts, ranks, d_in, d_out, dtype, bias, onepass in cases[:3] if core else cases:
    c = make_case(counts, ranks, d_in, d_out, dtype=dtype, bias=bias)
    record(f"stacked onepass={onepass}", c, run_op(c, multilora_linear_fused, onepass=onepass))
    got, stray = run_arena(c, multilora_linear_arena_fused, onepass=onepass)
    record(f"arena onepass={onepass}", c, got, stray)
if core:
    print("RESULT" + json.dumps({"results": out}))
    raise SystemExit(0)
# the engine's first layer: x needs no gradient (no dX GEMM), the arena still gets dA and dB
c = make_case([6, 0, 11, 4], [16, 8, 64, 24], 21, 18, dtype=torch.float64)
got, stray = run_arena(c, multilora_linear_arena_fused, x_grad=False)
record("arena x frozen", c, got, stray)
# partial needs in the stacked form: B frozen (dB skipped), then x frozen
want = oracle_fp64(c)
x, a, b = c.x.clone().requires_grad_(), c.lora_a.clone().requires_grad_(), c.lora_b.clone()
multilora_linear_fused(x, c.weight, c.bias, a, b, c.scales, c.ranks, c.offsets).backward(c.dy)
ea = ((a.grad - want["dA"]).norm() / want["dA"].norm()).item()
ex = ((x.grad - want["dx"]).norm() / want["dx"].norm()).item()
x, a, b = c.x.clone(), c.lora_a.clone(), c.lora_b.clone().requires_grad_()
multilora_linear_fused(x, c.weight, c.bias, a, b, c.scales, c.ranks, c.offsets).backward(c.dy)
eb = ((b.grad - want["dB"]).norm() / want["dB"].norm()).item()
out.append({"case": "partial needs " + c.describe(), "dtype": "torch.float64", "errs": {"dA": ea, "dx": ex, "dB": eb},
            "pad_nonzero": 0, "empty_nonzero": 0, "stray": 0})
# non-contiguous x and lora_a (strides honoured), non-contiguous lora_b (one-pass dB strides)
c = make_case([9, 4, 0, 20], [16, 64, 8, 8], 26, 30, dtype=torch.float64)
c.x = c.x.t().contiguous().t()
c.lora_a = c.lora_a.transpose(1, 2).contiguous().transpose(1, 2)
c.lora_b = c.lora_b.transpose(1, 2).contiguous().transpose(1, 2)
record("strided", c, run_op(c, multilora_linear_fused))
# the opt-in TMA main loops (tensor descriptors; the interpreter runs them too)
import kernels.fused_lora as fl
tma_ok = []
_orig_ok = fl._tma_ok
fl._tma_ok = lambda a, b: (tma_ok.append(_orig_ok(a, b)), tma_ok[-1])[1]
c = make_case([5, 0, 17, 30], [8, 64, 24, 16], 40, 24, dtype=torch.float32)
record("tma", c, run_op(c, multilora_linear_fused, tma=True))
got, stray = run_arena(c, multilora_linear_arena_fused)  # the process default: "ptr" unless set
record("no tma", c, got, stray)
fl._tma_ok = _orig_ok
# every GEMM variant (prefetched epilogue operands, persistent programs over more tiles than
# programs), stacked and arena (the arena takes the process default), with tiles that hold two
# or three adapters, a rank-64 adapter (four rank blocks) and an adapter starting mid-tile
variants_ok = []
c = make_case([5, 0, 17, 30, 3, 21], [8, 64, 24, 16, 64, 17], 40, 56, dtype=torch.float64, bias=True)
for v in fl.GEMM_VARIANTS:
    record(f"gemm {v}", c, run_op(c, multilora_linear_fused, gemm=v))
    fl.GEMM_DEFAULT = v
    got, stray = run_arena(c, multilora_linear_arena_fused)
    record(f"arena gemm {v}", c, got, stray)
    variants_ok.append(v)
fl.GEMM_DEFAULT = None  # back to the device default ("ptr" under the interpreter)
# "auto" per GEMM: persist where its tiles fill the last round of programs (4 under the interpreter), cuBLAS
# over the LoRA store where they keep under CUBLAS_BELOW of it busy: 13 rows x 80 columns are 5 tiles of
# 16 x 16 (5 of 8 slots: the forward takes cuBLAS), their dX 13 x 40 3 tiles (3 of 4: persist)
auto_stores = []
_orig_store = fl._lora_store.launch
for counts, ranks, d_in, d_out in (([5, 8], [8, 16], 40, 80), ([5, 0, 17, 30], [8, 64, 24, 16], 40, 48)):
    c = make_case(counts, ranks, d_in, d_out, dtype=torch.float64, bias=True)
    stores = []
    fl._lora_store.launch = lambda *a, **k: (stores.append(1), _orig_store(*a, **k))[1]
    record("gemm auto", c, run_op(c, multilora_linear_fused, gemm="auto"))
    fl.GEMM_DEFAULT = "auto"
    got, stray = run_arena(c, multilora_linear_arena_fused)
    record("arena gemm auto", c, got, stray)
    fl.GEMM_DEFAULT = None
    auto_stores.append(len(stores))
fl._lora_store.launch = _orig_store
# padding no adapter owns (offsets[N] < T: a graphed step's row under LORAPLEX_FREE_PADDING=1, its upstream
# gradient zero): every variant, the compose form and the reference give its rows the base output, but
# "persist" stores zeros in the row tiles wholly past the last adapter's rows (and nothing else differs)
c = make_case([5, 0, 17, 3], [8, 64, 24, 16], 40, 56, dtype=torch.float64, bias=True, pad_rows=37)
edge = -(-int(c.offsets[-1]) // fl._IB) * fl._IB
live_zero = []
for v in fl.GEMM_VARIANTS:
    fl.GEMM_DEFAULT = v
    for name, (got, stray) in ((f"padded gemm {v}", (run_op(c, multilora_linear_fused, gemm=v), 0)),
                               (f"padded arena gemm {v}", run_arena(c, multilora_linear_arena_fused))):
        if v.startswith("persist"):
            live_zero.append(bool((got["y"][edge:] == 0).all()) and bool((got["y"][:edge] != 0).all()))
        if v.startswith("persist") or v == "auto":  # "auto": per GEMM, persist's zeros or the base output
            got["y"][edge:] = oracle_fp64(c)["y"][edge:]
        record(name, c, got, stray)
fl.GEMM_DEFAULT = None
record("padded compose", c, run_op(c, multilora_linear, backend="triton", form="compose"))
got, stray = run_arena(c, multilora_linear_arena, backend="triton", form="compose")
record("padded arena compose", c, got, stray)
record("padded reference", c, run_op(c, multilora_linear, backend="torch"))
got, stray = run_arena(c, multilora_linear_arena, backend="torch")
record("padded arena reference", c, got, stray)
# arena offsets the caller vouches are 16-element aligned (the engine's usual case): the kernels'
# ARENA=16 mode (vector loads of the adapters' rows on a GPU), blocks 16-aligned between NaN gaps
aligned_modes = []
_orig_mode = fl._arena_mode
fl._arena_mode = lambda *a: (aligned_modes.append(_orig_mode(*a)), aligned_modes[-1])[1]
c = make_case([5, 0, 17, 30], [8, 64, 24, 16], 32, 48, dtype=torch.float32, bias=True)
for v in ("ptr", "persist"):
    fl.GEMM_DEFAULT = v
    got, stray = run_arena(c, multilora_linear_arena_fused, aligned=True)
    record(f"arena aligned gemm {v}", c, got, stray)
fl.GEMM_DEFAULT = None
fl._arena_mode = _orig_mode
try:
    fl.gemm_variant("bogus")
    refused = False
except ValueError as exc:
    refused = "bogus" in str(exc)

# Work list of the per-adapter rank tiles: every (adapter, row block, rank block) exactly once,
# cdiv(r_i, 16) rank blocks for adapter i (a rank-16 adapter beside a rank-64 one gets one).
import triton
import triton.language as tl
from kernels.fused_lora import _find_item


@triton.jit
def _probe(off_ptr, rank_ptr, out_ptr, N, R_MAX, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, N_P2: tl.constexpr):
    pid = tl.program_id(0)
    ad, row_start, row_end, r0, rank = _find_item(pid, off_ptr, rank_ptr, N, R_MAX, ROWS, BLOCK_R, N_P2)
    tl.store(out_ptr + pid * 5 + 0, ad)
    tl.store(out_ptr + pid * 5 + 1, row_start)
    tl.store(out_ptr + pid * 5 + 2, row_end)
    tl.store(out_ptr + pid * 5 + 3, r0)
    tl.store(out_ptr + pid * 5 + 4, rank)


counts, ranks, rows_per = [40, 0, 7, 33, 16], [16, 64, 64, 24, 8], 16
offs = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist())
grid = (sum(counts) // rows_per + len(counts) + 1) * 4
probe = torch.full((grid, 5), -7, dtype=torch.int32)
_probe[(grid,)](offs, torch.tensor(ranks, dtype=torch.int32), probe, len(counts), 64, ROWS=rows_per, BLOCK_R=16, N_P2=16)
got_items = sorted(tuple(r) for r in probe.tolist() if r[0] >= 0)
want_items = sorted((i, int(offs[i]) + m, int(offs[i + 1]), rb, ranks[i])
                    for i in range(len(counts)) for m in range(0, counts[i], rows_per)
                    for rb in range(0, ranks[i], 16))
spare_ok = all(r[0] == -1 for r in probe.tolist() if r[0] < 0)

# Form dispatch: "fused" and "auto" (with a table that says fused for this shape) reach the fused
# kernels; "compose" and "auto" without a measurement do not.
import kernels.fused_lora as fl
from kernels.form_choice import FormTable, set_table
calls = []
orig_stacked, orig_arena = fl.multilora_linear_fused, fl.multilora_linear_arena_fused
fl.multilora_linear_fused = lambda *a, **k: (calls.append("stacked"), orig_stacked(*a, **k))[1]
fl.multilora_linear_arena_fused = lambda *a, **k: (calls.append("arena"), orig_arena(*a, **k))[1]
c = make_case([3, 8], [16, 8], 18, 20, dtype=torch.float64)
seen = {}
for form, tab in [("fused", None), ("compose", None), ("auto", FormTable()),
                  ("auto", FormTable([dict(device="cpu", d_in=18, d_out=20, tokens=16, r_max=16, form="fused", ms=1.0),
                                      dict(device="cpu", d_in=18, d_out=20, tokens=16, r_max=16, form="compose", ms=2.0)]))]:
    set_table(tab)
    calls.clear()
    got = run_op(c, multilora_linear, backend="triton", form=form)
    ga, _ = run_arena(c, multilora_linear_arena, backend="triton", form=form)
    key = form + ("" if tab is None else f"/{len(tab.rows())}")
    seen[key] = sorted(calls)
    record("dispatch " + key, c, got)
    record("dispatch arena " + key, c, ga)
set_table(None)

# The engine's layer: MultiLoraLinear with a StepLayout asking for the fused form.
from trainer.multilora import MultiLoraLinear, StepLayout
calls.clear()
c = make_case([5, 0, 9], [16, 8, 24], 12, 14, dtype=torch.float64)
lin = torch.nn.Linear(12, 14, dtype=torch.float64)
with torch.no_grad():
    lin.weight.copy_(c.weight)
    lin.bias.copy_(c.bias)
c.weight = lin.weight.detach()
c.bias = lin.bias.detach()
layer = MultiLoraLinear(lin, "probe")


def via_layer(x, weight, bias, arena, grad, a_off, b_off, scales, ranks, offsets, r_max, token):
    layer.layout = StepLayout(offsets=offsets, scales=scales, ranks=ranks, arena=arena, grad_arena=grad,
                              r_max=r_max, token=token, backend="triton", form="fused")
    layer.a_off, layer.b_off = a_off, b_off
    return layer(x)


got, stray = run_arena(c, via_layer)
record("MultiLoraLinear form=fused", c, got, stray)
layer_calls = list(calls)
print("RESULT" + json.dumps({"results": out, "items": [got_items, want_items], "spare_ok": spare_ok,
                             "dispatch": seen, "layer_calls": layer_calls, "tma_ok": tma_ok,
                             "variants": variants_ok, "refused": refused, "auto_stores": auto_stores, "aligned_modes": aligned_modes,
                             "live_zero": live_zero}))
"""

TOL = {"torch.float32": 3e-6, "torch.float64": 1e-12}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("block_m", "chunk", "block_r", "split", "part"),
                         [("16", "40", "16", "1", "all"), ("32", "16", "64", "3", "core")])
def test_fused_kernels_under_interpreter(block_m: str, chunk: str, block_r: str, split: str, part: str) -> None:
    """Two row-tile heights, two weight-gradient row chunks (40: chunks end inside a tile), two
    rank tiles (64: one tile covers a rank-64 adapter; ranks 8 and 16 use a masked part of it) and
    the shrink's column sweep whole or in 3 parts (atomics into S; a part may be empty)."""
    env = dict(os.environ, TRITON_INTERPRET="1", LORAPLEX_INTERPRET_BLOCK_M=block_m, LORAPLEX_INTERPRET_CHUNK=chunk,
               LORAPLEX_INTERPRET_BLOCK_R=block_r, LORAPLEX_INTERPRET_SPLIT_C=split, PYTHONPATH=ROOT)
    env.pop("LORAPLEX_LORA_FORM", None)
    env.pop("LORAPLEX_LORA_TIMINGS", None)
    env.pop("LORAPLEX_FUSED_TMA", None)
    env.pop("LORAPLEX_FUSED_GEMM", None)
    proc = subprocess.run([sys.executable, "-c", _WORKER, part], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert len(res["results"]) == (2 * 3 if part == "core" else 2 * 6 + 1 + 1 + 1 + 2 + 2 * 8 + 2 * 8 + 4 + 2 + 8 + 1 + 4)
    for r in res["results"]:
        tol = TOL[r["dtype"]]
        assert all(e <= tol for e in r["errs"].values()), f"{r['errs']} > {tol}: {r['case']}"
        assert r["pad_nonzero"] == 0 and r["empty_nonzero"] == 0 and r["stray"] == 0, r["case"]
    if part == "core":
        return
    got_items, want_items = res["items"]
    assert got_items == want_items
    assert res["variants"] == ["ptr", "ptr+pf", "tma", "tma+pf", "persist", "persist+pf", "cublas", "auto"]
    assert res["refused"]
    assert res["auto_stores"] == [2, 0]  # the first case's forwards (stacked, arena) took cuBLAS, the second's none
    assert res["live_zero"] == [True] * 4  # stacked and arena, both "persist" forms: zeros past the edge only
    assert res["aligned_modes"] == [16, 16], res["aligned_modes"]  # vouched-for offsets took the aligned mode
    assert res["spare_ok"]
    # per-adapter rank tiles: the rank-16 adapter has one rank block per row block, rank 64 four
    assert {tuple(i)[3] for i in got_items if i[0] == 0} == {0}
    assert {tuple(i)[3] for i in got_items if i[0] == 2} == {0, 16, 32, 48}
    assert res["dispatch"] == {"fused": ["arena", "stacked"], "compose": [], "auto/0": [],
                               "auto/2": ["arena", "stacked"]}
    assert res["layer_calls"] == ["arena"]
    assert res["tma_ok"] == [True, True]  # forward and dX GEMMs took the TMA path; off by default


_ENGINE = r"""
import json
from tests.helpers.tiny_engine import tiny_engine_steps


def losses(backend, form):
    return tiny_engine_steps(backend, form)[0]


print("RESULT" + json.dumps({"torch": losses("torch", "compose"), "fused": losses("triton", "fused")}))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_engine_steps_on_the_fused_form_match_the_torch_path() -> None:
    """Two training steps of the real engine (arena, gradient checkpointing, per-job AdamW) on
    the fused kernels under the interpreter give the torch path's losses."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    env.pop("LORAPLEX_LORA_FORM", None)
    proc = subprocess.run([sys.executable, "-c", _ENGINE], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    ref, got = res["torch"], res["fused"]
    assert ref[0] != ref[1]  # the jobs trained: step 2 differs from step 1
    for step_ref, step_got in zip(ref, got, strict=True):
        for a, b in zip(step_got, step_ref, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (got, ref)
