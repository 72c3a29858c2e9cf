"""CPU tests of the multi-LoRA operator's public API and its torch reference path.

Fresh random inputs every run (the seed is in every failure message); float64 oracle by slicing.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from kernels import (
    multilora_linear,
    multilora_linear_arena,
    multilora_linear_arena_reference,
    multilora_linear_reference,
)
from kernels.testing import (
    empty_adapter_grad_nonzero,
    make_case,
    oracle_fp64,
    padding_grad_nonzero,
    rel_errors,
    run_arena,
    run_op,
)

TOL = {torch.float32: 2e-6, torch.float64: 1e-12}


def _random_shape(n: int) -> tuple[list[int], list[int], int, int]:
    counts = [random.choice([0, 1, 3, 7, 16, 29]) for _ in range(n)]
    ranks = [random.choice([8, 16, 64]) for _ in range(n)]
    return counts, ranks, random.randint(5, 70), random.randint(5, 70)


CASES = {
    "mixed_ranks_ragged_with_zero": ([5, 0, 17, 33, 1], [8, 16, 64, 8, 16], 40, 24),
    "single_adapter": ([37], [16], 24, 40),
    "single_token": ([1], [8], 3, 5),
    "all_but_one_empty": ([0, 0, 9, 0], [64, 8, 16, 8], 33, 17),
    "all_empty": ([0, 0, 0], [8, 16, 64], 21, 13),
}


def _check(case, got) -> None:
    want = oracle_fp64(case)
    errs = rel_errors(got, want)
    tol = TOL[case.x.dtype]
    assert all(e <= tol for e in errs.values()), f"{errs} > {tol} for {case.describe()}"
    for k in want:  # elementwise too: an unwritten or misplaced element cannot hide in a norm
        g, w = got[k].to(torch.float64), want[k]
        scale = w.abs().max().item() if w.numel() else 0.0
        assert torch.allclose(g, w, rtol=0, atol=50 * tol * max(scale, 1.0)), f"{k} elementwise, {case.describe()}"
    assert padding_grad_nonzero(got, case.ranks) == 0, case.describe()
    assert empty_adapter_grad_nonzero(got, case.offsets) == 0, case.describe()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_fp64_oracle(name: str, dtype: torch.dtype) -> None:
    counts, ranks, d_in, d_out = CASES[name]
    case = make_case(counts, ranks, d_in, d_out, dtype=dtype)
    _check(case, run_op(case, multilora_linear, backend="torch"))


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_reference_random_shapes(n: int) -> None:
    counts, ranks, d_in, d_out = _random_shape(n)
    case = make_case(counts, ranks, d_in, d_out, dtype=torch.float32, bias=random.random() < 0.5)
    _check(case, run_op(case, multilora_linear_reference))


def test_auto_backend_on_cpu_is_the_reference() -> None:
    case = make_case([4, 0, 6], [8, 16, 8], 12, 10)
    a = run_op(case, multilora_linear)
    b = run_op(case, multilora_linear_reference)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_offsets_int32_and_int64_agree() -> None:
    case = make_case([3, 5, 0, 2], [8, 8, 16, 16], 9, 11)
    y64 = multilora_linear(case.x, case.weight, case.bias, case.lora_a, case.lora_b, case.scales, case.ranks,
                           case.offsets.to(torch.int64))
    y32 = multilora_linear(case.x, case.weight, case.bias, case.lora_a, case.lora_b, case.scales, case.ranks,
                           case.offsets.to(torch.int32))
    assert torch.equal(y32, y64)


def test_no_grad_for_frozen_inputs() -> None:
    case = make_case([4, 4], [8, 16], 10, 12)
    w = case.weight.clone().requires_grad_()
    x = case.x.clone().requires_grad_()
    y = multilora_linear(x, w, case.bias, case.lora_a, case.lora_b, case.scales, case.ranks, case.offsets)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_bad_arguments_raise() -> None:
    case = make_case([2, 2], [8, 8], 6, 7)
    args = [case.x, case.weight, case.bias, case.lora_a, case.lora_b, case.scales, case.ranks, case.offsets]
    with pytest.raises(ValueError):
        multilora_linear(*args, backend="cuda")
    bad_offsets = args[:7] + [torch.tensor([0, 3, 2])]
    with pytest.raises(ValueError):
        multilora_linear(*bad_offsets)
    with pytest.raises(ValueError):
        multilora_linear(case.x[:, :5], *args[1:])


def test_import_and_reference_work_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from kernels import multilora_linear, triton_available\n"
        "from kernels.testing import make_case, run_op\n"
        "assert not triton_available()\n"
        "c = make_case([3, 0, 2], [8, 16, 8], 5, 6)\n"
        "g = run_op(c, multilora_linear)\n"
        "assert torch.isfinite(g['y']).all()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(CASES))
def test_arena_reference_matches_fp64_oracle(name: str, dtype: torch.dtype) -> None:
    """The arena form (what the engine calls): same numbers, gradients added in place, nothing
    outside the adapters' blocks touched, NaN gaps between blocks never read."""
    counts, ranks, d_in, d_out = CASES[name]
    case = make_case(counts, ranks, d_in, d_out, dtype=dtype, bias=random.random() < 0.5)
    got, stray = run_arena(case, multilora_linear_arena, backend="torch")
    assert stray == 0, case.describe()
    _check(case, got)


def test_arena_reference_random_shapes_without_x_grad() -> None:
    counts, ranks, d_in, d_out = _random_shape(random.choice([1, 5, 33]))
    case = make_case(counts, ranks, d_in, d_out, dtype=torch.float64)
    got, stray = run_arena(case, multilora_linear_arena_reference, x_grad=False)
    assert got["dx"] is None and stray == 0
    want = oracle_fp64(case)
    errs = rel_errors({**got, "dx": want["dx"]}, want)
    assert all(e <= TOL[torch.float64] for e in errs.values()), f"{errs} {case.describe()}"


def _row(form: str, ms: float, tokens: int = 8192, r_max: int = 16, device: str = "H100", d=(4096, 4096)) -> dict:
    return {"device": device, "d_in": d[0], "d_out": d[1], "tokens": tokens, "r_max": r_max, "form": form, "ms": ms}


def test_form_table_picks_the_faster_form_at_the_nearest_point(tmp_path) -> None:
    from kernels.form_choice import FormTable

    tab = FormTable([_row("compose", 1.0, tokens=2048), _row("fused", 1.2, tokens=2048),
                     _row("compose", 4.0, tokens=32768), _row("fused", 3.0, tokens=32768),
                     _row("fused", 0.1, tokens=8192)])  # fused alone at 8192: not a comparison
    assert tab.choose("H100", 4096, 4096, 2048, 16) == "compose"
    assert tab.choose("H100", 4096, 4096, 3000, 16) == "compose"      # nearer 2048 than 32768
    assert tab.choose("H100", 4096, 4096, 20000, 64) == "fused"       # nearer 32768
    assert tab.choose("H200", 4096, 4096, 32768, 16) == "compose"     # another device: no data
    assert tab.choose("H100", 4096, 14336, 32768, 16) == "compose"    # another shape: no data
    # no data: the caller's fallback (the device's default form), while measured points still decide
    assert tab.choose("H100", 4096, 14336, 32768, 16, fallback="fused") == "fused"
    assert tab.choose("H100", 4096, 4096, 2048, 16, fallback="fused") == "compose"
    path = tmp_path / "forms.json"
    tab.save(path)
    again = FormTable.load(path)
    assert again.rows() == tab.rows()
    assert again.choose("H100", 4096, 4096, 20000, 64) == "fused"


def test_form_table_rejects_bad_rows_and_ignores_failed_timings() -> None:
    from kernels.form_choice import FormTable

    with pytest.raises(ValueError):
        FormTable([_row("bmm", 1.0)])
    tab = FormTable([_row("compose", 2.0), _row("fused", float("nan"))])
    assert tab.choose("H100", 4096, 4096, 8192, 16) == "compose"
    assert [r["form"] for r in tab.rows()] == ["compose"]


def test_form_argument_is_checked() -> None:
    from kernels import set_default_form

    case = make_case([2, 2], [8, 8], 6, 7)
    args = [case.x, case.weight, case.bias, case.lora_a, case.lora_b, case.scales, case.ranks, case.offsets]
    with pytest.raises(ValueError, match="form"):
        multilora_linear(*args, form="fast")
    with pytest.raises(ValueError, match="form"):
        set_default_form("fast")
    # the torch backend ignores a valid form
    y = multilora_linear(*args, backend="torch", form="fused")
    assert torch.equal(y, multilora_linear_reference(*args))


def test_autotune_results_persist_where_triton_supports_it() -> None:
    """Issue 15: with Triton >= 3.4 every autotuned kernel of the composition caches its choice on
    disk (checked outside the interpreter, which turns the disk cache off); the fused form's
    kernels do not tune at run time at all (tests/unit/test_kernels_tables.py)."""
    pytest.importorskip("triton")
    code = (
        "import inspect, triton\n"
        "from kernels import fused_lora, triton_lora\n"
        "ks = [triton_lora._fwd_kernel, triton_lora._bwd_kernel, triton_lora._bwd_kernel_arena]\n"
        "supported = 'cache_results' in inspect.signature(triton.autotune).parameters\n"
        "assert supported, 'this Triton cannot persist autotuning'\n"
        "assert all(k.cache_results is True for k in ks), [k.cache_results for k in ks]\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_auto_gemm_takes_cublas_where_the_persistent_tiles_leave_their_last_round_short(monkeypatch) -> None:  # noqa: ANN001
    """The "auto" GEMM variant (Hopper's default once the archive holds its kernels): per call the
    persistent kernel, or cuBLAS over the LoRA store where the persistent tiles keep under CUBLAS_BELOW
    of their last round of programs busy."""
    import kernels.fused_lora as fl

    # 128 x 256 tiles of a 4096-wide output on 132 SMs: 1,536 rows are 192 tiles (1.45 rounds), 1,792
    # rows 224 (1.70), 2,048 rows 256 (1.94); a 1024-wide output at 1,536 rows 48 (0.36)
    assert fl.wave_fill(192, 132) == pytest.approx(192 / 264) and fl.wave_fill(192, 132) < fl.CUBLAS_BELOW
    assert fl.wave_fill(48, 132) < fl.CUBLAS_BELOW
    assert fl.wave_fill(224, 132) >= fl.CUBLAS_BELOW and fl.wave_fill(256, 132) >= fl.CUBLAS_BELOW
    assert fl.wave_fill(132, 132) == 1.0 and fl.wave_fill(133, 132) == pytest.approx(133 / 264)
    assert fl.wave_fill(0, 132) == 1.0  # no rows: nothing to balance, the kernel of the variant
    monkeypatch.setattr(fl, "_INTERPRET", False)
    monkeypatch.setattr(fl, "GEMM_DEFAULT", None)
    monkeypatch.setattr(fl, "hopper_or_newer", lambda device: True)
    assert fl.gemm_variant(device=torch.device("cpu")) == ("auto" if fl.AUTO_READY else "persist")
    monkeypatch.setattr(fl, "AUTO_READY", True)
    assert fl.gemm_variant(device=torch.device("cpu")) == "auto"
    monkeypatch.setattr(fl, "hopper_or_newer", lambda device: False)
    assert fl.gemm_variant(device=torch.device("cpu")) == "ptr"
    assert fl.gemm_variant("persist") == "persist" and fl.gemm_variant("cublas") == "cublas"


def test_auto_gemm_takes_cublas_for_outputs_no_wider_than_cublas_width(monkeypatch) -> None:  # noqa: ANN001
    """$LORAPLEX_CUBLAS_WIDTH: "auto" also takes cuBLAS for every output of at most that many columns, whatever
    the persistent tiles' fill; wider ones keep the fill rule; 0 (the default) changes nothing."""
    import kernels.fused_lora as fl

    full = 264  # two full rounds of 132 SMs
    assert fl.CUBLAS_WIDTH == 0 or "LORAPLEX_CUBLAS_WIDTH" in os.environ
    monkeypatch.setattr(fl, "CUBLAS_BELOW", 0.75)
    monkeypatch.setattr(fl, "CUBLAS_WIDTH", 0)
    assert not fl.auto_takes_cublas(full, 132, 1024) and fl.auto_takes_cublas(192, 132, 4096)
    assert not fl.auto_takes_cublas(full, 132, 0)  # no columns: never by width
    monkeypatch.setattr(fl, "CUBLAS_WIDTH", 4096)
    assert fl.auto_takes_cublas(full, 132, 1024) and fl.auto_takes_cublas(full, 132, 4096)
    assert not fl.auto_takes_cublas(full, 132, 14336)  # wider: the fill decides
    assert fl.auto_takes_cublas(192, 132, 14336)


@pytest.mark.parametrize("tiles", ["tuned", "narrow"])
def test_the_lora_store_pass_always_has_a_rank_tile(tiles: str) -> None:
    """The "cublas" variant's store pass launches the pointer GEMM with K = 0: its rank tile comes
    from `_gemm_rank_tile` where the GEMM configs carry none, else from its own configuration
    ($LORAPLEX_FUSED_RANK_TILES=narrow, the bench baseline: a launch without one would not compile)."""
    code = ("import kernels.fused_lora as f; cfg = f._lora_store.configs[0].kwargs; "
            "print(sorted(set(cfg) | set(f._gemm_rank_tile(64))))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LORAPLEX_FUSED_RANK_TILES"] = tiles
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert "'BLOCK_R'" in out.stdout, out.stdout
