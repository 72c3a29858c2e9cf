"""`kernels.tuned`: the fused kernels' launch configurations come from a shipped table per GPU,
looked up by the nearest key; nothing is benchmarked inside a task; an offline tuning run writes
the table, and a second process reading it benchmarks nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from kernels import fused_lora as fl
from kernels import tuned

ROOT = Path(__file__).resolve().parents[2]


class FakeJit:
    """Stands in for a triton.jit function: records each launch's grid and keywords, adds 1 into
    its output (as the gradient kernels add) and sleeps per config so tuning has a clear best."""

    arg_names = ["x_ptr", "out_ptr", "T_BUCKET", "R_MAX"]

    def __init__(self, slow: dict[int, float] | None = None) -> None:
        self.launches: list[tuple] = []
        self.slow = slow or {}

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def run(x, out, t_bucket, r_max, **kw):  # noqa: ANN001, ANN202
            import time

            self.launches.append((grid, kw["BLOCK"], kw["num_warps"]))
            time.sleep(self.slow.get(kw["BLOCK"], 0.0))
            out.add_(1.0)
        return run


CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((16, 4), (32, 4), (64, 8))]


@pytest.fixture
def table_dir(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.setattr(tuned, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tuned, "_TABLES", {})
    tuned.tuning(False)
    tuned.BENCHMARKS.clear()
    yield tmp_path
    tuned.tuning(False)


def _write(table_dir: Path, name: str, rows: list[tuple[dict, dict]], capability=None) -> None:  # noqa: ANN001
    t = tuned.Table(name, capability)
    for key, cfg in rows:
        t.add("k", key, cfg)
    t.write(table_dir / f"{name}.json")


def _call(k: tuned.Tuned, t_bucket: int, r_max: int = 16) -> torch.Tensor:
    out = torch.zeros(3)
    k[lambda meta: (meta["BLOCK"],)](torch.zeros(2, dtype=torch.bfloat16), out, t_bucket, r_max, EXTRA=1)
    return out


def test_the_nearest_key_of_the_table_decides_and_nothing_is_benchmarked(table_dir) -> None:  # noqa: ANN001
    _write(table_dir, "cpu", [({"T_BUCKET": 1024, "R_MAX": 16}, {"BLOCK": 32, "num_warps": 4, "num_stages": 3}),
                              ({"T_BUCKET": 16384, "R_MAX": 16}, {"BLOCK": 64, "num_warps": 8, "num_stages": 3})])
    fn = FakeJit()
    k = tuned.Tuned("k", fn, CONFIGS, ["T_BUCKET", "R_MAX"])
    for t, want in ((512, 32), (2048, 32), (8192, 64), (65536, 64), (1024, 32)):
        out = _call(k, t)
        assert fn.launches[-1][0] == (want,) and fn.launches[-1][1] == want  # grid from the config
        assert out.eq(1).all()  # one launch, one sum
    assert tuned.BENCHMARKS == []
    assert len(fn.launches) == 5


def test_a_configuration_the_call_does_not_allow_is_passed_over(table_dir) -> None:  # noqa: ANN001
    _write(table_dir, "cpu", [({"T_BUCKET": 1024, "R_MAX": 64}, {"BLOCK": 64, "num_warps": 8, "num_stages": 3}),
                              ({"T_BUCKET": 64, "R_MAX": 16}, {"BLOCK": 16, "num_warps": 4, "num_stages": 3})])
    fn = FakeJit()
    # like the rank-tile pruner: a call of R_MAX 16 may not take BLOCK 64
    prune = lambda cfgs, named: [c for c in cfgs if c.kwargs["BLOCK"] <= max(16, named["R_MAX"])]  # noqa: E731
    k = tuned.Tuned("k", fn, CONFIGS, ["T_BUCKET", "R_MAX"], prune)
    _call(k, 1024, r_max=16)
    assert fn.launches[-1][1] == 16  # the nearer entry's BLOCK 64 is not allowed: the next one
    _call(k, 1024, r_max=64)
    assert fn.launches[-1][1] == 64


def test_no_table_takes_the_first_allowed_config_and_a_same_capability_table_is_used(table_dir, monkeypatch) -> None:  # noqa: ANN001, E501
    fn = FakeJit()
    k = tuned.Tuned("k", fn, CONFIGS, ["T_BUCKET", "R_MAX"])
    _call(k, 4096)
    assert fn.launches[-1][1] == 16 and tuned.BENCHMARKS == []
    # another GPU of the same compute capability ships a table: a new GPU name reads it
    _write(table_dir, "NVIDIA_H100_80GB_HBM3", [({"T_BUCKET": 4096, "R_MAX": 16},
                                                 {"BLOCK": 64, "num_warps": 8, "num_stages": 3})], capability=[9, 0])
    monkeypatch.setattr(tuned, "_TABLES", {})
    monkeypatch.setattr(tuned, "device_name", lambda device=None: "NVIDIA_H200")
    monkeypatch.setattr(tuned, "_capability", lambda device=None: [9, 0])
    assert tuned.table_for(torch.device("cpu")).source == "NVIDIA_H100_80GB_HBM3.json"
    monkeypatch.setattr(tuned, "_capability", lambda device=None: [10, 0])
    monkeypatch.setattr(tuned, "_TABLES", {})
    assert tuned.table_for(torch.device("cpu")).kernels == {}  # another capability: heuristic


def test_a_pre_hook_runs_before_every_launch(table_dir) -> None:  # noqa: ANN001
    seen = []
    cfg = triton.Config({"BLOCK": 16}, num_warps=4, pre_hook=lambda nargs: seen.append(nargs["out_ptr"].clone()))
    k = tuned.Tuned("k", FakeJit(), [cfg], ["T_BUCKET", "R_MAX"])
    out = _call(k, 64)
    assert len(seen) == 1 and seen[0].eq(0).all() and out.eq(1).all()


_SECOND = r"""
import json, torch, triton
from kernels import tuned
from tests.unit.test_kernels_tables import CONFIGS, FakeJit, _call
tuned.tuning(True)  # tuning is on, yet every key is in the table: nothing to benchmark
k = tuned.Tuned("k", FakeJit(), CONFIGS, ["T_BUCKET", "R_MAX"])
for t in (1024, 4096):
    _call(k, t)
print("RESULT" + json.dumps({"benchmarks": tuned.BENCHMARKS, "block": k.fn.launches[-1][1]}))
"""


def test_offline_tuning_writes_the_table_and_a_second_process_benchmarks_nothing(table_dir) -> None:  # noqa: ANN001
    fn = FakeJit(slow={16: 0.004, 32: 0.0, 64: 0.004})
    k = tuned.Tuned("k", fn, CONFIGS, ["T_BUCKET", "R_MAX"], restore=("out_ptr",))
    tuned.tuning(True)
    for t in (1024, 4096):
        out = _call(k, t)
        assert out.eq(1).all()  # the trials' sums are undone: one launch's sum is left
    assert [b[1] for b in tuned.BENCHMARKS] == [(1024, 16), (4096, 16)]
    assert fn.launches[-1][1] == 32  # the fastest
    path = tuned.save_table(torch.device("cpu"))
    table = json.loads(path.read_text())
    assert {(r["key"]["T_BUCKET"], r["key"]["R_MAX"]) for r in table["kernels"]["k"]} == {(1024, 16), (4096, 16)}
    env = dict(os.environ, PYTHONPATH=str(ROOT), LORAPLEX_KERNEL_CONFIGS=str(table_dir))
    proc = subprocess.run([sys.executable, "-c", _SECOND], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert got == {"benchmarks": [], "block": 32}


def test_the_fused_kernels_are_table_launched() -> None:
    for k in (fl._gemm_lora, fl._gemm_lora_tma, fl._gemm_lora_persist, fl._shrink, fl._shrink_wgrad, fl._wgrad):
        assert isinstance(k, tuned.Tuned)
    assert fl._shrink_wgrad.restore == ("g_ptr",) and fl._wgrad.restore == ("g_ptr",)


# three configurations the reduce tests time against each other
REDUCE_CONFIGS = ({"BLOCK": 16, "num_warps": 4, "num_stages": 3}, {"BLOCK": 32, "num_warps": 4, "num_stages": 3},
                  {"BLOCK": 64, "num_warps": 8, "num_stages": 3})


def test_reduce_keeps_the_configurations_that_lose_least() -> None:
    a, b, c = REDUCE_CONFIGS
    t = tuned.Table("x")
    # four keys: c best on two, a best on one, b best on one but nearly as good as c everywhere
    t.add("k", {"T_BUCKET": 1}, c, [(a, 3.0), (b, 1.02), (c, 1.0)])
    t.add("k", {"T_BUCKET": 2}, c, [(a, 3.0), (b, 1.03), (c, 1.0)])
    t.add("k", {"T_BUCKET": 4}, a, [(a, 1.0), (b, 1.5), (c, 2.0)])
    t.add("k", {"T_BUCKET": 8}, b, [(a, 2.0), (b, 1.0), (c, 1.01)])
    kept = t.reduce("k", 2)
    assert len(kept) == 2 and a in kept and c in kept
    assert [r["config"] for r in sorted(t.kernels["k"], key=lambda r: r["key"]["T_BUCKET"])] == [c, c, a, c]
    assert t.reduce("k", 1) in ([c], [b])  # one config for all: the least total loss
    assert len({tuple(sorted(r["config"].items())) for r in t.kernels["k"]}) == 1


def test_reduce_after_a_partial_retune_keeps_the_untouched_entries_and_adds_the_fewest_configs() -> None:
    a, b, c = REDUCE_CONFIGS
    t = tuned.Table("x")
    # a large key left as it was (its timings say b, but it is not retuned: it keeps c); two small keys retuned
    t.add("k", {"T_BUCKET": 4096}, c, [(a, 2.0), (b, 1.0), (c, 1.5)])
    t.add("k", {"T_BUCKET": 256}, a, [(a, 1.0), (b, 1.2), (c, 3.0)])
    t.add("k", {"T_BUCKET": 512}, a, [(a, 1.1), (b, 1.0), (c, 2.0)])
    chosen = t.reduce("k", 1, keep=[c], scope=lambda key: key["T_BUCKET"] <= 2048)
    assert chosen == [a]  # one more config besides the kept c: a loses least over the retuned keys
    by_t = {r["key"]["T_BUCKET"]: r["config"] for r in t.kernels["k"]}
    assert by_t == {4096: c, 256: a, 512: a}
    assert t.reduce("k", 0, keep=[c], scope=lambda key: key["T_BUCKET"] <= 2048) == []
    assert {r["key"]["T_BUCKET"]: r["config"] for r in t.kernels["k"]} == {4096: c, 256: c, 512: c}


_CANDIDATES = r"""
import json
from kernels import fused_lora as fl, tuned
kernels = {k.name: k for k in (fl._gemm_lora, fl._gemm_lora_tma, fl._gemm_lora_persist, fl._shrink, fl._shrink_wgrad,
                              fl._wgrad)}
print("RESULT" + json.dumps({name: [tuned.config_dict(c) for c in k.configs] for name, k in kernels.items()}))
"""


def test_every_shipped_tables_configuration_is_a_candidate_of_its_kernel() -> None:
    """A table entry whose configuration no candidate matches is passed over at its lookup (the
    nearest allowed entry decides instead): each shipped table's configurations must all be
    candidates of the GPU's lists (the interpreter's lists are others)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", _CANDIDATES], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    candidates = json.loads(proc.stdout.split("RESULT", 1)[1])
    files = sorted((ROOT / "kernels" / "configs").glob("*.json"))
    assert {f.stem for f in files} >= {"NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"}
    for path in files:
        table = json.loads(path.read_text())
        for kernel, rows in table["kernels"].items():
            allowed = candidates[kernel]
            missing = {json.dumps(r["config"], sort_keys=True) for r in rows if r["config"] not in allowed}
            assert not missing, f"{path.name} {kernel}: {sorted(missing)[:3]}"


def test_a_table_read_and_written_again_keeps_the_versions_it_was_tuned_under(tmp_path: Path) -> None:
    path = tmp_path / "NVIDIA_X.json"
    path.write_text(json.dumps({"device": "NVIDIA_X", "capability": [9, 0], "triton": "3.6.0", "torch": "2.11.0",
                                "kernels": {"k": [{"key": {"T_BUCKET": 512}, "config": {"BLOCK": 16}}]}}))
    out = tmp_path / "out.json"
    tuned.Table.read(path).write(out)
    body = json.loads(out.read_text())
    assert (body["triton"], body["torch"]) == ("3.6.0", "2.11.0")
    assert body["kernels"] == {"k": [{"key": {"T_BUCKET": 512}, "config": {"BLOCK": 16}}]}
    tuned.Table("NVIDIA_X").write(out)  # a new table: this process's versions
    assert json.loads(out.read_text())["triton"] == triton.__version__


def test_a_row_bucket_covers_its_rows_and_keeps_the_kernels_specialisation() -> None:
    """kernels.tuned.row_bucket: the next power of two, or three quarters of it from 48 rows on where
    that covers the rows; every bucket of 48 or more a multiple of 16 (the T_BUCKET argument then
    specialises as the powers of two did: the shipped archive's kernels serve it)."""
    last = 0
    for rows in range(0, 20000):
        b = tuned.row_bucket(rows)
        power = triton.next_power_of_2(max(rows, 1))
        assert max(rows, 1) <= b <= power and b >= last
        assert b in (power, 3 * power // 4)
        assert b == power or (power >= 64 and b % 16 == 0)
        last = b
    assert [tuned.row_bucket(t) for t in (33, 48, 49, 1025, 1448, 1536, 1537, 1722)] == [
        48, 48, 64, 1536, 1536, 1536, 2048, 2048]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "kernels" / "configs").glob("*.json")))
def test_a_three_quarter_bucket_the_table_lacks_takes_the_power_of_two_above(name: str) -> None:
    """Every shipped table's entry serves the row counts it served under power-of-two buckets, except
    where a device tuned a three-quarter bucket's row (session 52: the H200's 1,536-row rank-64 LoRA
    passes): that row serves its own key, and a key the table has no nearer row for (rank 32 at 1,536
    rows, where the table's rank-32 rows start at 4,096) may take it. Once an entry of 1536 rows
    exists, ~1.45k rows take it and ~1.7k rows still take 2048's."""
    table = tuned.Table.read(ROOT / "kernels" / "configs" / name)
    anything = lambda cfg: True  # noqa: E731
    own = {(kernel, json.dumps(r["key"], sort_keys=True)): r["config"]
           for kernel, rows in table.kernels.items() for r in rows}
    checked = moved = 0
    for kernel, rows in table.kernels.items():
        for key in {json.dumps(r["key"], sort_keys=True) for r in rows}:
            key = json.loads(key)
            # what a call may launch (the kernels' prune: no rank tile wider than the call's largest rank needs)
            wide = max(16, triton.next_power_of_2(key.get("R_MAX", 16)))
            allowed = lambda cfg, wide=wide: cfg.get("BLOCK_R", 16) <= wide  # noqa: E731
            for t in (40, 80, 200, 700, 1100, 1448, 1722, 3000, 5000):
                was = table.nearest(kernel, key | {"T_BUCKET": triton.next_power_of_2(t)}, allowed)
                bucket = key | {"T_BUCKET": tuned.row_bucket(t)}
                now = table.nearest(kernel, bucket, allowed)
                tuned_here = own.get((kernel, json.dumps(bucket, sort_keys=True)))
                if tuned_here is not None:  # the bucket's own row serves it
                    assert now == tuned_here, (kernel, key, t)
                elif now != was:  # else only a row a device tuned at this three-quarter bucket may take over
                    assert bucket["T_BUCKET"] != triton.next_power_of_2(t), (kernel, key, t)
                    assert now in [r["config"] for r in rows if r["key"]["T_BUCKET"] == bucket["T_BUCKET"]], (
                        kernel, key, t)
                    moved += 1
                checked += 1
    assert checked > 1000 and moved < checked // 100
    row = next(r for r in table.kernels["gemm_lora_persist"] if r["key"]["T_BUCKET"] == 2048)
    mine = dict(row["config"], BLOCK_N=row["config"]["BLOCK_N"] // 2)
    table.kernels["gemm_lora_persist"].append({"key": dict(row["key"], T_BUCKET=1536), "config": mine})
    for t, want in ((1448, mine), (1536, mine), (1722, row["config"]), (2048, row["config"])):
        assert table.nearest("gemm_lora_persist", dict(row["key"], T_BUCKET=tuned.row_bucket(t)), anything) == want


def test_the_memo_reads_its_key_from_the_arguments_as_triton_binds_them(table_dir) -> None:  # noqa: ANN001
    """choose's memo key comes from the arguments in place (a keyword over a positional one): calls that differ in
    a key value get their own entries, calls that differ elsewhere share one, as with a dict of every argument."""
    k = tuned.Tuned("memo_probe", FakeJit(), CONFIGS, ["T_BUCKET", "R_MAX"])
    x, out = torch.zeros(4), torch.zeros(4)
    first = k.choose((1,), (x, out, 128, 16), {})
    assert list(k._memo) == [("cpu", None, torch.float32, 128, 16)]
    assert k.choose((1,), (x, torch.zeros(8), 128, 16), {}) is first and len(k._memo) == 1  # another output: a hit
    k.choose((1,), (x, out, 128, 16), {"R_MAX": 64})  # the keyword wins over the positional 16
    k.choose((1,), (x, out), {"T_BUCKET": 256, "R_MAX": 32})  # keywords alone
    k.choose((1,), (x.double(), out, 128, 16), {})
    assert list(k._memo)[1:] == [("cpu", None, torch.float32, 128, 64), ("cpu", None, torch.float32, 256, 32),
                                 ("cpu", None, torch.float64, 128, 16)]


def test_the_host_side_cdiv_and_next_power_of_two_equal_tritons() -> None:
    for a in range(0, 300):
        assert tuned.next_pow2(a) == triton.next_power_of_2(a)
        for b in (1, 7, 16, 64, 128):
            assert tuned.cdiv(a, b) == triton.cdiv(a, b)
    for rows in (1, 2, 47, 48, 49, 96, 700, 1421, 1536, 1537, 4752, 65536):
        assert tuned.row_bucket(rows) in (triton.next_power_of_2(rows), 3 * triton.next_power_of_2(rows) // 4)
