"""Launch configurations chosen from shipped tables, not tuned inside a task.

A `Tuned` kernel is a Triton kernel with a list of candidate configurations and a tuning key (as
`triton.autotune` has), but a call never benchmarks: it looks its key up in the table of the
device (`kernels/configs/<GPU name>.json`, written offline by `bench/tune_kernels.py`), taking the
entry nearest in log2 over the key's fields (a T bucket or rank the table lacks gets its
neighbour's configuration, as vLLM's fused-MoE configs are looked up by the nearest token count).
A device without a table takes the table of another GPU of its compute capability, else the
first candidate the call allows (a heuristic default). Triton's own autotuner never writes a
configuration that carries a pre_hook to its disk cache, so every process re-tuned those at
every new key; here nothing is re-tuned at run time at all.

Tuning happens only in a process that turns it on (`tuning(True)`, or $LORAPLEX_TUNE=1): a key
not in the table is then benchmarked over every allowed candidate (kernels that add into
caller-owned tensors have those restored around the trials) and its best configuration added
to the table in memory; `save_table` writes it. The choice per key is memoised, so a launch
after the first of its key costs a dict lookup on top of the JIT's own launch.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import triton

from kernels.lean_launch import launch as launch_lean

CONFIG_DIR = Path(os.environ.get("LORAPLEX_KERNEL_CONFIGS", Path(__file__).with_name("configs")))
_TUNING = {"on": os.environ.get("LORAPLEX_TUNE", "0") == "1"}
BENCHMARKS: list[tuple[str, tuple]] = []  # (kernel, key) of every benchmark this process ran


def tuning(on: bool) -> None:
    """Turn run-time tuning of keys missing from the table on (offline tuning) or off."""
    _TUNING["on"] = bool(on)


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for host ints: Triton's is a constexpr function whose wrapper unwraps its arguments
    (~19 calls a LoRA linear's forward and backward in kernels.fused_lora's launches)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """triton.next_power_of_2 for host ints, without its wrapper (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def row_bucket(rows: int) -> int:
    """The tuning key's bucket (T_BUCKET) of a call of `rows` rows: the next power of two, or from 48
    rows on three quarters of it where that covers `rows` (48, 96, ..., 768, 1536, 3072, ...). A
    2-job step of ~1.45k rows then gets tiles tuned for ~1.5k rows instead of 2k rows' 128 x 256
    ones, which cover a 4096-wide output in 192 tiles there: 1.45 waves of an H100's or H200's 132
    SMs, the second one half idle. A table without an entry for a three-quarter bucket serves it
    from its power of two above (the nearest in log2, as before). Every bucket of 48 or more is a
    multiple of 16, so the kernels' integer specialisation (and the shipped archive) is as before."""
    power = next_pow2(max(rows, 1))
    three_quarters = 3 * power // 4
    return three_quarters if power >= 64 and rows <= three_quarters else power


def device_name(device: torch.device | None = None) -> str:
    """The table name of a device: its GPU name with every run of other characters as '_'
    ("NVIDIA H100 80GB HBM3" -> "NVIDIA_H100_80GB_HBM3"); "cpu" off CUDA."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(device)).strip("_")


def _capability(device: torch.device | None) -> list[int] | None:
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    return list(torch.cuda.get_device_capability(device))


def config_dict(cfg: triton.Config) -> dict[str, int]:
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


class Table:
    """One device's configurations: kernel name -> [(key fields, configuration)]. `versions`: the
    Triton and torch its timings were measured under (a table read from a file keeps the file's;
    a new one writes this process's)."""

    def __init__(self, device: str, capability: list[int] | None = None,
                 kernels: dict[str, list[dict]] | None = None, source: str = "",
                 versions: dict[str, str] | None = None) -> None:
        self.device, self.capability, self.source = device, capability, source
        self.kernels: dict[str, list[dict]] = kernels or {}
        self.versions = versions or {"triton": triton.__version__, "torch": torch.__version__}

    @classmethod
    def read(cls, path: Path) -> Table:
        d = json.loads(path.read_text())
        versions = {k: d[k] for k in ("triton", "torch") if k in d}
        return cls(d["device"], d.get("capability"), d.get("kernels", {}), source=path.name,
                   versions=versions if len(versions) == 2 else None)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        kernels = {k: sorted(v, key=lambda e: sorted(e["key"].items())) for k, v in sorted(self.kernels.items())}
        body = {"device": self.device, "capability": self.capability, **self.versions, "kernels": kernels}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)

    def add(self, kernel: str, key: dict[str, int], config: dict[str, int],
            timings: list[tuple[dict[str, int], float]] | None = None) -> None:
        """Set the configuration of a key (with every candidate's measured milliseconds, when
        tuned, for `reduce`)."""
        rows = self.kernels.setdefault(kernel, [])
        row: dict[str, Any] = {"key": key, "config": config}
        if timings:
            row["timings"] = [{"config": c, "ms": ms} for c, ms in timings if math.isfinite(ms)]
        rows[:] = [r for r in rows if r["key"] != key] + [row]

    def reduce(self, kernel: str, max_configs: int, keep: Sequence[dict[str, int]] = (),
               scope: Callable[[dict], bool] | None = None) -> list[dict[str, int]]:
        """Keep at most `max_configs` distinct configurations of a kernel (each one is another
        compile on a cold node) besides those in `keep` (already compiled: e.g. the configurations
        of the entries a retuning left alone): the set that loses least against every key's best
        (sum of time / best over the keys with timings; every subset when that is cheap, else
        greedily), then each key takes its fastest of them and `keep`. `scope(key)`: only those
        entries are scored and re-pointed (default all with timings).
        Returns the configurations chosen (without `keep`)."""
        rows = [r for r in self.kernels.get(kernel, []) if r.get("timings") and (scope is None or scope(r["key"]))]
        if not rows:
            return []
        per_key = [{_ident(t["config"]): t["ms"] for t in r["timings"]} for r in rows]
        fixed = [_ident(c) for c in keep]
        candidates = sorted({c for m in per_key for c in m} - set(fixed))

        def cost(cfgs: Sequence[tuple]) -> float:
            return sum(min((m[c] for c in [*fixed, *cfgs] if c in m), default=math.inf) / min(m.values())
                       for m in per_key)

        size = min(max_configs, len(candidates))
        if math.comb(len(candidates), size) <= 20_000:  # a dozen candidates: every subset
            chosen = list(min(itertools.combinations(candidates, size), key=cost))
        else:  # greedily
            chosen = []
            while len(chosen) < size:
                chosen.append(min((c for c in candidates if c not in chosen), key=lambda c: cost([*chosen, c])))
        for r, m in zip(rows, per_key, strict=True):
            kept = [c for c in [*fixed, *chosen] if c in m]
            if kept:
                r["config"] = dict(min(kept, key=m.__getitem__))
        return [dict(c) for c in chosen]

    def nearest(self, kernel: str, key: dict[str, int], allowed: Callable[[dict], bool]) -> dict | None:
        """The configuration of the entry nearest to `key` (sum of |log2| differences over the
        key's fields) among those `allowed` for this call; None when there is none."""
        best, best_d = None, math.inf
        for row in self.kernels.get(kernel, []):
            if not allowed(row["config"]):
                continue
            d = sum(_distance(row["key"].get(f, 0), v) for f, v in key.items())
            if d < best_d:
                best, best_d = row["config"], d
        return best


def _distance(a: float, b: float) -> float:
    """|log2 a - log2 b|; a flag (0 or 1) that differs is far (another layout, not a size)."""
    if a != b and min(a, b) <= 1:
        return 64.0
    return abs(math.log2(max(float(a), 1.0)) - math.log2(max(float(b), 1.0)))


_TABLES: dict[str, Table] = {}


def table_for(device: torch.device | None) -> Table:
    """The table of this device: its own file, else the file of a GPU of the same compute
    capability, else an empty one (every call takes its heuristic default)."""
    name = device_name(device)
    if name not in _TABLES:
        own = CONFIG_DIR / f"{name}.json"
        table = None
        if own.exists():
            table = Table.read(own)
        else:
            cap = _capability(device)
            for path in sorted(CONFIG_DIR.glob("*.json")) if cap else []:
                other = Table.read(path)
                if other.capability == cap:
                    table = other
                    break
        _TABLES[name] = table or Table(name, _capability(device))
    return _TABLES[name]


def save_table(device: torch.device | None, path: Path | None = None) -> Path:
    """Write this process's table of the device (its shipped entries plus what it tuned)."""
    table = table_for(device)
    name = device_name(device)
    out = path or CONFIG_DIR / f"{name}.json"
    Table(name, _capability(device) or table.capability, table.kernels).write(out)
    return out


def _bench(fn: Callable[[], None], device: torch.device) -> float:
    """Median milliseconds of fn (CUDA events through Triton's do_bench; a host clock elsewhere)."""
    if device.type == "cuda":
        return float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


class Tuned:
    """A JIT kernel launched with the table's configuration for its key (see the module docstring).

    `prune(configs, named_args)` narrows the candidates to those valid for a call (e.g. rank tiles
    no wider than its largest rank); `restore` names arguments the kernel adds into, saved and
    restored around tuning trials (a pre_hook of a configuration runs before every launch)."""

    def __init__(self, name: str, fn: Any, configs: Sequence[triton.Config], key: Sequence[str],
                 prune: Callable[[list, dict], list] | None = None, restore: Sequence[str] = ()) -> None:
        self.name, self.fn, self.configs, self.key = name, fn, list(configs), list(key)
        self.prune, self.restore = prune, tuple(restore)
        self.arg_names = list(fn.arg_names)
        # each key name's position among the arguments (len(arg_names): a keyword only)
        self._key_pos = [(k, self.arg_names.index(k) if k in self.arg_names else len(self.arg_names)) for k in key]
        self._memo: dict[tuple, triton.Config] = {}

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **meta: self.launch(grid, args, meta)

    def choose(self, grid: Any, args: tuple, meta: dict) -> triton.Config:
        """The configuration of a call with these arguments (memoised per device, dtype and key). The memo's
        key is read from the arguments in place (a keyword's value over a positional one, as Triton binds
        them): no dict of every argument is built on the way to a hit (~7 calls a LoRA linear a step)."""
        first = args[0]
        device = first.device
        values = [int(meta[k]) if k in meta else int(args[i]) for k, i in self._key_pos]
        memo_key = (device.type, device.index, first.dtype, *values)
        cfg = self._memo.get(memo_key)
        if cfg is not None:
            return cfg
        named = dict(zip(self.arg_names, args, strict=False))
        named.update(meta)
        key = {k: int(named[k]) for k in self.key}
        allowed = self.prune(self.configs, named) if self.prune else self.configs
        if len(allowed) == 1:
            cfg = allowed[0]
        else:
            table = table_for(device)
            valid = {_ident(config_dict(c)): c for c in allowed}
            exact = any(r["key"] == key for r in table.kernels.get(self.name, []))
            hit = table.nearest(self.name, key, lambda d: _ident(d) in valid)
            if _TUNING["on"] and not exact:
                timings = self._tune(grid, args, meta, named, allowed, device)
                cfg = allowed[min(range(len(allowed)), key=lambda i: timings[i])]
                table.add(self.name, key, config_dict(cfg), [(config_dict(c), ms) for c, ms in zip(
                    allowed, timings, strict=True)])
            elif hit is not None:
                cfg = valid[_ident(hit)]
            else:
                cfg = allowed[0]
        self._memo[memo_key] = cfg
        return cfg

    def launch(self, grid: Any, args: tuple, meta: dict) -> None:
        self.run_config(self.choose(grid, args, meta), grid, args, meta)

    def run_config(self, cfg: triton.Config, grid: Any, args: tuple, meta: dict) -> None:
        """Launch with `cfg` (a caller that already asked `choose`, as `launch` does)."""
        full = {**meta, **cfg.kwargs}
        if cfg.pre_hook is not None:
            cfg.pre_hook({**dict(zip(self.arg_names, args, strict=False)), **full})
        g = grid(full) if callable(grid) else grid
        launch_lean(self.fn, g, args, {**full, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages})

    def _tune(self, grid: Any, args: tuple, meta: dict, named: dict, allowed: list[triton.Config],
              device: torch.device) -> list[float]:
        """Benchmark every allowed configuration on this call's arguments: their milliseconds. The
        tensors named in `restore` are put back as they were after the trials."""
        BENCHMARKS.append((self.name, tuple(int(named[k]) for k in self.key)))
        kept = [(named[n], named[n].clone()) for n in self.restore]
        timings = []
        for cfg in allowed:
            try:
                ms = _bench(lambda c=cfg: self.run_config(c, grid, args, meta), device)
            except Exception:  # noqa: BLE001 (a configuration that does not compile or fit is skipped)
                ms = math.inf
            timings.append(ms)
        for t, copy in kept:
            t.copy_(copy)
        return timings


def _ident(config: dict[str, int]) -> tuple:
    return tuple(sorted(config.items()))
